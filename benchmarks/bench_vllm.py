"""Generated tokens/s of the vLLM engine vs the embedded TorchEngine vs HF `generate`, on the
workloads of bench_engine.py (one batch, one batch with per-request lengths, multi-turn
staggered), and the seconds of one full weight sync into vLLM (rl2_gloo). Run in vLLM's venv:

    bash scripts/setup_vllm_env.sh
    .venv-vllm/bin/python benchmarks/bench_vllm.py [--model assets/smollm2-135m] [--repeats 3]

The default model is bench_engine's random Qwen2 (hidden 128, 4 heads: head_dim 32, which vLLM's
CPU attention needs). Prints medians and ratios against HF.
"""
import argparse
import asyncio
import statistics
import tempfile
import threading
import time

import torch

from benchmarks import bench_engine as be
from RL2.rollout.engine import make_engine
from RL2.rollout.torch_engine import TorchEngine


class LoopThread:
    """Calls into the vLLM engine from bench_engine's per-run event loops: the engine keeps its
    own loop (AsyncLLM is bound to it), running in a thread."""

    def __init__(self, engine):
        self.engine = engine
        self.thread = threading.Thread(target=engine.loop.run_forever, daemon=True)
        self.thread.start()

    def clear_prefix_cache(self):
        pass  # vLLM's prefix cache stays warm across repeats (an advantage for it in (b))

    async def generate(self, prompt, params):
        fut = asyncio.run_coroutine_threadsafe(self.engine.generate(prompt, params), self.engine.loop)
        return await asyncio.wrap_future(fut)

    def stop(self):
        self.engine.loop.call_soon_threadsafe(self.engine.loop.stop)
        self.thread.join()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = be.build_model(args)
    path = args.model
    if path is None:
        from RL2.tools.make_assets import build_tokenizer

        path = tempfile.mkdtemp(prefix="bench_vllm_")
        model.save_pretrained(path)
        build_tokenizer(path, vocab_size=args.vocab)  # vLLM loads one from the model directory
    start = time.perf_counter()
    vllm = make_engine("vllm", path, None, max_model_len=1024, kv_cache_mb=512, ignore_eos=True)
    startup = time.perf_counter() - start
    syncs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        vllm.update_weights(model.state_dict().items())
        syncs.append(time.perf_counter() - start)
    runner = LoopThread(vllm)
    torch_engine = TorchEngine(model, None)
    rows = []
    for name, bench in [("(a) one batch", be.bench_one_batch),
                        ("(a') one batch, mixed responses", be.bench_one_batch_mixed_responses),
                        ("(b) multi-turn staggered", be.bench_multi_turn)]:
        tokens, run_hf, run_torch = bench(model, torch_engine, args)
        _, _, run_vllm = bench(model, runner, args)
        t_hf, t_torch, t_vllm = be.timed([run_hf, run_torch, run_vllm], args.repeats)
        rows.append((name, tokens, tokens / t_vllm, tokens / t_torch, tokens / t_hf))
    runner.stop()
    vllm.shutdown()
    cfg = model.config
    print(f"model: {args.model or 'random qwen2'}, hidden {cfg.hidden_size}, layers "
          f"{cfg.num_hidden_layers}, vocab {cfg.vocab_size}; threads {args.threads}; median of "
          f"{args.repeats}; vLLM start-up {startup:.0f} s; weight sync {statistics.median(syncs):.3f} s")
    print(f"{'workload':<34}{'tokens':>8}{'vLLM tok/s':>12}{'torch tok/s':>13}{'HF tok/s':>10}"
          f"{'vLLM/HF':>9}{'torch/HF':>10}")
    for name, tokens, v, t, h in rows:
        print(f"{name:<34}{tokens:>8}{v:>12.0f}{t:>13.0f}{h:>10.0f}{v / h:>9.2f}{t / h:>10.2f}")


if __name__ == "__main__":
    main()
