"""PPO update steps for the actor (clipped policy loss + KL/entropy/TIS terms) and the critic
(clipped value loss). Each mini-batch is one optimizer step; losses are normalised over the
whole mini-batch (token or sequence level) so micro-batching and world size do not matter."""
import torch

from RL2.algorithms.losses import kl_estimator, policy_loss, tis_weight, token_weights, value_loss


def mini_batches(samples: list[dict], n: int, seed: int) -> list[list[dict]]:
    """Split a rollout batch into `n` shuffled mini-batches (same split on every rank)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    return [[samples[i] for i in order[k::n]] for k in range(n) if order[k::n]]


def _weighted(samples, avg_level):
    weights = token_weights([s["action_mask"] for s in samples], avg_level)
    return [dict(s, loss_weight=w) for s, w in zip(samples, weights)]


def actor_update(actor, samples: list[dict], cfg, kl_cfg, seed: int) -> dict:
    """cfg = the actor config (clip, clip_high, dual_clip, entropy_coef, tis_coef, avg_level,
    update_per_rollout, rollout temperature); samples carry advantages (+ old/ref/engine logps)."""
    temperature = cfg.rollout.train_sampling_params.temperature or 1.0
    use_kl_loss = kl_cfg.coef > 0 and kl_cfg.type == "loss"
    sums = dict(loss=0.0, clip_ratio=0.0, entropy=0.0, approx_kl=0.0, kl_loss=0.0)
    grad_norms = []
    batches = mini_batches(samples, cfg.update_per_rollout, seed)
    for batch in batches:
        for mb in actor.plan(_weighted(batch, cfg.avg_level)):
            d = mb.data
            out = actor.forward(mb, temperature=temperature, need_entropy=True)
            logps, w = out["logps"], d["loss_weight"]
            # A single update on fresh samples has old == current: ratio 1, exact gradient.
            old = d["old_logps"] if "old_logps" in d else logps.detach()
            loss, stats = policy_loss(logps, old, d["advantages"], cfg.clip, cfg.clip_high, cfg.dual_clip)
            if cfg.tis_coef:
                loss = loss * tis_weight(old, d["engine_logps"], cfg.tis_coef)
            if use_kl_loss:
                kl = kl_estimator(logps, d["ref_logps"], kl_cfg.loss_estimator)
                loss = loss + kl_cfg.coef * kl
                sums["kl_loss"] += (kl.detach() * w).sum().item()
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * out["entropy"]
            total = (loss * w).sum()
            total.backward()
            sums["loss"] += total.item()
            sums["clip_ratio"] += (stats["clipped"].float() * w).sum().item()
            sums["entropy"] += (out["entropy"].detach() * w).sum().item()
            sums["approx_kl"] += ((old - logps.detach()) * w).sum().item()
        grad_norms.append(actor.step())
    # Each sum is a mean over one mini-batch; average over mini-batches.
    metrics = {k: actor.all_reduce_metric(v) / len(batches) for k, v in sums.items()}
    metrics.update(grad_norm=sum(grad_norms) / len(grad_norms), lr=actor.lr)
    if not use_kl_loss:
        metrics.pop("kl_loss")
    return metrics


def critic_update(critic, samples: list[dict], cfg, seed: int) -> dict:
    """Clipped value regression of `values` onto `returns` on action tokens."""
    sums = dict(value_loss=0.0, value_clip_ratio=0.0)
    grad_norms = []
    batches = mini_batches(samples, cfg.update_per_rollout, seed)
    for batch in batches:
        for mb in critic.plan(_weighted(batch, cfg.avg_level)):
            d = mb.data
            values = critic.forward(mb)["values"]
            loss, clipped = value_loss(values, d["values"], d["returns"], cfg.clip)
            total = (loss * d["loss_weight"]).sum()
            total.backward()
            sums["value_loss"] += total.item()
            sums["value_clip_ratio"] += (clipped.float() * d["loss_weight"]).sum().item()
        grad_norms.append(critic.step())
    metrics = {k: critic.all_reduce_metric(v) / len(batches) for k, v in sums.items()}
    metrics.update(value_grad_norm=sum(grad_norms) / len(grad_norms), value_lr=critic.lr)
    return metrics
