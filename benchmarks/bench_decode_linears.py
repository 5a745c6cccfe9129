"""What bounds the embedded engine's decode step (issue 20): its linear layers alone against the
whole step, on the bench_vs_trl model (Qwen2, hidden 512, 8 layers, 8 / 4 heads, vocab 2048).

    python -m benchmarks.bench_decode_linears [--threads 2 --rows 16 --repeats 200] [--quick]

- linears, cold: every layer's q/k/v, o, gate/up and down projections with its own
  oneDNN-packed weights, as the engine's runner calls them (RL2/utils/onednn.py), on `rows` new
  tokens: the weights stream from memory every step (the model is bigger than the L3 cache).
- linears, hot: one layer's weights for all layers (in cache): the matmul rate without the stream.
- engine step: TorchEngine decoding `rows` greedy requests; (time for 64 new tokens - time for 1)
  / 63, so the prefill is left out. What it adds to "linears, cold" is attention over the KV
  cache, the small ops between the matmuls, the LM head and sampling, and Python.
- memory floor: the bytes a decode step must read (the linear and LM-head weights, and each
  layer's keys and values over the live window: every row is right-aligned in the engine's
  cache, so the window is the longest row, rows x (longest + 1) columns) at the rate the cold
  linears streamed their weights. At a few rows per step decode is bound by memory, not FLOPs.
Medians; rates also as a fraction of the same run's square-matmul peak (benchmarks/common.py).
"""
import argparse
import asyncio
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.common import machine_description, matmul_peak, table
from benchmarks.vs_trl_data import FULL_MODEL, QUICK_MODEL
from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine
from RL2.utils.onednn import _mm


def layer_shapes(m: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections as the runner stacks them."""
    h, kv = m["hidden"], m["kv_heads"] * m["hidden"] // m["heads"]
    return [(h + 2 * kv, h), (h, h), (2 * m["intermediate"], h), (h, m["intermediate"])]


def time_linears(m: dict, rows: int, repeats: int) -> dict[str, float]:
    shapes = layer_shapes(m)
    pack = lambda o, i: torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i) * 0.02, None)
    layers = [[pack(o, i) for o, i in shapes] for _ in range(m["layers"])]
    x = {i: torch.randn(rows, i) for _, i in shapes}

    def step(weights):
        start = time.perf_counter()
        for ws in weights:
            for w, (_, i) in zip(ws, shapes):
                _mm(x[i], w, None)
        return time.perf_counter() - start
    out = {}
    for name, weights in (("cold", layers), ("hot", [layers[0]] * m["layers"])):
        times = [step(weights) for _ in range(repeats + repeats // 10)][repeats // 10:]
        out[name] = statistics.median(times)
    return out


def prompts_of(m: dict, rows: int) -> list[list[int]]:
    return [[(7 * r + 3 * j) % m["vocab"] for j in range(40 + 8 * r)] for r in range(rows)]


def kv_bytes_per_step(m: dict, prompts: list[list[int]], new: int = 64) -> float:
    """Keys and values read by the mean decode step of `new` tokens (fp32): step t writes
    column longest + t and attends over longest + t + 1 columns of every row."""
    head_dim = m["hidden"] // m["heads"]
    per_column = len(prompts) * m["kv_heads"] * head_dim * 4 * 2 * m["layers"]
    longest = max(map(len, prompts))
    return per_column * statistics.mean(longest + t + 1 for t in range(1, new))


def time_engine_step(m: dict, rows: int, repeats: int, compile_decode: bool) -> float:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=m["vocab"], hidden_size=m["hidden"],
                      intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
                      num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                      max_position_embeddings=1024, tie_word_embeddings=True)
    engine = TorchEngine(Qwen2ForCausalLM(cfg).eval(), None, compile_decode=compile_decode)
    prompts = prompts_of(m, rows)

    def run(new):
        async def go():
            engine.clear_prefix_cache()  # each run prefills again
            params = SamplingParams(temperature=0, max_new_tokens=new)
            await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        start = time.perf_counter()
        asyncio.run(go())
        return time.perf_counter() - start
    run(64), run(1)  # warm-up (and compilation)
    steps = []
    for _ in range(repeats):
        steps.append((run(64) - run(1)) / 63)
    return statistics.median(steps)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="tokens per decode step (requests)")
    p.add_argument("--repeats", type=int, default=200, help="linears timings (engine: / 40)")
    p.add_argument("--compile-decode", action="store_true")
    p.add_argument("--quick", action="store_true", help="bench_vs_trl's tiny model (smoke test)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    m = QUICK_MODEL if args.quick else FULL_MODEL
    peak = matmul_peak("cpu", torch.float32)
    per_layer = sum(o * i for o, i in layer_shapes(m))
    flop, weight_bytes = 2 * args.rows * per_layer * m["layers"], 4 * per_layer * m["layers"]
    lin = time_linears(m, args.rows, args.repeats)
    step = time_engine_step(m, args.rows, max(3, args.repeats // 40), args.compile_decode)
    rows = [[f"linears, {k}", t * 1e3, flop / t / 1e9, f"{flop / t / peak:.0%}",
             weight_bytes / t / 1e9] for k, t in lin.items()]
    # what a step reads: the layers' and the LM head's weights, and the KV window
    step_bytes = weight_bytes + 4 * m["vocab"] * m["hidden"] + kv_bytes_per_step(
        m, prompts_of(m, args.rows))
    floor = step_bytes / (weight_bytes / lin["cold"])
    rows.append(["engine decode step" + (" (compiled)" if args.compile_decode else ""),
                 step * 1e3, flop / step / 1e9, f"{flop / step / peak:.0%}",
                 step_bytes / step / 1e9])
    rows.append(["memory floor of that step", floor * 1e3, flop / floor / 1e9,
                 f"{flop / floor / peak:.0%}", step_bytes / floor / 1e9])
    print(machine_description("cpu", args.threads))
    print(f"matmul peak {peak / 1e9:.0f} GFLOP/s; {args.rows} tokens per step; linear weights "
          f"{weight_bytes / 1e6:.0f} MB, a decode step reads {step_bytes / 1e6:.0f} MB (with "
          f"the LM head and the KV window); GFLOP/s counts the linear layers' work only\n")
    print(table(["", "ms per step", "GFLOP/s", "of peak", "GB/s read"], rows))
    print(f"\nengine decode step / memory floor: {step / floor:.2f}")


if __name__ == "__main__":
    main()
