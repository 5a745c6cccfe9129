"""RL2/algorithms/advantages.py against hand-computed and closed-form references."""
import math

import pytest
import torch

from RL2.algorithms.advantages import (
    apply_kl_to_rewards,
    compute_gae,
    outcome_advantages,
    whiten,
)


def T(x):
    return torch.tensor(x, dtype=torch.float32)


def plain_gae(rewards, values, gamma, lamda):
    """Textbook GAE on a list of consecutive steps (no masks), terminal value 0."""
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * next_v - values[t] + gamma * lamda * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values)]


def close(a, b, tol=1e-5):
    assert torch.allclose(a.float(), T(b) if not torch.is_tensor(b) else b.float(), atol=tol), (a, b)


# ---------------------------------------------------------------- GAE
def test_gae_single_turn_by_hand():
    # Two prompt positions (mask 0, junk reward/value that must be ignored), then 3 actions.
    rewards = T([5.0, 5.0, 0.0, 0.0, 1.0])
    values = T([9.0, 9.0, 0.5, 0.6, 0.7])
    mask = T([0, 0, 1, 1, 1])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lamda=0.8)
    # deltas: 0.9*0.6-0.5 = 0.04, 0.9*0.7-0.6 = 0.03, 1-0.7 = 0.3 ; gamma*lamda = 0.72
    # A2 = 0.3 ; A1 = 0.03 + 0.72*0.3 = 0.246 ; A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [0, 0, 0.21712, 0.246, 0.3])
    close(ret, [0, 0, 0.71712, 0.846, 1.0])


def test_gae_env_tokens_between_actions():
    # prompt | turn-1 action (2 tok) | env obs (2 tok) | turn-2 action (2 tok)
    mask = T([0, 1, 1, 0, 0, 1, 1])
    # Env positions carry huge values/rewards: if they leaked into the recursion we would see it.
    values = T([50.0, 0.2, 0.4, 100.0, -100.0, 0.3, 0.9])
    rewards = T([7.0, 0.0, 0.5, 3.0, 3.0, 0.0, 1.0])  # turn rewards on each turn's last token
    gamma, lamda = 0.95, 0.9
    adv, ret = compute_gae(rewards, values, mask, gamma, lamda)

    a_ref, r_ref = plain_gae([0.0, 0.5, 0.0, 1.0], [0.2, 0.4, 0.3, 0.9], gamma, lamda)
    act = mask.bool()
    close(adv[act], a_ref)
    close(ret[act], r_ref)
    close(adv[~act], [0, 0, 0])
    close(ret[~act], [0, 0, 0])
    # By hand: the last token of turn 1 bootstraps from V=0.3 at position 5 (next action token).
    d3 = 1.0 - 0.9
    d2 = 0.0 + gamma * 0.9 - 0.3
    d1 = 0.5 + gamma * 0.3 - 0.4
    a2 = d2 + gamma * lamda * d3
    assert adv[2].item() == pytest.approx(d1 + gamma * lamda * a2, abs=1e-6)


def test_gae_lamda_one_is_monte_carlo():
    torch.manual_seed(0)
    mask = T([0, 1, 1, 1, 0, 1, 1, 0, 1])
    rewards = torch.randn(9) * mask
    values = torch.randn(9)
    gamma = 0.9
    adv, ret = compute_gae(rewards, values, mask, gamma=gamma, lamda=1.0)
    r = rewards[mask.bool()].tolist()
    # discounted reward-to-go counted in action steps
    mc = [sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]
    close(ret[mask.bool()], mc)
    close(adv[mask.bool()], T(mc) - values[mask.bool()])


def test_gae_gamma_lamda_edge_cases():
    mask = T([0, 1, 1, 1])
    rewards = T([0.0, 1.0, -2.0, 3.0])
    values = T([0.0, 0.5, 0.25, 1.0])
    # gamma = lamda = 1: undiscounted reward-to-go minus V
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    close(ret, [0, 2.0, 1.0, 3.0])
    close(adv, [0, 1.5, 0.75, 2.0])
    # lamda = 0: one-step TD error r + gamma V' - V
    adv, ret = compute_gae(rewards, values, mask, 0.5, 0.0)
    close(adv, [0, 1.0 + 0.125 - 0.5, -2.0 + 0.5 - 0.25, 3.0 - 1.0])
    close(ret, [0, 1.125, -1.5, 3.0])
    # gamma = 0: A = r - V, return = r
    adv, ret = compute_gae(rewards, values, mask, 0.0, 0.7)
    close(adv, [0, 0.5, -2.25, 2.0])
    close(ret, [0, 1.0, -2.0, 3.0])
    with pytest.raises(ValueError):
        compute_gae(rewards, values, mask, 1.5, 1.0)


def test_gae_no_action_tokens_and_batch():
    adv, ret = compute_gae(T([1.0, 2.0]), T([3.0, 4.0]), T([0, 0]))
    close(adv, [0, 0])
    close(ret, [0, 0])
    rs, vs, ms = [T([0.0, 1.0]), T([2.0])], [T([0.0, 0.5]), T([1.0])], [T([1, 1]), T([1])]
    advs, rets = zip(*(compute_gae(r, v, m, 1.0, 1.0) for r, v, m in zip(rs, vs, ms)))
    close(advs[0], [1.0, 0.5])  # reward-to-go [1, 1] minus V [0, 0.5]
    close(rets[0], [1.0, 1.0])
    close(advs[1], [1.0])
    close(rets[1], [2.0])


# ---------------------------------------------------------------- outcome estimators
SCORES = T([[1, 0, 0, 1], [1, 1, 1, 0]])


def test_reinforce_dr_grpo_and_grpo():
    close(outcome_advantages(SCORES, "reinforce"),
          [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    # unbiased group std: row 0 sqrt(1/3), row 1 sqrt(0.75/3) = 0.5
    s0 = math.sqrt(1 / 3)
    close(outcome_advantages(SCORES, "reinforce", norm_var=True, eps=0.0),
          [[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [0.5, 0.5, 0.5, -1.5]])
    # eps keeps an all-equal group finite (std 0 -> advantage 0)
    out = outcome_advantages(T([[1, 1, 1]]), "reinforce", norm_var=True)
    close(out, [[0, 0, 0]])
    # one response per prompt: no nan
    assert torch.isfinite(outcome_advantages(T([[1.0], [0.0]]), "reinforce", norm_var=True)).all()


def test_rloo():
    # baseline = mean of the other three responses
    close(outcome_advantages(SCORES, "rloo"),
          [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, -1.0]])
    with pytest.raises(ValueError):
        outcome_advantages(T([[1.0], [0.0]]), "rloo")


def test_global_baseline_and_reinforce_pp():
    mean = 5 / 8
    close(outcome_advantages(SCORES, "reinforce_global"), SCORES - mean)
    # 5 ones and 3 zeros: sum of squared deviations = 5*(3/8)^2 + 3*(5/8)^2 = 1.875
    std = math.sqrt(1.875 / 7)
    expected = (SCORES - mean) / std
    close(outcome_advantages(SCORES, "reinforce++", eps=0.0), expected)
    close(outcome_advantages(SCORES, "reinforce_global", norm_var=True, eps=0.0), expected)
    with pytest.raises(ValueError):
        outcome_advantages(SCORES, "ppo")
    with pytest.raises(ValueError):
        outcome_advantages(SCORES.flatten(), "reinforce")


# ---------------------------------------------------------------- KL in reward, whitening
def test_apply_kl_to_rewards():
    rewards = T([0.0, 0.0, 1.0])
    logps = T([-1.0, -2.0, -0.5])
    ref = T([-1.5, -2.0, -1.0])  # log ratio 0.5, 0, 0.5 ; position 0 is a prompt token
    mask = T([0, 1, 1])
    close(apply_kl_to_rewards(rewards, logps, ref, mask, 0.1, "k1"), [0, 0, 1 - 0.05])
    k3 = math.exp(-0.5) + 0.5 - 1
    close(apply_kl_to_rewards(rewards, logps, ref, mask, 0.1, "k3"), [0, 0, 1 - 0.1 * k3])
    # no gradient flows into the reward
    lp = logps.clone().requires_grad_()
    assert not apply_kl_to_rewards(rewards, lp, ref, mask, 0.1, "k2").requires_grad


def test_whiten():
    advs = [T([1.0, 2.0, 99.0]), T([3.0])]
    masks = [T([1, 1, 0]), T([1])]
    # action values 1, 2, 3: mean 2, unbiased std 1
    out = whiten(advs, masks, eps=0.0)
    close(out[0], [-1.0, 0.0, 0.0])
    close(out[1], [1.0])
    out = whiten(advs, masks, shift_mean=False, eps=0.0)
    close(out[0], [1.0, 2.0, 0.0])
    close(out[1], [3.0])
