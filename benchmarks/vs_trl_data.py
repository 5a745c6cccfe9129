"""Shared assets of bench_vs_trl: the model (Qwen2 from a config), its tokenizer, and the three
workloads written once as JSON so TRL and RL2 read the same rows.

- sft: token-id sequences, SFT_ROW lengths per step, loss on every token;
- dpo: text pairs (prompt ~64 tokens, chosen/rejected ~128), tokenized by each library;
- grpo: short text prompts (~20 tokens), no chat template.
"""
import json
import os
import random

import torch

# The model: Qwen2, hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 2048 (25.7M params).
FULL_MODEL = dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536, vocab=2048)
QUICK_MODEL = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
# The sequences of one SFT step (1020 tokens): best-fit decreasing into 1024-token rows puts
# exactly one of each length in every row (no two 600s fit together, and so on down), so every
# step of TRL's packed, shuffled rows and of RL2's steps holds the same shapes whatever the order.
SFT_ROW = (600, 250, 100, 50, 20)


def _words(rng: random.Random, n: int) -> str:
    from RL2.tools.make_assets import WORDS

    return " ".join(rng.choices(WORDS, k=n))


def build_assets(root: str, model: dict | str, n_sft: int = 8, n_pairs: int = 64,
                 n_prompts: int = 64, seed: int = 0) -> str:
    """Write root/model (config-built weights + tokenizer from the `model` spec, or a link to
    the checkpoint directory `model`) and root/{sft,dpo,grpo}.json."""
    from RL2.tools.make_assets import build_tiny_model, build_tokenizer

    if isinstance(model, str):  # a checkpoint with its tokenizer, e.g. SmolLM2
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        link = os.path.join(root, "model")
        if os.path.lexists(link):  # a root used before
            os.remove(link)
        os.symlink(os.path.abspath(model), link)
    else:
        kw = dict(model)
        tok = build_tokenizer(vocab_size=kw.pop("vocab"))
        build_tiny_model(os.path.join(root, "model"), tok, "qwen2", max_pos=2048, **kw)
    g = torch.Generator().manual_seed(seed)
    sft = [{"input_ids": torch.randint(4, len(tok), (n,), generator=g).tolist()}
           for _ in range(n_sft) for n in SFT_ROW]
    rng = random.Random(seed)
    dpo = [{"prompt": _words(rng, 48) + "\n", "chosen": " " + _words(rng, 96),
            "rejected": " " + _words(rng, 96)} for _ in range(n_pairs)]
    grpo = [{"prompt": _words(rng, 16) + " answer:", "extra_info": {}} for _ in range(n_prompts)]
    for name, rows in (("sft", sft), ("dpo", dpo), ("grpo", grpo)):
        with open(os.path.join(root, f"{name}.json"), "w") as f:
            json.dump(rows, f)
    with open(os.path.join(root, "grpo.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in grpo)
    return os.path.join(root, "model")


def load_rows(root: str, name: str) -> list[dict]:
    with open(os.path.join(root, f"{name}.json")) as f:
        return json.load(f)


def sft_steps(rows: list[dict], capacity: int) -> list[list[dict]]:
    """Sequences grouped into steps of <= capacity tokens by best-fit decreasing (what TRL's BFD
    packing does to one row per step), as RL2 samples (input_ids, labels, action_mask)."""
    bins: list[list] = []
    for r in sorted(rows, key=lambda r: -len(r["input_ids"])):
        n = len(r["input_ids"])
        fits = [b for b in bins if b[0] + n <= capacity]
        if fits:
            best = min(fits, key=lambda b: capacity - b[0])
            best[0] += n
            best[1].append(r)
        else:
            bins.append([n, [r]])
    steps = []
    for _, group in bins:
        samples = []
        for r in group:
            ids = torch.tensor(r["input_ids"])
            # HF causal LM loss: every position predicts the next token; the last has no label.
            samples.append({"input_ids": ids, "labels": torch.cat([ids[1:], ids[:1]]),
                            "action_mask": torch.cat([torch.ones(len(ids) - 1), torch.zeros(1)])})
        steps.append(samples)
    return steps


def dpo_pairs(rows: list[dict], tok) -> list[dict]:
    """RL2 pairs tokenized as TRL does: prompt, prompt + response + eos, the response starting
    where the two token lists diverge."""
    def side(prompt, response):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        full = tok(prompt + response + tok.eos_token, add_special_tokens=False)["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(p, full)) if a != b), len(p))
        ids = torch.tensor(full)
        mask = torch.zeros(len(full) - 1)
        mask[max(start - 1, 0):] = 1.0
        return {"input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask}

    return [{"chosen": side(r["prompt"], r["chosen"]), "rejected": side(r["prompt"], r["rejected"])}
            for r in rows]
