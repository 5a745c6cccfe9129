#!/usr/bin/env bash
# Set up (CPU torch from the local wheel, RL2 + test extras) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: this version installs from a local CPU wheel on our machines.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The shipped math and GEM environments are tested when their extras install; without them
# those tests skip (and say so) rather than failing the suite.
python -m pip install -q -e ".[math,gem]" || echo "note: extras math/gem did not install; their tests will skip" >&2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
