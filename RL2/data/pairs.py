"""Preference data for the pair trainers (RM, DPO): tokenising a row into its two sides, laying
pairs out as one list of samples (optionally computing their shared prompt once), finding the two sides of a pair inside a packed micro-batch,
and checking that a pair fits one micro-batch."""
import torch

from RL2.data.formats import tokenize_pair
from RL2.data.packing import padded_length, shared_tail, token_capacity


def pair_tokenizer(data_cfg, tokenizer, for_reward_model: bool):
    """`tokenize(row, row_index, source) -> {"chosen", "rejected", "row"}` for Trainer.load_splits
    (reward model: all tokens + eos_mask; DPO: labels + action_mask on the response)."""
    def tokenize(row, row_index, source):
        chosen, rejected = tokenize_pair(
            row, tokenizer, for_reward_model=for_reward_model, prompt_key=data_cfg.prompt_key,
            chosen_key=data_cfg.chosen_key, rejected_key=data_cfg.rejected_key,
            messages_key=data_cfg.messages_key, apply_chat_template=data_cfg.apply_chat_template,
            max_length=data_cfg.max_length, row_index=row_index, source=source)
        return {"chosen": chosen, "rejected": rejected, "row": f"{source} row {row_index}"}
    return tokenize


def flatten_pairs(pairs: list[dict], share_prompt: bool = False) -> tuple[list[dict], list[list[int]]]:
    """Preference pairs {"chosen", "rejected", ...} -> samples [c0, r0, c1, r1, ...] and the
    groups [[0, 1], [2, 3], ...] that keep each pair in one micro-batch.

    share_prompt: each rejected side keeps only what follows the prompt it shares with its
    chosen side (`packing.shared_tail`), so the prompt is computed once per pair; the packed
    forward lets it attend to the chosen side's copy (position_ids that start past 0)."""
    if not share_prompt:
        samples = [s for p in pairs for s in (p["chosen"], p["rejected"])]
    else:
        samples = []
        for p in pairs:
            chosen = dict(p["chosen"], position_ids=torch.arange(len(p["chosen"]["input_ids"])))
            samples += [chosen, shared_tail(p["chosen"], p["rejected"])]
    return samples, [[2 * i, 2 * i + 1] for i in range(len(pairs))]


def pair_slots(mb) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(pair ids, chosen positions, rejected positions): which pairs micro-batch `mb` holds (samples
    laid out by `flatten_pairs`) and where their two sides sit among its sequences. Empty for a
    dummy micro-batch."""
    where = {idx: j for j, idx in enumerate(mb.indices)}
    ids = sorted({i // 2 for i in mb.indices})
    chosen = torch.tensor([where[2 * p] for p in ids], dtype=torch.long)
    rejected = torch.tensor([where[2 * p + 1] for p in ids], dtype=torch.long)
    return ids, chosen.to(mb.cu_seqlens.device), rejected.to(mb.cu_seqlens.device)


def check_pair_lengths(pairs: list[dict], worker_cfg, section: str = "actor"):
    """Stop before training if a pair (both sides are packed into one micro-batch) does not fit
    the per-device budget."""
    sp, capacity = worker_cfg.sp_size, token_capacity(worker_cfg)
    for p in pairs:
        sides = [len(p["chosen"]["input_ids"]), len(p["rejected"]["input_ids"])]
        need = sum(padded_length(n, sp) for n in sides)
        if need > capacity:
            raise SystemExit(
                f"{p['row']}: the pair needs {need} tokens (chosen {sides[0]} + rejected {sides[1]}"
                f"{', padded for sp' if sp > 1 else ''}) but one micro-batch holds "
                f"{section}.max_length_per_device*sp_size*tp_size = {capacity}; both sides of a "
                f"pair share a micro-batch, so a pair can need up to 2*data.train.max_length "
                f"tokens: raise {section}.max_length_per_device or {section}.sp_size, or lower "
                f"data.train.max_length")
