"""pass@k: the unbiased estimator by hand, and the rollout metrics that use it per data source."""
from math import comb

import pytest

from RL2.algorithms.metrics import pass_at_k
from RL2.rollout.rollout import Rollout
from tests.fakes import traj


def test_pass_at_k_by_hand():
    # n=4 samples, 1 pass: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)/C(5,2)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k failures: every draw of 2 has a pass


def test_pass_at_k_is_the_draw_probability():
    # Brute force over all k-subsets of n samples, c of which pass.
    from itertools import combinations

    n, c = 6, 2
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / comb(n, k))


@pytest.mark.parametrize("bad", [(4, 5, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(bad):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(*bad)


def test_rollout_metrics_report_pass_at_k_per_source():
    groups = [[traj(s, "a") for s in (1, 0, 0, 0)], [traj(s, "a") for s in (0, 0, 0, 0)],
              [traj(s, "b") for s in (1, 1, 0, 0)]]
    m = Rollout.metrics(groups, 4, pass_k=[1, 2, 8])  # k > n is left out
    assert m["a/pass@1"] == pytest.approx((0.25 + 0) / 2)
    assert m["a/pass@2"] == pytest.approx((0.5 + 0) / 2)
    assert m["a/pass@4"] == 0.5  # the group with a pass counts fully at k = n
    assert m["b/pass@1"] == 0.5 and m["b/pass@2"] == pytest.approx(1 - 1 / 6)
    assert m["a/mean@4"] == 0.125 and "a/pass@8" not in m
