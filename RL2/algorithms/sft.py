"""Supervised fine-tuning: NLL of the trained tokens (`action_mask`), normalised over the global
batch by `actor.avg_level` (token: over all trained tokens; sequence: per sequence, then over
sequences)."""
import torch

from RL2.algorithms.losses import token_metrics, with_token_weights


def sft_update(actor, samples: list[dict]) -> dict:
    """One optimizer step of the actor on a global batch of SFT samples."""
    weighted = with_token_weights(samples, actor.cfg.avg_level)
    loss_sum = 0.0
    for mb in actor.plan(weighted):
        loss = -(actor.forward(mb)["logps"] * mb.data["loss_weight"]).sum()
        loss.backward()
        loss_sum += loss.item()
    grad_norm = actor.step()
    return {"loss": actor.all_reduce_metric(loss_sum), "grad_norm": grad_norm, "lr": actor.lr,
            **token_metrics(samples)}


@torch.no_grad()
def sft_eval(actor, samples: list[dict]) -> dict:
    """Loss of the test split, normalised over the whole split (the same on every rank)."""
    weighted = with_token_weights(samples, actor.cfg.avg_level)
    logps = actor.compute_logps(samples)
    return {"loss": -sum((lp * s["loss_weight"]).sum().item() for lp, s in zip(logps, weighted))}
