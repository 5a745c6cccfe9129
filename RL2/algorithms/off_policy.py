"""Off-policy corrections against the engine's log-probs (`actor.is_correction`): pure functions.

The engine sampled each token from pi_engine (stale weights with `max_staleness` > 0, or other
kernels/precision); the trainer's log-probs before the update are pi_old. Per action token
r = pi_old / pi_engine. Each correction gives a detached per-token weight the policy loss is
multiplied by (0 = the token is left out):

  mis         token masked IS (IcePop-style two-sided mask): w = r if lo <= r <= hi else 0
  token_mask  token rejection only:                           w = 1 if lo <= r <= hi else 0
  seq_mis     sequence masked IS: R = prod_t r_t over the sequence's action tokens;
              every token of the sequence gets w = R if lo <= R <= hi else 0
  geo_mask    geometric-mean rejection: G = exp(mean_t log r_t); w = 1 if lo <= G <= hi else 0

`tis_coef` (truncation, RL2/algorithms/losses.py `tis_weight`) is separate and composes with
these. Samples are whole sequences here (computed before any micro-batch or sp split), so the
weights do not depend on the parallel layout.
"""
import torch
from torch import Tensor

CORRECTIONS = ("mis", "token_mask", "seq_mis", "geo_mask")
LOG_CLAMP = 20.0  # |log r| beyond this is clamped: exp stays finite, the mask decides anyway


def _log_ratio(old_logps: Tensor, engine_logps: Tensor, mask: Tensor) -> Tensor:
    """log(pi_old / pi_engine) on action tokens (0 elsewhere), float64."""
    return ((old_logps.double() - engine_logps.double()) * mask.double()).clamp(-LOG_CLAMP, LOG_CLAMP)


def _inside(x: Tensor, lo: float, hi: float) -> Tensor:
    return (x >= lo) & (x <= hi)


def correction_weight(old_logps: Tensor, engine_logps: Tensor, mask: Tensor, kind: str,
                      lo: float, hi: float) -> Tensor:
    """The per-token weight of correction `kind` for ONE sequence (1-D tensors of equal length);
    tokens outside the action mask get weight 1 (their loss weight is 0 anyway)."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {kind!r}; expected one of {CORRECTIONS}")
    if not 0 <= lo <= 1 <= hi:
        raise ValueError(f"off-policy bounds must satisfy 0 <= lo <= 1 <= hi, got lo={lo}, hi={hi}")
    log_r = _log_ratio(old_logps, engine_logps, mask)
    on = mask.bool()
    if kind in ("mis", "token_mask"):
        r = log_r.exp()
        keep = _inside(r, lo, hi)
        w = torch.where(keep, r if kind == "mis" else torch.ones_like(r), torch.zeros_like(r))
    else:
        n = on.sum()
        total = log_r.sum()
        seq = total.clamp(-LOG_CLAMP, LOG_CLAMP) if kind == "seq_mis" else total / n.clamp_min(1)
        value = seq.exp()
        keep = bool(_inside(value, lo, hi)) or n.item() == 0
        fill = value if kind == "seq_mis" else torch.ones((), dtype=value.dtype)
        w = torch.full_like(log_r, fill.item() if keep else 0.0)
    return torch.where(on, w, torch.ones_like(w)).to(old_logps.dtype)


def apply_correction(samples: list[dict], kind: str, lo: float, hi: float) -> tuple[list[dict], dict]:
    """Copies of `samples` (with `old_logps`, `engine_logps`, `action_mask`) carrying `is_weight`,
    and metrics: the fraction of action tokens masked out and the mean weight of action tokens."""
    out, masked, weight, tokens = [], 0.0, 0.0, 0.0
    for s in samples:
        w = correction_weight(s["old_logps"], s["engine_logps"], s["action_mask"], kind, lo, hi)
        m = s["action_mask"].double()
        masked += ((w == 0).double() * m).sum().item()
        weight += (w.double() * m).sum().item()
        tokens += m.sum().item()
        out.append(dict(s, is_weight=w))
    tokens = max(tokens, 1.0)
    return out, {"off_policy/masked_ratio": masked / tokens, "off_policy/weight_mean": weight / tokens}
