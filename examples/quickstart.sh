#!/usr/bin/env bash
# Quick-start on CPU, from a fresh clone: install, build offline assets (tokenizer, tiny Qwen2,
# arithmetic data), SFT warm start on answers with a systematic mistake (a+b+1 is more frequent than
# a+b), then GRPO-style PPO with an answer checker, which fixes the mistake: the greedy test reward
# (evaluated at step 0, 10, 20, 30) rises. Ends by writing a PNG of the curves.
# Usage: bash examples/quickstart.sh [NPROC]      (default 2 processes; ~2-3 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${1:-2}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
python -m pip install -q "torch==2.13.0"   # the CPU wheel on our machines; use your own torch on GPU
python -m pip install -q -e ".[plot]"

OUT=quickstart
rm -rf "$OUT/ckpts"   # a fresh run refuses a non-empty run directory: start clean
python -m RL2.tools.make_assets --out "$OUT/assets"

torchrun --nproc_per_node="$NPROC" -m RL2.trainer.sft \
    actor.model_name="$OUT/assets/model" \
    data.train.path="$OUT/assets/data/sft_biased_train.jsonl" \
    data.test.path="$OUT/assets/data/sft_biased_test.jsonl" \
    data.train.batch_size=32 actor.lr=3e-3 actor.scheduler=cosine trainer.n_epochs=8 \
    trainer.save_dir="$OUT/ckpts" trainer.experiment_name=sft

torchrun --nproc_per_node="$NPROC" -m RL2.trainer.ppo \
    actor.model_name="$OUT/ckpts/sft/final" \
    data.train.path="$OUT/assets/data/ppo_train.jsonl" \
    data.test.path="$OUT/assets/data/ppo_test.jsonl" \
    actor.rollout.env_path=envs/answer_match.py \
    actor.rollout.prompts_per_rollout=16 actor.rollout.responses_per_prompt=8 \
    actor.rollout.train_sampling_params.max_new_tokens=4 \
    actor.rollout.test_sampling_params.max_new_tokens=4 \
    actor.lr=1e-3 trainer.total_steps=30 trainer.test_freq=10 \
    trainer.save_dir="$OUT/ckpts" trainer.experiment_name=ppo

python - "$OUT/ckpts/ppo/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
r = [x["rollout/reward"] for x in rows if "rollout/reward" in x]
t = [(x["step"], x["test/reward"]) for x in rows if "test/reward" in x]
k = max(1, len(r) // 5)
print(f"PPO train reward (sampled): first {k} steps {sum(r[:k]) / k:.3f} -> last {k} steps {sum(r[-k:]) / k:.3f}")
print(f"test reward (greedy): step {t[0][0]} {t[0][1]:.3f} -> step {t[-1][0]} {t[-1][1]:.3f}  (",
      ", ".join(f"{s}: {v:.3f}" for s, v in t), ")")
PY
echo "curves: $(python -m RL2.tools.plot "$OUT/ckpts/ppo")"
