"""Strict on-policy checks (`actor.strict_on_policy=true`).

With one mini-batch, one epoch and fresh samples, PPO is on-policy: the trainer's log-probs at the
first update ARE the old log-probs (ratio 1) and the engine sampled from the same distribution
(engine log-probs == trainer log-probs up to numerics). A weight-sync bug, a sampling bug (e.g.
log-probs after top-p renormalisation, a wrong temperature) or a train/eval difference in the
forward breaks one of these silently; these checks stop the run instead, naming the step and the
largest per-token deviation.
"""
import torch
import torch.distributed as dist

from RL2.parallel.collectives import all_reduce_floats

# fp32: two forwards of the same weights differ only by float rounding.
RATIO_TOL = 1e-6


def ratio_tol(dtype: torch.dtype, on_policy_tol: float) -> float:
    """The first update's tolerance on |log ratio|. In bf16/fp16 the update packs its shuffled
    mini-batch into other micro-batches than the log-prob pass did, and products of another
    row count round differently (one bf16 ulp of a logit near 20 is 0.125 in its log-prob), so
    half precision shares `actor.on_policy_tol`, the knob README says to raise for bf16."""
    return RATIO_TOL if dtype in (torch.float32, torch.float64) else max(RATIO_TOL, on_policy_tol)


class OnPolicyError(RuntimeError):
    pass


def max_logp_gap(samples: list[dict], key_a: str, key_b: str) -> tuple[float, int, int]:
    """(largest |a - b| over action tokens, sample index, token index)."""
    best = (0.0, -1, -1)
    for i, s in enumerate(samples):
        gap = (s[key_a].double() - s[key_b].double()).abs() * s["action_mask"].double()
        if gap.numel() and gap.max().item() > best[0]:
            best = (gap.max().item(), i, int(gap.argmax()))
    return best


def check_engine_logps(samples: list[dict], step: int, tol: float):
    """The engine's log-probs (`engine_logps`) must match the trainer's (`old_logps`) within
    `tol` on every action token. Same result on every rank (samples are identical there)."""
    gap, i, t = max_logp_gap(samples, "old_logps", "engine_logps")
    if gap > tol:
        raise OnPolicyError(
            f"strict on-policy check failed at step {step + 1}: engine and trainer log-probs differ "
            f"by {gap:.3g} (> actor.on_policy_tol={tol}) at sample {i}, token {t}; the engine does "
            f"not sample from the trained policy (weight sync, temperature or sampling bug)")


def check_first_ratio(actor, local_gap: float, step: int, tol: float = RATIO_TOL):
    """Before the first optimizer step the ratio pi / pi_old must be 1: `local_gap` is this
    rank's largest |logp - old_logp| in the first mini-batch; all ranks take part. `tol`:
    `ratio_tol` of the compute dtype."""
    gap = all_reduce_floats([local_gap], op=dist.ReduceOp.MAX)[0]  # on the group's device
    if gap > tol:
        hint = "" if tol == RATIO_TOL else " (half precision: tolerance actor.on_policy_tol)"
        raise OnPolicyError(
            f"strict on-policy check failed at step {step + 1}: the first update's ratio is not 1 "
            f"(largest |log ratio| {gap:.3g} > {tol}{hint}); the training forward differs "
            f"from the log-prob pass on the same weights")
