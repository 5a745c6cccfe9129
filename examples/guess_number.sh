#!/usr/bin/env bash
# Multi-turn agent on CPU: guess-the-number (envs/guess_number.py). The environment answers each
# guess with "higher" or "lower" in the same conversation; a win after k guesses is rewarded
# 1 - 0.1 (k - 1), at most 8 guesses. A tiny model is SFT-warmed on games of a cautious player
# with a bad habit (gives up at once in 30% of games; else starts at 1 half the time and steps 1-3
# toward the hint), then PPO (Dr. GRPO groups) makes it win more often in fewer
# guesses. Test: 32 sampled games per secret 1-9 before training (step 0) and every 20 steps.
# Usage: bash examples/guess_number.sh [NPROC]      (default 2 processes; ~6-12 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${1:-2}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
python -m pip install -q -e ".[plot]"

OUT=guess_demo
rm -rf "$OUT/ckpts"  # a fresh run refuses a non-empty run directory: start clean
python -m RL2.tools.make_assets --out "$OUT/assets"
python envs/guess_number.py "$OUT/game"   # prompts (secret 1-9, at most 8 guesses) + SFT games

torchrun --nproc_per_node="$NPROC" -m RL2.trainer.sft \
    actor.model_name="$OUT/assets/model" data.train.path="$OUT/game/sft_train.jsonl" \
    data.train.batch_size=32 actor.lr=3e-3 actor.scheduler=cosine trainer.n_epochs=16 \
    trainer.save_dir="$OUT/ckpts" trainer.experiment_name=sft

torchrun --nproc_per_node="$NPROC" -m RL2.trainer.ppo \
    actor.model_name="$OUT/ckpts/sft/final" \
    data.train.path="$OUT/game/prompts_train.jsonl" data.test.path="$OUT/game/prompts_test.jsonl" \
    actor.rollout.env_path=envs/guess_number.py actor.rollout.max_turns=8 \
    actor.rollout.prompts_per_rollout=16 actor.rollout.responses_per_prompt=8 \
    actor.rollout.train_sampling_params.max_new_tokens=4 \
    actor.rollout.test_sampling_params.max_new_tokens=4 \
    actor.rollout.test_sampling_params.temperature=1.0 actor.rollout.test_responses_per_prompt=32 \
    actor.avg_level=sequence actor.lr=1e-3 trainer.total_steps=60 trainer.test_freq=20 \
    trainer.save_dir="$OUT/ckpts" trainer.experiment_name=ppo

python - "$OUT/ckpts/ppo/rollouts" <<'PY'
import glob, json, os, re, sys
def step(path):
    return int(re.findall(r"\d+", os.path.basename(path))[0])
for path in sorted(glob.glob(os.path.join(sys.argv[1], "test_step*.jsonl")), key=step):
    games = [json.loads(line) for line in open(path)]
    wins = [g for g in games if g["score"] > 0]
    print(f"test step {step(path):3d}: wins {len(wins) / len(games):.3f}, guesses per win "
          f"{sum(g['num_turns'] for g in wins) / max(1, len(wins)):.2f}, per game "
          f"{sum(g['num_turns'] for g in games) / len(games):.2f}  ({len(games)} games)")
PY
echo "curves: $(python -m RL2.tools.plot "$OUT/ckpts/ppo")"
