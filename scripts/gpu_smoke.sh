#!/usr/bin/env bash
# The first command to run on a machine with one or more CUDA GPUs (about 10 minutes on one GPU):
# SFT, DPO, RM and PPO (torch engine, and SGLang when installed) on tiny offline assets; with
# >= 2 GPUs also FSDP, TP and SP layouts checked against the 1-GPU losses, and engine log-probs
# checked against the trainer's after each weight sync. Prints one PASS/FAIL table with tokens/s
# and peak GPU memory; logs of every launch are kept under gpu_smoke_runs/.
# Options go to scripts/gpu_smoke.py, e.g. `--only sft,ppo` or `--device cpu` (checks the script).
set -euo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
exec python scripts/gpu_smoke.py "$@"
