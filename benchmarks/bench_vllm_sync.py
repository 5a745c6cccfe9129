"""Weight sync into a vLLM engine from each training layout: after the sync the engine's
sampled-token log-probs must equal the trainer's log-probs of the same tokens, and the seconds of
one sync are measured. Run in vLLM's venv (bash scripts/setup_vllm_env.sh):

    .venv-vllm/bin/python -m benchmarks.bench_vllm_sync --model assets/smollm2-135m --data DATA.jsonl

DATA.jsonl: SFT rows with `prompt`/`response` (make_assets' sft_train.jsonl). Layouts run in one
job per world size (1: serial; 2: fsdp2, tp2; 4: ddp2xfsdp2, ddp2xtp2), each job sharing one vLLM
engine held by rank 0 (as a rollout group leader holds it in PPO); the other ranks pass no engine.
tests/vllm/test_vllm_layouts.py runs `sync_and_compare` on a tiny model.
"""
import argparse
import asyncio
import os
import statistics

import torch
import torch.distributed as dist

from tests.run_utils import layout

# the layouts of tests/run_utils.py's table this benchmark runs by default
DEFAULT_LAYOUTS = ["serial", "fsdp2", "tp2", "ddp2xfsdp2", "ddp2xtp2"]
TEMPERATURE = 0.7


def _samples(engine, tok, rows, n_prompts: int, max_new_tokens: int):
    """Rank 0 samples one response per prompt (seeded); returns (prompt ids, outputs)."""
    from RL2.rollout.engine import SamplingParams

    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": rows[i]["prompt"]}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for i in range(n_prompts)]

    async def gen():
        return await asyncio.gather(*[engine.generate(ids, SamplingParams(
            temperature=TEMPERATURE, max_new_tokens=max_new_tokens, seed=i)) for i, ids in enumerate(prompts)])

    outs = engine.loop.run_until_complete(gen())
    return [(ids, out.token_ids, out.logprobs) for ids, (out,) in zip(prompts, outs)]


def _trainer_logps(actor, sampled) -> list[list[float]]:
    """The trainer's log-probs of the sampled tokens (a collective over the actor's ranks)."""
    samples = []
    for prompt, tokens, _ in sampled:
        full = prompt + tokens
        mask = torch.zeros(len(full) - 1)
        mask[len(prompt) - 1:] = 1
        samples.append({"input_ids": torch.tensor(full[:-1]), "labels": torch.tensor(full[1:]),
                        "action_mask": mask})
    logps = actor.compute_logps(samples, temperature=TEMPERATURE)
    return [lp[len(p) - 1:].tolist() for (p, _, _), lp in zip(sampled, logps)]


def sync_and_compare(rank, world, model_dir, data_path, layouts, lr=1e-2, repeats=1,
                     n_prompts=4, max_new_tokens=12, kv_cache_mb=64):
    """For each layout in turn (all of `world` ranks): build the actor, one SFT step on its own rows
    (so each layout's weights differ from the engine's), sync (timed, `repeats` times), sample on
    rank 0, compare with the trainer's log-probs. Returns per layout (rank 0): max |engine -
    trainer| log-prob, sync seconds (first, with the transfer group's set-up; later ones), bytes."""
    from transformers import AutoTokenizer

    from RL2.algorithms.sft import sft_update
    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows
    from RL2.rollout.engine import make_engine
    from RL2.rollout.weight_sync import WeightSync
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(data_path)
    engine = None
    if rank == 0:  # the rollout leader's engine; vLLM runs its engine core in a child process
        engine = make_engine("vllm", model_dir, tok, max_model_len=512, kv_cache_mb=kv_cache_mb)
    results, previous = {}, None
    for i, name in enumerate(layouts):
        cfg = load_config("sft", [f"actor.model_name={model_dir}", f"data.train.path={data_path}",
                                  f"actor.lr={lr}", *layout(name)[1]])
        actor = Actor(cfg.actor, "cpu", total_steps=1)
        part = range(8 * i, 8 * i + 8)
        sft_update(actor, [tokenize_sft(rows[j], tok, max_length=256, row_index=j, source="x") for j in part])
        sync = WeightSync(actor.model, "auto", 512)
        times = [sync(engine)["sync_seconds"] for _ in range(repeats)]
        sampled = [None]
        if rank == 0:
            sampled[0] = _samples(engine, tok, rows, n_prompts, max_new_tokens)
        dist.broadcast_object_list(sampled, src=0)
        trainer = _trainer_logps(actor, sampled[0])
        if rank == 0:
            err = max(abs(a - b) for (_, _, e), t in zip(sampled[0], trainer) for a, b in zip(e, t))
            engine_out = [(tuple(toks), tuple(lps)) for _, toks, lps in sampled[0]]
            results[name] = {"max_err": err, "first_s": times[0], "later_s": times[1:],
                             "version": engine.weight_version(), "tokens": sum(len(s[1]) for s in sampled[0]),
                             "changed": previous is None or engine_out != previous}
            previous = engine_out
        del actor, sync
    if engine is not None:
        engine.shutdown()
    return results


def main():
    from tests.dist_utils import run_dist

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    by_world = {}
    for name in args.layouts.split(","):
        by_world.setdefault(layout(name)[0], []).append(name)
    print(f"model {args.model}; sync seconds: first (with the transfer group's set-up) and the "
          f"median of {args.repeats - 1} more; max |engine - trainer| log-prob at T={TEMPERATURE}")
    print(f"{'layout':<12}{'ranks':>6}{'first s':>9}{'median s':>10}{'max err':>10}{'tokens':>8}")
    for world, names in sorted(by_world.items()):
        (res, *_) = run_dist(sync_and_compare, world, args.model, args.data, names, args.lr,
                             args.repeats, 4, 16, 256, timeout=3600)
        for name in names:
            r = res[name]
            later = statistics.median(r["later_s"]) if r["later_s"] else float("nan")
            print(f"{name:<12}{world:>6}{r['first_s']:>9.2f}{later:>10.2f}{r['max_err']:>10.1e}{r['tokens']:>8}")


if __name__ == "__main__":
    main()
