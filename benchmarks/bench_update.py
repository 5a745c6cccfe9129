"""PPO actor update vs SFT step on the same tokens (issue 20: within 1.1x per token).

    python -m benchmarks.bench_update [--quick] [--repeats 5] [--profile ppo|sft]
                                      [--model DIR] [--logits-ab] [--share-ab]

One process, one rank, one thread: a GRPO-shaped batch (16 sequences of a ~22-token prompt +
64 response tokens, the issue's workload) goes through `RL2.algorithms.sft.sft_update` and
`RL2.algorithms.ppo.actor_update` (on-policy: one mini-batch, one epoch, no old log-probs, no
KL) on the same Actor, alternating, timed in process CPU time (insensitive to other tenants).
The table gives the median seconds of each and the ratio. `--profile` prints a torch.profiler
table of one step instead. `--model` takes an HF checkpoint instead of the issue's model (e.g.
SmolLM2 from `python -m RL2.tools.smollm2 --out DIR`); `--logits-ab` adds the PPO step with
logits at every position (`Worker.logits_for_actions_only` off) to the rounds; `--share-ab`
gives the batch 4 prompts x 4 responses and adds the PPO step with `actor.share_prompt` on (each
group's prompt computed once).
"""
import argparse
import os
import tempfile
import time

import torch

from benchmarks.common import median, setup_threads, table


def make_batch(vocab: int, n: int = 16, prompt: int = 22, response: int = 64, seed: int = 0,
               group: int = 1):
    """n sequences; `group` consecutive ones share their prompt (GRPO's responses per prompt)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(4, vocab, (prompt + response + 1,), generator=g)
        if i % group:
            ids[:prompt] = samples[-1]["input_ids"][:prompt]
        mask = torch.zeros(prompt + response)
        mask[prompt:] = 1.0
        adv = (torch.randn((), generator=g) * mask)
        samples.append({"input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask,
                        "advantages": adv})
    return samples


def build(root: str, quick: bool, model: str | None = None):
    from benchmarks.vs_trl_data import FULL_MODEL, QUICK_MODEL
    from RL2.tools.make_assets import build_tiny_model, build_tokenizer
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor

    path = model
    if path is None:
        spec = dict(QUICK_MODEL if quick else FULL_MODEL)
        tok = build_tokenizer(vocab_size=spec.pop("vocab"))
        path = os.path.join(root, "model")
        build_tiny_model(path, tok, "qwen2", **spec)
    # share_prompt off: the steps compare the same tokens (`--share-ab` switches it on for its row)
    cfg = load_config("ppo", [f"actor.model_name={path}", "data.train.path=unused",
                              "actor.rollout.env_path=unused", "actor.lr=1e-6", "kl.coef=0",
                              "actor.share_prompt=false"])
    actor = Actor(cfg.actor, "cpu", total_steps=10 ** 6)
    return actor, cfg, actor.config.vocab_size


def steps(actor, cfg, logits_ab: bool = False, share_ab: bool = False):
    from RL2.algorithms.ppo import actor_update
    from RL2.algorithms.sft import sft_update

    fns = {"sft": lambda b: sft_update(actor, b),
           "ppo": lambda b: actor_update(actor, b, cfg.actor, cfg.kl, seed=0)}
    def ppo_with(attr, value):  # the PPO step with one worker switch flipped for its duration
        def run(b):
            before = getattr(actor, attr)
            setattr(actor, attr, value)
            try:
                return fns["ppo"](b)
            finally:
                setattr(actor, attr, before)
        return run

    if logits_ab:
        fns["ppo, logits everywhere"] = ppo_with("logits_for_actions_only", False)
    if share_ab:
        fns["ppo, shared prompt"] = ppo_with("share_prompt", True)
    return fns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", choices=["sft", "ppo"])
    p.add_argument("--model", help="an HF checkpoint directory instead of the issue's model")
    p.add_argument("--logits-ab", action="store_true",
                   help="also time the PPO step with logits at every position")
    p.add_argument("--share-ab", action="store_true",
                   help="4 prompts x 4 responses; also time the PPO step with share_prompt on")
    args = p.parse_args(argv)
    setup_threads(1, "cpu")
    from RL2.parallel.mesh import init_distributed

    init_distributed("cpu")
    with tempfile.TemporaryDirectory() as root:
        actor, cfg, vocab = build(root, args.quick, args.model)
        batch = make_batch(vocab, group=4 if args.share_ab else 1)
        fns = steps(actor, cfg, args.logits_ab, args.share_ab)
        for f in fns.values():
            f(batch)  # warm-up
        if args.profile:
            from torch.profiler import profile

            with profile() as prof:
                fns[args.profile](batch)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            return
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, f in fns.items():
                start = time.process_time()
                f(batch)
                times[k].append(time.process_time() - start)
    tokens = sum(len(s["input_ids"]) for s in batch)
    ratio = median([p / s for p, s in zip(times["ppo"], times["sft"])])
    print(table(["step", "tokens", "CPU s (median)", "ms / token"],
                [[k, tokens, median(v), 1000 * median(v) / tokens] for k, v in times.items()]))
    print(f"\nPPO / SFT per token (median of per-round ratios, {args.repeats} rounds): {ratio:.3f}")
    if args.logits_ab:
        ab = median([a / e for a, e in zip(times["ppo"], times["ppo, logits everywhere"])])
        print(f"PPO with logits on action tokens only / everywhere (median of per-round ratios): {ab:.3f}")
    if args.share_ab:
        ab = median([a / e for a, e in zip(times["ppo, shared prompt"], times["ppo"])])
        print(f"PPO with shared prompts / without (median of per-round ratios): {ab:.3f}")


if __name__ == "__main__":
    main()
