"""Direct preference optimisation: -logsigmoid(beta * margin of the policy/reference log-ratios)
over summed response log-probs of preference pairs (+ optional NLL on the chosen side).

Config (under `actor.`): beta, label_smoothing (conservative DPO), sft_coef (weight of the NLL
of the chosen responses, normalised by actor.avg_level over the batch), avg_level, share_prompt
(compute a pair's common prompt once: `packing.resolve_share_prompt`, `pairs.flatten_pairs`).
"""
import torch

from RL2.algorithms.losses import dpo_loss, token_metrics, token_weights
from RL2.data.pairs import flatten_pairs, pair_slots

# Sums over pairs, divided by the global number of pairs; the last slot of dpo_update holds the
# SFT term (already normalised by token_weights).
METRICS = ("loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margin",
           "logps/chosen", "logps/rejected", "sft_loss")


def metric_sums(loss, rew_c, rew_r, logp_c, logp_r) -> torch.Tensor:
    c, r = rew_c.double(), rew_r.double()
    return torch.stack([loss.detach().double().sum(), (c > r).double().sum(), c.sum(), r.sum(),
                        (c - r).sum(), logp_c.detach().double().sum(),
                        logp_r.detach().double().sum()]).cpu()


def _chosen_nll_weights(pairs: list[dict], samples: list[dict], avg_level: str) -> list[dict]:
    """NLL weights on the chosen side only (zeros on the rejected side)."""
    weights = token_weights([p["chosen"]["action_mask"] for p in pairs], avg_level)
    return [dict(s, loss_weight=weights[i // 2] if i % 2 == 0 else torch.zeros_like(s["action_mask"]))
            for i, s in enumerate(samples)]


def dpo_update(actor, pairs: list[dict], ref_logps: torch.Tensor) -> dict:
    """One optimizer step of DPO averaged over the global batch of pairs.

    `ref_logps`: (2 * len(pairs),) reference sequence log-probs laid out as `flatten_pairs`.
    """
    cfg = actor.cfg
    samples, groups = flatten_pairs(pairs, actor.share_prompt)
    packed = _chosen_nll_weights(pairs, samples, cfg.avg_level) if cfg.sft_coef else samples
    ref_logps = ref_logps.to(torch.float64)
    # Every sp rank computes the same pair losses from all-reduced sequence log-probs (whose
    # backward all-reduces the gradient): scale so FSDP's sum over ranks counts them once.
    scale = 1.0 / (len(pairs) * actor.dims.sp)
    sums = torch.zeros(len(METRICS), dtype=torch.float64)
    for mb in actor.plan(packed, groups):
        logps = actor.forward(mb)["logps"]
        seq = actor.sequence_logps(mb, logps)
        ids, chosen, rejected = pair_slots(mb)
        ids = torch.tensor(ids, dtype=torch.long)
        ref_c, ref_r = ref_logps[2 * ids].to(seq.device), ref_logps[2 * ids + 1].to(seq.device)
        loss, rew_c, rew_r = dpo_loss(seq[chosen], seq[rejected], ref_c, ref_r, cfg.beta,
                                      cfg.label_smoothing)
        total = loss.sum() * scale
        if cfg.sft_coef:
            sft = -(logps * mb.data["loss_weight"]).sum()  # tokens live on one sp rank each
            total = total + cfg.sft_coef * sft
            sums[-1] += sft.item()  # summed over every rank below, so no sp_rank gate
        total.backward()
        if actor.dims.sp_rank == 0:  # pair metrics: one copy per data-parallel rank
            sums[:-1] += metric_sums(loss, rew_c, rew_r, seq[chosen], seq[rejected])
    grad_norm = actor.step()
    totals = actor.all_reduce_metrics(sums.tolist())
    metrics = {k: v / len(pairs) for k, v in zip(METRICS[:-1], totals[:-1])}
    if cfg.sft_coef:  # loss = dpo_loss + sft_coef * sft_loss
        metrics.update(dpo_loss=metrics["loss"], sft_loss=totals[-1])
        metrics["loss"] += cfg.sft_coef * totals[-1]
    # the pairs' tokens as if unshared: the work done, comparable with share_prompt off
    return dict(metrics, grad_norm=grad_norm, lr=actor.lr, **token_metrics(flatten_pairs(pairs)[0]))


@torch.no_grad()
def dpo_eval(actor, pairs: list[dict], ref_logps: torch.Tensor) -> dict:
    """DPO loss (without the SFT term) and rewards over `pairs`; the same on every rank."""
    seq = actor.compute_sequence_logps(*flatten_pairs(pairs, actor.share_prompt))
    loss, rew_c, rew_r = dpo_loss(seq[0::2], seq[1::2], ref_logps[0::2], ref_logps[1::2],
                                  actor.cfg.beta, actor.cfg.label_smoothing)
    sums = metric_sums(loss, rew_c, rew_r, seq[0::2], seq[1::2])
    return {k: v / len(pairs) for k, v in zip(METRICS, sums.tolist())}
