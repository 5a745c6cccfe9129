"""The PPO algorithm on a rollout batch: advantages from rewards (+KL, values), then the update steps
of the actor (clipped policy loss + KL/entropy/TIS terms) and the critic (clipped value loss).

Each mini-batch is one optimizer step; losses are normalised over the whole mini-batch (token or
sequence level, `token_weights`) so micro-batching and world size do not change them.
"""
from collections import defaultdict

import torch

from RL2.algorithms.advantages import apply_kl_to_rewards, compute_gae, outcome_advantages, whiten
from RL2.algorithms.losses import (cispo_loss, gspo_loss, kl_estimator, policy_loss, tis_weight, upcast,
                                   value_loss, with_token_weights)
from RL2.algorithms.on_policy import check_first_ratio, ratio_tol
from RL2.parallel.collectives import sequence_sums
from RL2.utils.seeding import derive_seed


# ----- advantages -----
def trajectory_gae(samples: list[dict], rewards: list[torch.Tensor], owner: list[int],
                   gamma: float, lamda: float) -> tuple[list, list]:
    """GAE over each TRAJECTORY: its sequences (one per non-extending env turn) are chained in
    order, so the last action of one sequence bootstraps from the value at the first action of
    the next, and a final reward reaches every earlier turn. Environment tokens (action_mask 0)
    are not MDP steps. Returns per-sample (advantages, returns)."""
    by_traj = defaultdict(list)
    for i, o in enumerate(owner):
        by_traj[o].append(i)
    advantages, returns = [None] * len(samples), [None] * len(samples)
    for idx in by_traj.values():
        cat = lambda xs: torch.cat([x.float() for x in xs])  # noqa: E731
        adv, ret = compute_gae(cat([rewards[i] for i in idx]), cat([samples[i]["values"] for i in idx]),
                               cat([samples[i]["action_mask"] for i in idx]), gamma, lamda)
        lengths = [len(samples[i]["action_mask"]) for i in idx]
        for i, a, r in zip(idx, adv.split(lengths), ret.split(lengths)):
            advantages[i], returns[i] = a, r
    return advantages, returns


def compute_advantages(samples: list[dict], owner: list[int], n_traj: int, n_groups: int,
                       adv_cfg, kl_cfg) -> tuple[list[dict], dict]:
    """Attach `advantages` (and `returns` for GAE) to every sample.

    samples: sequences with `rewards` (a turn's reward on its last action token), `action_mask`
    (+ `values` for GAE, `old_logps`/`ref_logps` for a KL reward); owner[i]: trajectory of sample
    i, trajectories ordered group-major (n_groups groups of n_traj / n_groups responses).
    Outcome estimators score a trajectory by the sum of its rewards and give that advantage to
    every action token of all its sequences.
    """
    rewards = [s["rewards"].float() for s in samples]
    metrics = {}
    if kl_cfg.coef > 0 and kl_cfg.type == "reward":
        rewards = [apply_kl_to_rewards(r, s["old_logps"], s["ref_logps"], s["action_mask"],
                                       kl_cfg.coef, kl_cfg.reward_estimator)
                   for r, s in zip(rewards, samples)]
        kl = sum((s["rewards"].float() - r).sum().item() for r, s in zip(rewards, samples)) / kl_cfg.coef
        metrics["adv/kl_reward"] = kl / max(1, n_traj)  # summed KL per trajectory
    masks = [s["action_mask"].float() for s in samples]
    if adv_cfg.estimator == "gae":
        advantages, returns = trajectory_gae(samples, rewards, owner, adv_cfg.gamma, adv_cfg.lamda)
    else:
        scores = torch.zeros(n_traj, dtype=torch.float64)
        for o, r in zip(owner, rewards):
            scores[o] += r.double().sum()
        per_traj = outcome_advantages(scores.view(n_groups, -1), adv_cfg.estimator,
                                      norm_var=adv_cfg.norm_var).flatten()
        advantages, returns = [per_traj[o] * m for o, m in zip(owner, masks)], None
    if adv_cfg.global_norm:  # whiten over every action token of the batch
        advantages = whiten(advantages, masks)
    out = []
    for i, s in enumerate(samples):
        extra = {"advantages": advantages[i]}
        if returns is not None:
            extra["returns"] = returns[i]
        out.append(dict(s, **extra))
    on = torch.cat(masks).bool()
    adv = torch.cat(advantages)[on]
    metrics.update({"adv/mean": adv.mean().item(), "adv/std": adv.std().item() if adv.numel() > 1 else 0.0})
    if returns is not None:
        values, rets = torch.cat([s["values"].float() for s in samples])[on], torch.cat(returns)[on]
        metrics.update({"adv/values": values.mean().item(), "adv/returns": rets.mean().item(),
                        # 1 = the critic explains the returns; <= 0 = no better than their mean
                        "adv/explained_var": (1 - (rets - values).var() / rets.var().clamp_min(1e-8)).item()
                        if rets.numel() > 1 else 0.0})
    return out, metrics


def engine_kl(samples) -> float:
    """Mean (trainer - engine) log-prob gap on action tokens: how far the engine's sampling
    distribution is from the trainer's (numerics, stale weights)."""
    num = sum(((s["old_logps"] - s["engine_logps"]) * s["action_mask"]).sum().item() for s in samples)
    den = sum(s["action_mask"].sum().item() for s in samples)
    return num / max(den, 1.0)


# ----- updates -----
def mini_batches(samples: list[dict], n: int, seed: int) -> list[list[dict]]:
    """Split a rollout batch into `n` shuffled mini-batches (same split on every rank)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    return [[samples[i] for i in order[k::n]] for k in range(n) if order[k::n]]


def epoch_batches(samples: list[dict], n: int, epochs: int, seed: int) -> list[list[dict]]:
    """`epochs` passes over the batch, each split into `n` mini-batches and reshuffled: epoch
    e > 0 uses derive_seed(seed, "epoch", e), so resumed runs repeat it (epoch 0 is the
    single-epoch split)."""
    seeds = [seed] + [derive_seed(seed, "epoch", e) for e in range(1, epochs)]
    return [b for s in seeds for b in mini_batches(samples, n, s)]


def sequence_log_ratio(mb, logps: torch.Tensor, old: torch.Tensor, sp_group) -> torch.Tensor:
    """GSPO's length-normalised log-ratio of each sequence, per token of the micro-batch
    (detached). A sequence is split over the sp group, so its sums are all-reduced there."""
    mask = mb.data["action_mask"]
    num = sequence_sums((logps.detach() - old) * mask, mb.cu_seqlens, sp_group, torch.float64)
    den = sequence_sums(mask, mb.cu_seqlens, sp_group, torch.float64)
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
    return (num / den.clamp_min(1.0)).repeat_interleave(lengths).to(upcast(logps).dtype)


def surrogate(actor, mb, logps, old, cfg) -> tuple[torch.Tensor, dict]:
    """The per-token policy loss of `cfg.policy_loss` (ppo | gspo | cispo)."""
    adv = mb.data["advantages"]
    if cfg.policy_loss == "gspo":
        seq = sequence_log_ratio(mb, logps, old, actor.dims.sp_group)
        return gspo_loss(logps, seq, adv, cfg.clip, cfg.clip_high, cfg.dual_clip)
    if cfg.policy_loss == "cispo":
        return cispo_loss(logps, old, adv, cfg.clip, cfg.clip_high)
    return policy_loss(logps, old, adv, cfg.clip, cfg.clip_high, cfg.dual_clip)


def actor_update(actor, samples: list[dict], cfg, kl_cfg, seed: int, step: int = 0) -> dict:
    """cfg = the actor config (policy_loss, clip, clip_high, dual_clip, entropy_coef, tis_coef,
    avg_level, update_per_rollout, update_epochs, strict_on_policy, rollout temperature);
    samples carry advantages (+ old/ref/engine logps)."""
    temperature = cfg.rollout.train_sampling_params.temperature or 1.0
    use_kl_loss = kl_cfg.coef > 0 and kl_cfg.type == "loss"
    sums = dict(loss=0.0, clip_ratio=0.0, dual_clip_ratio=0.0, entropy=0.0, approx_kl=0.0, kl_loss=0.0)
    grad_norms, first_gap = [], 0.0
    batches = epoch_batches(samples, cfg.update_per_rollout, cfg.update_epochs, seed)
    for b, batch in enumerate(batches):
        for mb in actor.plan(with_token_weights(batch, cfg.avg_level)):
            d = mb.data
            out = actor.forward(mb, temperature=temperature, need_entropy=True)
            logps, w = out["logps"], d["loss_weight"]
            # A single update on fresh samples has old == current: ratio 1, exact gradient.
            old = d["old_logps"] if "old_logps" in d else logps.detach()
            if b == 0 and cfg.strict_on_policy:  # before any optimizer step the policy IS the old one
                first_gap = max(first_gap, ((logps.detach() - old).abs() * d["action_mask"]).max().item())
            loss, stats = surrogate(actor, mb, logps, old, cfg)
            if cfg.tis_coef:
                loss = loss * tis_weight(old, d["engine_logps"], cfg.tis_coef)
            if "is_weight" in d:  # masked / sequence-level IS (RL2/algorithms/off_policy.py)
                loss = loss * d["is_weight"]
            if use_kl_loss:
                kl = kl_estimator(logps, d["ref_logps"], kl_cfg.loss_estimator)
                loss = loss + kl_cfg.coef * kl
                sums["kl_loss"] += (kl.detach() * w.double()).sum().item()
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * out["entropy"]
            total = (loss * w).sum()
            total.backward()
            # Metric sums in float64: their value must not depend on how tokens were split.
            w = w.double()
            sums["loss"] += total.item()
            sums["clip_ratio"] += (stats["clipped"] * w).sum().item()
            sums["dual_clip_ratio"] += (stats["dual_clipped"] * w).sum().item()
            sums["entropy"] += (out["entropy"].detach() * w).sum().item()
            sums["approx_kl"] += ((old - logps.detach()) * w).sum().item()
        if b == 0 and cfg.strict_on_policy:
            check_first_ratio(actor, first_gap, step, ratio_tol(actor.compute_dtype, cfg.on_policy_tol))
        grad_norms.append(actor.step())
    # Each sum is a mean over one mini-batch; average over mini-batches.
    metrics = {k: v / len(batches) for k, v in zip(sums, actor.all_reduce_metrics(sums.values()))}
    metrics.update(grad_norm=sum(grad_norms) / len(grad_norms), lr=actor.lr)
    if not use_kl_loss:
        metrics.pop("kl_loss")
    return metrics


def critic_update(critic, samples: list[dict], cfg, seed: int) -> dict:
    """Clipped value regression of `values` onto `returns` on action tokens; cfg = the critic
    config (clip, avg_level, update_per_rollout, update_epochs, its own lr)."""
    sums = dict(value_loss=0.0, value_clip_ratio=0.0)
    grad_norms = []
    batches = epoch_batches(samples, cfg.update_per_rollout, cfg.update_epochs, seed)
    for batch in batches:
        for mb in critic.plan(with_token_weights(batch, cfg.avg_level)):
            d = mb.data
            values = critic.forward(mb)["values"]
            loss, clipped = value_loss(values, d["values"], d["returns"], cfg.clip)
            total = (loss * d["loss_weight"]).sum()
            total.backward()
            sums["value_loss"] += total.item()
            sums["value_clip_ratio"] += (clipped * d["loss_weight"].double()).sum().item()
        grad_norms.append(critic.step())
    metrics = {k: v / len(batches) for k, v in zip(sums, critic.all_reduce_metrics(sums.values()))}
    metrics.update(grad_norm=sum(grad_norms) / len(grad_norms), lr=critic.lr)
    return metrics
