"""bench_decode_linears: the memory floor's byte count against a hand count, and a smoke run of
the script on the tiny model (no timings asserted)."""
import os
import subprocess
import sys

from benchmarks.bench_decode_linears import kv_bytes_per_step, layer_shapes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kv_bytes_follow_the_longest_row():
    m = dict(hidden=64, heads=4, kv_heads=2, layers=3, intermediate=128, vocab=32)
    # rows of 3 and 5 tokens, 3 new: steps 1 and 2 attend over 5+2 and 5+3 columns of each row
    per_column = 2 * 2 * 16 * 4 * 2 * 3  # rows x kv heads x head dim x fp32 x (K, V) x layers
    assert kv_bytes_per_step(m, [[1] * 3, [1] * 5], new=3) == per_column * 7.5
    assert layer_shapes(m) == [(64 + 2 * 32, 64), (64, 64), (256, 64), (64, 128)]


def test_quick_run_prints_the_floor_and_the_ratio():
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_decode_linears", "--quick",
                          "--threads", "1", "--repeats", "40", "--rows", "4"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| linears, cold", "| linears, hot", "| engine decode step", "| memory floor of that step"]
    assert "engine decode step / memory floor:" in out.stdout
