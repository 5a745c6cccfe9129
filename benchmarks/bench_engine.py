"""Generated tokens/s of the embedded TorchEngine vs HF `generate` on a tiny random Qwen2.

    python benchmarks/bench_engine.py [--hidden 128 --layers 4 --vocab 1024 --repeats 3]
    python benchmarks/bench_engine.py --model assets/smollm2-135m   # a real model (RL2.tools.smollm2)

(a) one batch: many mixed-length prompts submitted at once (HF: one left-padded generate call),
    every response max_new_tokens long (the same padded work for both).
(a') the same prompts, each response with its own length (as when eos comes at different points):
    HF generate runs the batch to the longest response, the engine evicts finished rows.
(b) multi-turn, staggered: agents start at different times; each turn generates a response of its
    own length, then an "environment" sleeps a few ms and appends observation tokens. HF baseline:
    static batching (every request waiting at that moment goes into one generate call, run to the
    longest response in the batch). Same tokens are counted for both; greedy, eos disabled.
Prints the median of `--repeats` runs and the engine / HF ratio.
"""
import argparse
import asyncio
import random
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine


def build_model(args):
    if args.model:  # a real checkpoint, e.g. SmolLM2-135M from `python -m RL2.tools.smollm2`
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        args.vocab = model.config.vocab_size
        return model
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048)
    return Qwen2ForCausalLM(cfg).eval()


@torch.no_grad()
def hf_generate(model, prompts, max_new_tokens):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def one_batch_workload(args, rng):
    tokens = lambda lo, hi: [rng.randrange(args.vocab) for _ in range(rng.randint(lo, hi))]
    prompts = [tokens(8, 64) for _ in range(args.prompts)]
    return prompts, args.max_new_tokens


def bench_one_batch(model, engine, args):
    prompts, new = one_batch_workload(args, random.Random(0))
    tokens = len(prompts) * new

    def run_hf():
        hf_generate(model, prompts, new)

    async def run_engine():
        engine.clear_prefix_cache()
        params = SamplingParams(temperature=0, max_new_tokens=new)
        await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return tokens, run_hf, lambda: asyncio.run(run_engine())


def bench_one_batch_mixed_responses(model, engine, args):
    """(a) with a response length of its own per prompt (8..max_new_tokens), as when responses
    end with eos at different points: HF generate runs the batch to the longest one."""
    prompts, new = one_batch_workload(args, random.Random(0))
    rng = random.Random(2)
    lengths = [rng.randint(8, new) for _ in prompts]
    tokens = sum(lengths)

    def run_hf():
        hf_generate(model, prompts, max(lengths))

    async def run_engine():
        engine.clear_prefix_cache()
        await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0, max_new_tokens=n))
                               for p, n in zip(prompts, lengths)])
    return tokens, run_hf, lambda: asyncio.run(run_engine())


def agent_plan(args, seed):
    """Per agent: start delay, first prompt, and per turn (response length, env delay, obs tokens)."""
    rng = random.Random(seed)
    tokens = lambda lo, hi: [rng.randrange(args.vocab) for _ in range(rng.randint(lo, hi))]
    plans = []
    for _ in range(args.agents):
        turns = [(rng.randint(8, args.max_new_tokens), rng.uniform(0.0, 0.02), tokens(4, 16))
                 for _ in range(args.turns)]
        plans.append((rng.uniform(0, 0.05), tokens(8, 48), turns))
    return plans


async def run_agents(plans, generate):
    async def agent(start, prompt, turns):
        await asyncio.sleep(start)
        context = list(prompt)
        for length, delay, obs in turns:
            response = await generate(context, length)
            assert len(response) == length
            await asyncio.sleep(delay)  # the environment step
            context += response + obs
    await asyncio.gather(*[agent(*plan) for plan in plans])


class StaticBatcher:
    """HF baseline server: batch whatever is waiting, run generate to the longest request."""

    def __init__(self, model):
        self.model, self.waiting, self.wakeup = model, [], None

    async def generate(self, prompt, length):
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((prompt, length, fut))
        self.wakeup.set()
        return await fut

    async def serve(self):
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            batch, self.waiting = self.waiting, []
            if not batch:
                continue
            outs = hf_generate(self.model, [p for p, _, _ in batch], max(n for _, n, _ in batch))
            for (_, n, fut), out in zip(batch, outs):
                fut.set_result(out[:n])
            await asyncio.sleep(0)


def bench_multi_turn(model, engine, args):
    plans = agent_plan(args, seed=1)
    tokens = sum(n for _, _, turns in plans for n, _, _ in turns)

    async def run_hf():
        server = StaticBatcher(model)
        server.wakeup = asyncio.Event()
        task = asyncio.create_task(server.serve())
        await run_agents(plans, server.generate)
        task.cancel()

    async def run_engine():
        engine.clear_prefix_cache()  # no reuse across repeats: each run starts cold

        async def gen(context, length):
            out = await engine.generate(context, SamplingParams(temperature=0, max_new_tokens=length))
            return out[0].token_ids
        await run_agents(plans, gen)
    return tokens, lambda: asyncio.run(run_hf()), lambda: asyncio.run(run_engine())


def timed(fns, repeats):
    """Median seconds of each function; runs are interleaved so that both see the same load."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="HF model directory (random prompt ids over its vocab) instead of a random Qwen2")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=32, help="(a) number of prompts")
    parser.add_argument("--agents", type=int, default=32, help="(b) number of agents")
    parser.add_argument("--turns", type=int, default=4, help="(b) turns per agent")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile-decode", action="store_true",
                        help="the engine's decode step compiled (RL2/rollout/compiled_decode.py)")
    parser.add_argument("--no-small-gemm", dest="small_gemm", action="store_false",
                        help="decode-step products on oneDNN, not RL2's AVX-512 kernel")
    parser.add_argument("--ab-small-gemm", action="store_true",
                        help="also time an engine without the kernel, alternating in this run")
    parser.add_argument("--ab-fused", action="store_true",
                        help="also time an engine whose kernel does the products only, the "
                             "norms, residual adds, activation, rotary and attention left to "
                             "eager ops (before fix 26), alternating in this run")
    parser.add_argument("--ab-whole-layer", action="store_true",
                        help="also time an engine that runs the kernel's fused ops one call at a "
                             "time, without decode_layers (before fix 27), alternating in this run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    engine = TorchEngine(model, None, compile_decode=args.compile_decode, small_gemm=args.small_gemm)
    other, label = None, ""
    if args.ab_small_gemm or args.ab_fused or args.ab_whole_layer:
        other = TorchEngine(model, None, compile_decode=args.compile_decode,
                            small_gemm=args.small_gemm and not args.ab_small_gemm)
        label = ("oneDNN engine" if args.ab_small_gemm else "unfused engine" if args.ab_fused
                 else "op-by-op engine")
        if args.ab_fused or args.ab_whole_layer:  # llama_forward then runs them one by one
            other.runner.linear.decode_layers = None
        if args.ab_fused:  # and as eager ops
            other.runner.linear.fused = other.runner.linear.attention = None
    rows = []
    workloads = [("(a) one batch", bench_one_batch),
                 ("(a') one batch, mixed responses", bench_one_batch_mixed_responses),
                 ("(b) multi-turn staggered", bench_multi_turn)]
    for name, bench in workloads:
        tokens, run_hf, run_engine = bench(model, engine, args)
        fns = [run_hf, run_engine] + ([bench(model, other, args)[2]] if other else [])
        t_hf, t_engine, *t_other = timed(fns, args.repeats)
        rows.append((name, tokens, tokens / t_engine, tokens / t_hf, [tokens / t for t in t_other]))
    cfg = model.config
    name = f"{args.model} ({cfg.model_type}), " if args.model else ""
    print(f"model: {name}hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, vocab {cfg.vocab_size}; "
          f"threads {args.threads}; median of {args.repeats}; "
          f"small_gemm {getattr(getattr(engine.runner, 'linear', None), 'small', False)}")
    extra = f"{label:>15}{'/HF':>6}" if other else ""
    print(f"{'workload':<34}{'tokens':>8}{'engine tok/s':>14}{'HF tok/s':>12}{'engine/HF':>11}{extra}")
    for name, tokens, eng, hf, off in rows:
        extra = "".join(f"{o:>15.0f}{o / hf:>6.2f}" for o in off)
        print(f"{name:<34}{tokens:>8}{eng:>14.0f}{hf:>12.0f}{eng / hf:>11.2f}{extra}")


if __name__ == "__main__":
    main()
