"""RL2/algorithms/losses.py against hand-computed and closed-form references."""
import math

import pytest
import torch
import torch.nn.functional as F

from RL2.algorithms.losses import (
    count_totals,
    dpo_loss,
    kl_estimator,
    policy_loss,
    rm_loss,
    tis_weight,
    token_weights,
    value_loss,
)


def T(x):
    return torch.tensor(x, dtype=torch.float32)


def close(a, b, tol=1e-5):
    b = b if torch.is_tensor(b) else T(b)
    assert torch.allclose(a.float(), b.float(), atol=tol), (a, b)


def softplus(x):  # -logsigmoid(-x) = log(1 + e^x), for the hand references
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------- KL estimators
def test_kl_estimator_values():
    logps = T([-1.0, -2.0, -0.3])
    ref = T([-1.5, -1.0, -0.3])  # log ratio 0.5, -1, 0
    close(kl_estimator(logps, ref, "k1"), [0.5, -1.0, 0.0])
    close(kl_estimator(logps, ref, "k2"), [0.125, 0.5, 0.0])
    close(kl_estimator(logps, ref, "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0])
    with pytest.raises(ValueError):
        kl_estimator(logps, ref, "k4")


def test_kl_estimators_expectation_is_true_kl():
    # Averaging k1 and k3 over tokens drawn from q (here: the exact q-weighted sum over the
    # vocabulary) gives KL(q || p) exactly; k2 is >= 0 but biased.
    torch.manual_seed(0)
    q = torch.log_softmax(torch.randn(7, dtype=torch.float64), -1)
    p = torch.log_softmax(torch.randn(7, dtype=torch.float64), -1)
    true_kl = (q.exp() * (q - p)).sum()
    for kind in ("k1", "k3"):
        est = (q.exp() * kl_estimator(q, p, kind).double()).sum()
        assert est.item() == pytest.approx(true_kl.item(), rel=1e-5)
    assert (kl_estimator(q, p, "k2") >= 0).all() and (kl_estimator(q, p, "k3") >= 0).all()


# ---------------------------------------------------------------- PPO policy loss
# (advantage, ratio, loss, clipped, dual) with clip=0.2, clip_high=0.28, dual_clip=3
CASES = [
    (1.0, 1.1, -1.1, 0, 0),    # inside the trust region
    (1.0, 1.25, -1.25, 0, 0),  # above 1+clip but below 1+clip_high: clip-higher keeps gradient
    (1.0, 1.5, -1.28, 1, 0),   # clipped at 1+clip_high
    (1.0, 0.5, -0.5, 0, 0),    # A>0, ratio low: pessimistic branch is the unclipped one
    (-1.0, 0.5, 0.8, 1, 0),    # A<0, ratio low: clipped at 1-clip
    (-1.0, 2.0, 2.0, 0, 0),    # A<0, ratio high: unclipped, below the dual cap 3*|A|
    (-2.0, 5.0, 6.0, 1, 1),    # A<0, ratio huge: dual clip caps at 3*|A| = 6
    (2.0, 5.0, -2.56, 1, 0),   # A>0: no dual clip, clipped at 1.28
]


def test_policy_loss_regions():
    adv = T([c[0] for c in CASES])
    ratio = T([c[1] for c in CASES])
    old = T([-1.0] * len(CASES))
    logps = (old + ratio.log()).requires_grad_()
    loss, m = policy_loss(logps, old, adv, clip=0.2, clip_high=0.28, dual_clip=3.0)
    close(loss, [c[2] for c in CASES])
    close(m["clipped"], [c[3] for c in CASES])
    close(m["dual_clipped"], [c[4] for c in CASES])
    close(m["ratio"], ratio)
    # d loss / d logp = -A * ratio where not clipped, 0 where any clip is active
    loss.sum().backward()
    expected = torch.where(m["clipped"].bool(), 0.0, -adv * ratio)
    close(logps.grad, expected)


def test_policy_loss_symmetric_default_and_no_dual():
    adv = T([1.0, -2.0])
    ratio = T([1.25, 5.0])
    loss, m = policy_loss(ratio.log(), torch.zeros(2), adv, clip=0.2)
    close(loss, [-1.2, 10.0])  # 1.25 clipped to 1.2; no dual clip: 2*5
    close(m["clipped"], [1, 0])
    with pytest.raises(ValueError):
        policy_loss(ratio.log(), torch.zeros(2), adv, dual_clip=0.5)


def test_tis_weight():
    old = T([-1.0, -1.0, -1.0, -2.0]).requires_grad_()
    engine = T([-1.0, -2.0, -5.0, -1.0])
    w = tis_weight(old, engine, tis_coef=2.0)
    close(w, [1.0, 2.0, 2.0, math.exp(-1.0)])  # exp(0), min(e, 2), min(e^4, 2), e^-1
    assert not w.requires_grad


# ---------------------------------------------------------------- critic
def test_value_loss():
    values = T([1.0, 2.0, 0.0]).requires_grad_()
    old = T([0.5, 0.5, 0.5])
    returns = T([1.0, 0.0, 0.5])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    # clipped values 0.7, 0.7, 0.3 -> squared errors (0, .09), (4, .49), (.25, .04)
    close(loss, [0.045, 2.0, 0.125])
    close(clipped, [1, 0, 0])
    loss.sum().backward()
    close(values.grad, [0.0, 2.0, -0.5])  # clipped token gets no gradient
    loss, clipped = value_loss(values, old, returns)
    close(loss, [0.0, 2.0, 0.125])
    close(clipped, [0, 0, 0])


# ---------------------------------------------------------------- DPO / RM
def test_dpo_loss():
    # policy == reference: margin 0 -> log 2 whatever beta / smoothing
    lp = T([-3.0, -7.0])
    for ls in (0.0, 0.1):
        loss, rc, rr = dpo_loss(lp, lp + 1, lp, lp + 1, beta=0.3, label_smoothing=ls)
        close(loss, [math.log(2)] * 2)
        close(rc, [0, 0])
        close(rr, [0, 0])
    # chosen +1 over ref, rejected -1 under ref, beta 0.5: beta * margin = 1
    args = (T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0]))
    loss, rc, rr = dpo_loss(*args, beta=0.5)
    close(loss, [softplus(-1.0)])
    close(rc, [0.5])
    close(rr, [-0.5])
    loss, _, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.1)
    close(loss, [0.9 * softplus(-1.0) + 0.1 * softplus(1.0)])


def test_rm_loss():
    rc = T([2.0, 0.0, 1.0])
    rr = T([1.0, 1.0, 1.0])
    loss, acc = rm_loss(rc, rr)
    close(loss, [softplus(-1.0), softplus(1.0), math.log(2)])
    close(acc, [1, 0, 0])  # a tie is not a correct ranking
    close(loss, -F.logsigmoid(rc - rr))


# ---------------------------------------------------------------- aggregation
MASKS = [T([0, 1, 1, 1]), T([1, 0]), T([0, 0, 0])]  # 3 + 1 action tokens; last has none
LOSSES = [T([9.0, 1.0, 2.0, 3.0]), T([4.0, 7.0]), T([5.0, 5.0, 5.0])]


def total(weights, losses=LOSSES):
    return sum((l * w).sum() for l, w in zip(losses, weights)).item()


def test_token_and_sequence_weights():
    assert count_totals(MASKS) == (4, 2)
    w = token_weights(MASKS, "token")
    close(w[0], [0, 0.25, 0.25, 0.25])
    assert total(w) == pytest.approx((1 + 2 + 3 + 4) / 4)
    w = token_weights(MASKS, "sequence")
    close(w[0], [0, 1 / 6, 1 / 6, 1 / 6])
    close(w[2], [0, 0, 0])
    assert total(w) == pytest.approx((2.0 + 4.0) / 2)  # mean of per-sequence means
    with pytest.raises(ValueError):
        token_weights(MASKS, "batch")


@pytest.mark.parametrize("avg_level", ["token", "sequence"])
def test_weights_independent_of_micro_batching(avg_level):
    full = total(token_weights(MASKS, avg_level))
    toks, seqs = count_totals(MASKS)  # what an all-reduce over the batch would give
    split = [[0], [1, 2]]
    parts = 0.0
    for idx in split:
        masks = [MASKS[i] for i in idx]
        w = token_weights(masks, avg_level, total_tokens=toks, total_seqs=seqs)
        parts += total(w, [LOSSES[i] for i in idx])
    assert parts == pytest.approx(full)
