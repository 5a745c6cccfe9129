#!/usr/bin/env bash
# examples/smollm2_ppo.sh with LoRA adapters (rank 16, frozen base) instead of full fine-tuning:
# lr 1e-4 (adapters need a far larger lr than full fine-tuning's 2e-6); the torch engine gets the
# merged weights (base + B@A*alpha/rank) after every step.
# Usage: bash examples/smollm2_lora_ppo.sh [NPROC] [STEPS]      (defaults: 2 processes, 10 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
LR="${LR:-1e-4}" EXP="${EXP:-ppo_lora}" exec bash examples/smollm2_ppo.sh "${1:-2}" "${2:-10}" \
    actor.lora.rank=16 actor.lora.alpha=32
