"""GSPO and CISPO against their papers' formulas and hand-computed values; K-epoch mini-batches;
the strict on-policy checks."""
import math
from itertools import accumulate
from types import SimpleNamespace

import pytest
import torch

from RL2.algorithms.losses import cispo_loss, gspo_loss, policy_loss, token_weights
from RL2.algorithms import on_policy
from RL2.algorithms.on_policy import OnPolicyError, check_engine_logps, max_logp_gap
from RL2.algorithms.ppo import epoch_batches, mini_batches, sequence_log_ratio


def T(x):
    return torch.tensor(x, dtype=torch.float64)


def seq_log_ratio(logps, old, mask, lengths):
    """actor_update's GSPO log-ratio on one process: sequences of `lengths` packed end to end."""
    mb = SimpleNamespace(data={"action_mask": mask}, cu_seqlens=torch.tensor([0, *accumulate(lengths)]))
    return sequence_log_ratio(mb, logps, old, None)


def test_sequence_log_ratio_by_hand():
    x, mask = T([1.0, 2.0, 9.0, 4.0, 6.0, 5.0]), T([1, 1, 0, 1, 1, 0])
    # sequences [1, 2, 9] (mean of masked 1, 2 = 1.5), [4, 6] (5), [5] (no masked token -> 0)
    got = seq_log_ratio(x, torch.zeros_like(x), mask, [3, 2, 1])
    assert got.tolist() == [1.5, 1.5, 1.5, 5.0, 5.0, 0.0]


# Three sequences: log(pi/pi_old) per action token, one advantage per sequence.
LOG_RATIOS = [[0.1, 0.3], [-0.2, 0.0, -0.4], [0.5]]
ADVS = [1.0, -2.0, 0.5]
MASKS = [[1, 1], [1, 1, 1], [1]]


def gspo_paper(logps_list, old_list, advs, clip, clip_high):
    """Zheng et al. eq. (5)-(7): s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|),
    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i); the loss is -J."""
    terms = []
    for lp, old, a in zip(logps_list, old_list, advs):
        s = torch.exp((lp - old).sum() / len(lp))
        terms.append(torch.minimum(s * a, s.clamp(1 - clip, 1 + clip_high) * a))
    return -torch.stack(terms).mean()


def rl2_gspo(logps_list, old_list, advs, clip, clip_high):
    """Through RL2's per-token function with sequence-level weights, as actor_update does."""
    lengths = [len(x) for x in logps_list]
    logps, old = torch.cat(logps_list), torch.cat(old_list)
    mask = torch.cat([T(m) for m in MASKS])
    adv = torch.cat([torch.full((n,), a, dtype=torch.float64) for n, a in zip(lengths, advs)])
    seq = seq_log_ratio(logps, old, mask, lengths)
    loss, stats = gspo_loss(logps, seq, adv, clip, clip_high)
    # avg_level=sequence weights (token_weights' values, exact in float64): 1 / (G * |y_i|)
    w = torch.cat([torch.full((n,), 1.0 / (len(lengths) * n), dtype=torch.float64) for n in lengths])
    assert torch.allclose(w, torch.cat(token_weights([T(m) for m in MASKS], "sequence")).double())
    return (loss * w).sum(), stats


@pytest.mark.parametrize("clip,clip_high", [(0.2, 0.28), (0.05, 0.1)])
def test_gspo_equals_the_paper_value_and_gradient(clip, clip_high):
    old = [T([-1.0] * len(r)) for r in LOG_RATIOS]
    leaves = [(o + T(r)).requires_grad_() for o, r in zip(old, LOG_RATIOS)]
    want = gspo_paper(leaves, old, ADVS, clip, clip_high)
    want_grads = torch.autograd.grad(want, leaves)
    got, stats = rl2_gspo(leaves, old, ADVS, clip, clip_high)
    got_grads = torch.autograd.grad(got, leaves)
    assert math.isclose(got.item(), want.item(), rel_tol=1e-12)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-15)
    # the ratio reported per token is its sequence's ratio
    assert torch.allclose(stats["ratio"][:2], torch.exp(T([0.2, 0.2])))


def test_gspo_by_hand():
    # s = exp(0.2), exp(-0.2), exp(0.5) = 1.2214, 0.8187, 1.6487; clip 0.2 / 0.28:
    # seq 1: A=1, s inside (0.8, 1.28): -1.2214; seq 2: A=-2, s=0.8187 inside: 1.6375;
    # seq 3: A=0.5, s clipped to 1.28: -0.64 and NO gradient. Loss = mean = 0.2514 / 3 ...
    old = [T([-1.0] * len(r)) for r in LOG_RATIOS]
    leaves = [(o + T(r)).requires_grad_() for o, r in zip(old, LOG_RATIOS)]
    got, stats = rl2_gspo(leaves, old, ADVS, 0.2, 0.28)
    s1, s2 = math.exp(0.2), math.exp(-0.2)
    assert math.isclose(got.item(), (-s1 + 2 * s2 - 0.64) / 3, rel_tol=1e-12)
    grads = torch.autograd.grad(got, leaves)
    # d/dlogp_t of -A s / 3 = -A s / (3 |y|)
    assert torch.allclose(grads[0], T([-s1 / 6] * 2))
    assert torch.allclose(grads[1], T([2 * s2 / 9] * 3))
    assert grads[2].abs().max() == 0  # the clipped sequence is cut entirely
    assert stats["clipped"].tolist() == [0, 0, 0, 0, 0, 1]


def test_gspo_token_ratio_differs_from_ppo_token_ratio():
    # PPO would clip token 2 of sequence 1 (ratio exp(0.3) = 1.35 > 1.28) but not token 1; GSPO
    # judges the sequence (exp(0.2) inside the range) and keeps both.
    lp, old = T([0.1, 0.3]).requires_grad_(), T([0.0, 0.0])
    _, ppo = policy_loss(lp, old, T([1.0, 1.0]), 0.2, 0.28)
    _, gspo = gspo_loss(lp, seq_log_ratio(lp, old, T([1, 1]), [2]), T([1.0, 1.0]), 0.2, 0.28)
    assert ppo["clipped"].tolist() == [0, 1] and gspo["clipped"].tolist() == [0, 0]


def test_cispo_by_hand():
    # r = exp(0.5)=1.6487 -> capped at 1.28; exp(-0.1)=0.9048 kept (clip=1.0: no lower bound); 1.
    logps = T([-1.0, -2.0, -0.5]).requires_grad_()
    old = logps.detach() - T([0.5, -0.1, 0.0])
    adv = T([1.0, -2.0, 0.5])
    loss, stats = cispo_loss(logps, old, adv, clip=1.0, clip_high=0.28)
    w = T([1.28, math.exp(-0.1), 1.0])
    assert torch.allclose(loss, T([1.28 * 1 * 1.0, -w[1].item() * 2 * 2.0, 0.25]))
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert torch.allclose(grad, -w * adv)  # the weight is detached; no gradient is zeroed
    assert stats["clipped"].tolist() == [1, 0, 0]
    # PPO zeroes the capped token's gradient (A > 0, ratio above 1 + clip_high)
    ppo, _ = policy_loss(logps, old, adv, 0.2, 0.28)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), logps)
    assert ppo_grad[0] == 0 and grad[0] != 0


def test_cispo_equals_the_paper_objective():
    """MiniMax-M1 eq. (4): J = 1/sum|o_i| sum_i sum_t sg(clip(r_it, 1-eps_l, 1+eps_h)) A_it log pi,
    token-level normalisation over the batch."""
    g = torch.Generator().manual_seed(0)
    masks = [torch.ones(n, dtype=torch.float64) for n in (3, 5, 2)]
    logps = (-torch.rand(10, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + 0.4 * torch.randn(10, generator=g, dtype=torch.float64)
    adv = torch.randn(10, generator=g, dtype=torch.float64)
    r = torch.exp(logps.detach() - old).clamp(1 - 0.5, 1 + 0.3)
    want = -(r * adv * logps).sum() / 10
    loss, _ = cispo_loss(logps, old, adv, 0.5, 0.3)
    assert torch.cat(token_weights(masks, "token")).eq(0.1).all()  # 1 / #tokens
    got = (loss / 10).sum()
    assert math.isclose(got.item(), want.item(), rel_tol=1e-12)
    assert torch.allclose(torch.autograd.grad(got, logps)[0], torch.autograd.grad(want, logps)[0])


def test_epoch_batches_reshuffle_each_epoch_deterministically():
    batches = epoch_batches(list(range(12)), 3, 2, seed=5)
    assert len(batches) == 6
    assert batches[:3] == mini_batches(list(range(12)), 3, seed=5)  # epoch 0 = one-epoch split
    for e in range(2):  # each epoch covers the batch exactly once
        assert sorted(x for b in batches[3 * e:3 * e + 3] for x in b) == list(range(12))
    assert batches[:3] != batches[3:]  # reshuffled
    assert epoch_batches(list(range(12)), 3, 2, seed=5) == batches


def test_engine_logp_check_names_step_and_deviation():
    samples = [{"old_logps": T([-1.0, -2.0, -3.0]), "engine_logps": T([-1.0, -2.0005, -9.0]),
                "action_mask": T([1, 1, 0])}]
    assert max_logp_gap(samples, "old_logps", "engine_logps") == pytest.approx((5e-4, 0, 1))
    check_engine_logps(samples, step=3, tol=1e-3)  # the masked token's gap does not count
    with pytest.raises(OnPolicyError, match=r"step 4: .*differ by 0.0005 .*sample 0, token 1"):
        check_engine_logps(samples, step=3, tol=1e-4)


def test_first_ratio_tolerance_is_exact_in_fp32_and_the_users_knob_in_half_precision(monkeypatch):
    """fp32 keeps the 1e-6 rounding bound; in bf16 the update's micro-batches (of the shuffled
    mini-batch) round differently from the log-prob pass's, so actor.on_policy_tol applies."""
    assert on_policy.ratio_tol(torch.float32, 0.2) == on_policy.ratio_tol(torch.float64, 0.2) == 1e-6
    assert on_policy.ratio_tol(torch.bfloat16, 0.2) == on_policy.ratio_tol(torch.float16, 0.2) == 0.2
    monkeypatch.setattr(on_policy, "all_reduce_floats", lambda values, op=None: values)  # one rank
    tol = on_policy.ratio_tol(torch.bfloat16, 0.2)
    on_policy.check_first_ratio(None, 0.125, 0, tol)  # one bf16 ulp of a logit near 20
    with pytest.raises(OnPolicyError, match=r"step 2: .*0\.3 > 0\.2 \(half precision"):
        on_policy.check_first_ratio(None, 0.3, 1, tol)
    with pytest.raises(OnPolicyError, match=r"1\.2e-05 > 1e-06\)"):
        on_policy.check_first_ratio(None, 1.2e-5, 0, on_policy.ratio_tol(torch.float32, 0.2))
