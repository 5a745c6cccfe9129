#!/usr/bin/env bash
# examples/smollm2_vllm_ppo.sh with LoRA adapters (rank 16, frozen base; the settings of
# examples/smollm2_lora_ppo.sh): after every step only the adapters travel, written as a PEFT
# directory that vLLM loads as a new adapter (actor.rollout.lora_sync=auto -> adapter).
# Usage: bash examples/smollm2_vllm_lora_ppo.sh [NPROC] [STEPS]   (defaults: 2 processes, 10 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
LR="${LR:-1e-4}" EXP="${EXP:-ppo_vllm_lora}" exec bash examples/smollm2_vllm_ppo.sh "${1:-2}" "${2:-10}" \
    actor.lora.rank=16 actor.lora.alpha=32 "${@:3}"
