"""Advantage estimators: GAE (token level, multi-turn aware) and outcome/group estimators
(GRPO, Dr. GRPO, RLOO, REINFORCE++); pure tensor functions, no torch.distributed.

Per-token tensors follow the Sample layout of docs/DEV_SPEC.md: 1-D, aligned to label positions,
`action_mask[t] == 1` where labels[t] is an action (response) token. Prompt tokens and environment
tokens between turns have mask 0; they get advantage 0 and return 0.
"""
import torch
from torch import Tensor

from RL2.algorithms.losses import kl_estimator

OUTCOME_ESTIMATORS = ("reinforce", "rloo", "reinforce_global", "reinforce++")


def compute_gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float = 1.0, lamda: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation on one sequence, over its action tokens only.

    The MDP steps are the action tokens a_0..a_{K-1} (positions where action_mask is 1), so
    environment tokens in between are not steps: the bootstrap value of a_k is the value at the
    NEXT action token a_{k+1} (not the next position), and 0 after the last one (terminal).
      delta_k = r_k + gamma * V_{k+1} - V_k
      A_k     = delta_k + gamma * lamda * A_{k+1}
      R_k     = A_k + V_k
    Rewards at positions with action_mask 0 are ignored: put a turn's reward on its last action
    token. values[t] = V(input_ids[<=t]) is the value of the state in which labels[t] is chosen.
    Returns (advantages, returns), shaped like `values`, zero off the action tokens.
    """
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lamda <= 1.0:
        raise ValueError(f"gamma and lamda must be in [0, 1], got gamma={gamma}, lamda={lamda}")
    idx = action_mask.bool().nonzero(as_tuple=True)[0]
    advantages = torch.zeros_like(values, dtype=torch.float32)
    returns = torch.zeros_like(advantages)
    if idx.numel() == 0:
        return advantages, returns
    r = rewards.detach()[idx].double()
    v = values.detach()[idx].double()
    next_v = torch.cat([v[1:], v.new_zeros(1)])
    deltas = (r + gamma * next_v - v).tolist()
    # The backward recursion is sequential; a loop over Python floats is cheap
    # and exact, unlike a cumsum with gamma*lamda powers, which under/overflows on long sequences.
    adv = [0.0] * len(deltas)
    running = 0.0
    for k in range(len(deltas) - 1, -1, -1):
        running = deltas[k] + gamma * lamda * running
        adv[k] = running
    adv_t = torch.tensor(adv, dtype=torch.float64)
    advantages[idx] = adv_t.float()
    returns[idx] = (adv_t + v).float()
    return advantages, returns


def _std(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    # Unbiased std (as GRPO implementations use); a single element has std 0 instead of nan.
    n = x.numel() if dim is None else x.shape[dim]
    correction = 1 if n > 1 else 0
    if dim is None:
        return x.std(correction=correction)
    return x.std(dim=dim, keepdim=keepdim, correction=correction)


def outcome_advantages(
    scores: Tensor, estimator: str, norm_var: bool = False, eps: float = 1e-6
) -> Tensor:
    """Sequence-level advantages from scalar trajectory scores shaped (n_prompts, n_responses).

    Row i holds the responses to prompt i (a group). Estimators:
      "reinforce":        A = s - mean(group)                       (Dr. GRPO)
                          norm_var: A /= std(group) + eps           (GRPO)
      "rloo":             A = s - mean(other responses of the group) = n/(n-1) * (s - mean(group))
                          norm_var: A /= std(group) + eps
      "reinforce_global": A = s - mean(batch)                       (global baseline)
                          norm_var: A /= std(batch) + eps
      "reinforce++":      A = (s - mean(batch)) / (std(batch) + eps) (global whitening)
    std is the unbiased estimate. Returns float32 of the same shape; flatten row-major
    (`.flatten()`) to line up with trajectories ordered prompt-major.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (n_prompts, n_responses), got shape {tuple(scores.shape)}")
    s = scores.double()
    n = s.shape[1]
    if estimator == "reinforce":
        adv = s - s.mean(1, keepdim=True)
        if norm_var:
            adv = adv / (_std(s, 1, keepdim=True) + eps)
    elif estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 responses per prompt")
        baseline = (s.sum(1, keepdim=True) - s) / (n - 1)
        adv = s - baseline
        if norm_var:
            adv = adv / (_std(s, 1, keepdim=True) + eps)
    elif estimator == "reinforce_global":
        adv = s - s.mean()
        if norm_var:
            adv = adv / (_std(s) + eps)
    elif estimator == "reinforce++":
        adv = (s - s.mean()) / (_std(s) + eps)
    else:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {OUTCOME_ESTIMATORS}")
    return adv.float()


def apply_kl_to_rewards(
    rewards: Tensor,
    logps: Tensor,
    ref_logps: Tensor,
    action_mask: Tensor,
    coef: float,
    estimator: str = "k1",
) -> Tensor:
    """rewards - coef * KL_t on action tokens (kl.type=reward); a new tensor, no gradient.

    For outcome estimators sum the result over the sequence to get the trajectory score.
    """
    kl = kl_estimator(logps.detach(), ref_logps.detach(), estimator)
    return rewards.float() - coef * kl * action_mask.float()


def whiten(
    advantages: list[Tensor], action_masks: list[Tensor], shift_mean: bool = True, eps: float = 1e-8
) -> list[Tensor]:
    """Normalise token-level advantages with the mean/std of ALL action tokens of the batch.

    (a - mean) / (std + eps), or a / (std + eps) with shift_mean=False (keeps the sign of
    advantages, e.g. after GAE). Non-action tokens stay 0.
    """
    masks = [m.bool() for m in action_masks]
    flat = torch.cat([a.double()[m] for a, m in zip(advantages, masks)])
    if flat.numel() == 0:
        return [torch.zeros_like(a, dtype=torch.float32) for a in advantages]
    mean = flat.mean() if shift_mean else 0.0
    std = _std(flat)
    return [
        torch.where(m, (a.double() - mean) / (std + eps), 0.0).float()
        for a, m in zip(advantages, masks)
    ]
