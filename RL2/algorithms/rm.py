"""Reward modelling: the Bradley-Terry loss -logsigmoid(r_chosen - r_rejected) on preference pairs,
where a sequence's reward is the value head's output at its last token (`eos_mask`)."""
import torch

from RL2.algorithms.losses import rm_loss, token_metrics
from RL2.data.pairs import flatten_pairs, pair_slots

METRICS = ("loss", "accuracy", "margin", "reward/chosen", "reward/rejected")


def metric_sums(loss, correct, r_chosen, r_rejected) -> torch.Tensor:
    """Sums over pairs of METRICS (divided by the global pair count by the caller)."""
    c, r = r_chosen.detach().double(), r_rejected.detach().double()
    return torch.stack([loss.detach().double().sum(), correct.double().sum(), (c - r).sum(),
                        c.sum(), r.sum()]).cpu()


def rm_update(model, pairs: list[dict]) -> dict:
    """One optimizer step of the reward model (a value worker) averaged over the global pairs;
    with `share_prompt`, each rejected side continues its chosen side's prompt (computed once)."""
    samples, groups = flatten_pairs(pairs, model.share_prompt)
    # Every sp rank computes the same pair losses (rewards are all-reduced over sp, whose
    # backward all-reduces the gradient): scale so FSDP's sum over ranks counts them once.
    scale = 1.0 / (len(pairs) * model.dims.sp)
    sums = torch.zeros(len(METRICS), dtype=torch.float64)
    for mb in model.plan(samples, groups):
        rewards = model.masked_values(mb, model.forward(mb)["values"])
        _, chosen, rejected = pair_slots(mb)
        loss, correct = rm_loss(rewards[chosen], rewards[rejected])
        (loss.sum() * scale).backward()
        if model.dims.sp_rank == 0:  # metrics: one copy per data-parallel rank
            sums += metric_sums(loss, correct, rewards[chosen], rewards[rejected])
    grad_norm = model.step()
    metrics = {k: v / len(pairs) for k, v in zip(METRICS, model.all_reduce_metrics(sums.tolist()))}
    # the pairs' tokens as if unshared: the work done, comparable with share_prompt off
    return dict(metrics, grad_norm=grad_norm, lr=model.lr,
                **token_metrics(flatten_pairs(pairs)[0], "eos_mask"))


@torch.no_grad()
def rm_eval(model, pairs: list[dict]) -> dict:
    """Mean loss, accuracy, margin and rewards over `pairs` (every rank gets the same)."""
    samples, groups = flatten_pairs(pairs, model.share_prompt)
    rewards = model.compute_rewards(samples, groups=groups)
    loss, correct = rm_loss(rewards[0::2], rewards[1::2])
    sums = metric_sums(loss, correct, rewards[0::2], rewards[1::2])
    return {k: v / len(pairs) for k, v in zip(METRICS, sums.tolist())}
