"""Loss functions for SFT/RM/DPO/PPO: pure, element-wise tensor math (no torch.distributed).

Every per-token function returns a tensor of the same shape as its inputs; turning it into a
scalar is `(per_token * weight).sum()` with weights from `token_weights`, which already hold the
GLOBAL normalisation (so the sum over micro-batches and ranks is the true loss, independent of how
sequences were split into micro-batches).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")
AVG_LEVELS = ("token", "sequence")


def upcast(x: Tensor) -> Tensor:
    """At least fp32 (bf16 inputs are upcast; fp64 stays fp64 for exactness tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def kl_estimator(logps: Tensor, ref_logps: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    With log_ratio = logps - ref_logps (Schulman, "Approximating KL Divergence"; verl/RL2 names):
      k1 = log_ratio                                  unbiased, can be negative
      k2 = 0.5 * log_ratio**2                         biased, >= 0 (verl "mse")
      k3 = exp(-log_ratio) + log_ratio - 1            unbiased, >= 0 (verl "low_var_kl")
         = exp(ref - logp) - (ref - logp) - 1
    """
    log_ratio = upcast(logps) - upcast(ref_logps)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":
        # expm1 keeps precision when the two policies are close (the common case).
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token (to be minimised).

    ratio = exp(logps - old_logps)
    loss  = max(-A * ratio, -A * clamp(ratio, 1 - clip, 1 + clip_high))   (clip-higher, DAPO)
    for A < 0 and dual_clip = c > 1: loss = min(loss, c * |A|)            (dual clip, Ye et al.)
    clip_high defaults to clip (symmetric PPO).

    Returns (loss, metrics) where metrics are detached per-token floats:
      "ratio", "clipped" (1 where the gradient is cut by either clip), "dual_clipped".
    """
    if clip_high is None:
        clip_high = clip
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = upcast(advantages)
    # Clamp the log-ratio so one wild token cannot produce inf/nan (both sides then saturate).
    ratio = torch.exp((upcast(logps) - upcast(old_logps)).clamp(-20.0, 20.0))
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - clip, 1.0 + clip_high)
    loss = torch.maximum(surr, surr_clipped)
    clipped = surr_clipped > surr
    if dual_clip is not None:
        cap = -adv * dual_clip  # = dual_clip * |A| where A < 0
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    else:
        dual = torch.zeros_like(clipped)
    metrics = {
        "ratio": ratio.detach(),
        "clipped": (clipped | dual).float(),
        "dual_clipped": dual.float(),
    }
    return loss, metrics


POLICY_LOSSES = ("ppo", "gspo", "cispo")


def gspo_loss(
    logps: Tensor,
    seq_log_ratio: Tensor,
    advantages: Tensor,
    clip: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form, per token.

    seq_log_ratio: for every token, the length-normalised log-ratio of ITS sequence,
        (1/|y_i|) * sum_t (logp_{i,t} - old_logp_{i,t})  over the action tokens of y_i
    s_i     = exp(seq_log_ratio)                                   sequence importance ratio
    s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]              value s_i, gradient s_i * grad logp
    loss_{i,t} = max(-A * s_{i,t}, -A * clamp(s_{i,t}, 1 - clip, 1 + clip_high))
    With one advantage per sequence and sequence-level averaging (avg_level=sequence) the mean
    over a sequence's tokens is the paper's -min(s_i A_i, clip(s_i) A_i) and its gradient is the
    paper's: clipping is decided per sequence, so a clipped sequence gets no gradient at all.
    Returns policy_loss's (loss, metrics).
    """
    log_ratio = seq_log_ratio.detach() + (upcast(logps) - upcast(logps).detach())
    return policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip, clip_high, dual_clip)


def cispo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    clip: float = 1.0,
    clip_high: float | None = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025), per token (to be minimised).

    r    = exp(logps - old_logps)
    loss = -sg(clamp(r, 1 - clip, 1 + clip_high)) * A * logps
    The importance weight is clipped and detached; unlike PPO no token's gradient is ever zeroed
    (gradient = -clamp(r) * A * grad logp). clip=1.0 leaves the weight unbounded below (the
    paper tunes only the upper bound). "clipped" marks tokens whose weight was truncated.
    """
    if clip_high is None:
        clip_high = clip
    ratio = torch.exp((upcast(logps) - upcast(old_logps)).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(1.0 - clip, 1.0 + clip_high)
    loss = -weight * upcast(advantages) * upcast(logps)
    return loss, {"ratio": ratio, "clipped": (weight != ratio).float(),
                  "dual_clipped": torch.zeros_like(ratio)}


def tis_weight(old_logps: Tensor, engine_logps: Tensor, tis_coef: float) -> Tensor:
    """Truncated importance-sampling weight min(pi_old / pi_engine, tis_coef), detached.

    Corrects for the rollout engine sampling from a slightly different distribution than the
    trainer's pi_old (kernels, precision); multiply the per-token policy loss by it.
    """
    ratio = torch.exp((upcast(old_logps) - upcast(engine_logps)).clamp(max=20.0))
    return ratio.clamp(max=tis_coef).detach()


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None = None
) -> tuple[Tensor, Tensor]:
    """Critic loss per token: 0.5 * max((v - R)^2, (v_clipped - R)^2).

    v_clipped = old_v + clamp(v - old_v, -clip, clip); with clip=None the plain 0.5 * (v - R)^2.
    Returns (loss, clipped) where clipped is a detached per-token 0/1 float (the clipped branch
    is strictly larger, i.e. the gradient is cut).
    """
    v, ret = upcast(values), upcast(returns)
    loss = (v - ret).pow(2)
    if clip is None:
        return 0.5 * loss, torch.zeros_like(loss)
    old = upcast(old_values)
    v_clipped = old + (v - old).clamp(-clip, clip)
    loss_clipped = (v_clipped - ret).pow(2)
    return 0.5 * torch.maximum(loss, loss_clipped), (loss_clipped > loss).float().detach()


def dpo_loss(
    logp_chosen: Tensor,
    logp_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO loss per pair, from sequence log-probs (sums over the response tokens).

    m = (logp_c - ref_c) - (logp_r - ref_r)
    loss = (1 - ls) * -logsigmoid(beta * m) + ls * -logsigmoid(-beta * m)   (conservative DPO)
    Returns (loss, reward_chosen, reward_rejected); rewards are beta * (logp - ref), detached.
    """
    chosen = upcast(logp_chosen) - upcast(ref_chosen)
    rejected = upcast(logp_rejected) - upcast(ref_rejected)
    logits = beta * (chosen - rejected)
    loss = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def rm_loss(r_chosen: Tensor, r_rejected: Tensor) -> tuple[Tensor, Tensor]:
    """Bradley-Terry reward-model loss per pair: -logsigmoid(r_c - r_r).

    Returns (loss, accuracy) with accuracy 1.0 where r_c > r_r strictly (ties count as wrong).
    """
    margin = upcast(r_chosen) - upcast(r_rejected)
    return -F.logsigmoid(margin), (margin > 0).float().detach()


def count_totals(action_masks: list[Tensor]) -> tuple[int, int]:
    """(action tokens, sequences with >= 1 action token): the totals token_weights expects.

    Callers sum these over the whole (global) batch, e.g. with an all-reduce, and pass them in.
    """
    lengths = [int(m.sum().item()) for m in action_masks]
    return sum(lengths), sum(1 for n in lengths if n > 0)


def token_weights(
    action_masks: list[Tensor],
    avg_level: str,
    total_tokens: int | None = None,
    total_seqs: int | None = None,
) -> list[Tensor]:
    """Per-token loss weights, one tensor per sequence (same shape as its mask).

    avg_level="token":    mask / total_tokens             (every action token counts equally)
    avg_level="sequence": mask / (total_seqs * n_i)        (mean over each sequence's n_i action
                                                           tokens, then mean over sequences)
    Totals default to those of `action_masks` itself (see count_totals); pass the global totals
    when the batch is split over micro-batches/ranks. Sequences without action tokens get weight 0
    and are not counted in total_seqs. Compute these on whole sequences, before any sp split.
    """
    if avg_level not in AVG_LEVELS:
        raise ValueError(f"unknown avg_level {avg_level!r}; expected one of {AVG_LEVELS}")
    local_tokens, local_seqs = count_totals(action_masks)
    total_tokens = local_tokens if total_tokens is None else total_tokens
    total_seqs = local_seqs if total_seqs is None else total_seqs
    weights = []
    for mask in action_masks:
        mask = mask.float()
        if avg_level == "token":
            denom = total_tokens
        else:
            denom = total_seqs * mask.sum().item()
        # denom == 0 only when the mask is all zero, so the weight is 0 either way.
        weights.append(mask / denom if denom > 0 else torch.zeros_like(mask))
    return weights


def with_token_weights(samples: list[dict], avg_level: str, mask_key: str = "action_mask") -> list[dict]:
    """Copies of `samples` with a `loss_weight` per token (from `token_weights` over the whole
    global batch, on whole sequences before any sp split): summing loss * loss_weight over
    micro-batches and ranks gives the true loss, whatever the micro-batching or world size."""
    weights = token_weights([s[mask_key] for s in samples], avg_level)
    return [dict(s, loss_weight=w) for s, w in zip(samples, weights)]


def token_metrics(samples: list[dict], mask_key: str = "action_mask") -> dict[str, float]:
    """The token counts every trainer logs, with one meaning: `tokens` = tokens processed by the
    forward pass (throughput counts these), `loss_tokens` = tokens whose output enters the loss."""
    return {"tokens": float(sum(len(s["input_ids"]) for s in samples)),
            "loss_tokens": float(sum(s[mask_key].sum().item() for s in samples))}
