"""Off-policy corrections (RL2/algorithms/off_policy.py) against hand-computed values, and the
staleness filter of the asynchronous rollout."""
import math

import pytest
import torch

from RL2.algorithms.off_policy import apply_correction, correction_weight
from RL2.rollout.producer import drop_stale
from RL2.rollout.trajectory import Trajectory

LN = math.log
# Per-token ratios pi_old / pi_engine: 0.25, 1.5, 3.0, and a non-action token (ratio 10).
OLD = torch.tensor([LN(0.25), LN(1.5), LN(3.0), LN(10.0)], dtype=torch.float64)
ENGINE = torch.zeros(4, dtype=torch.float64)
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0])


def weight(kind, lo=0.5, hi=2.0):
    return correction_weight(OLD, ENGINE, MASK, kind, lo, hi).tolist()


def test_token_level_masks():
    # 0.25 and 3.0 fall outside [0.5, 2]; the non-action token keeps weight 1
    assert weight("mis") == pytest.approx([0.0, 1.5, 0.0, 1.0])
    assert weight("token_mask") == pytest.approx([0.0, 1.0, 0.0, 1.0])
    assert weight("mis", lo=0.2, hi=3.01) == pytest.approx([0.25, 1.5, 3.0, 1.0])


def test_sequence_level_masks():
    # product 0.25 * 1.5 * 3 = 1.125 (inside [0.5, 2]); geometric mean 1.125 ** (1/3)
    assert weight("seq_mis") == pytest.approx([1.125, 1.125, 1.125, 1.0])
    assert weight("geo_mask") == pytest.approx([1.0, 1.0, 1.0, 1.0])
    # product outside [0.5, 1.1]: the whole sequence is dropped; geo mean 1.04 still inside
    assert weight("seq_mis", hi=1.1) == pytest.approx([0.0, 0.0, 0.0, 1.0])
    assert weight("geo_mask", hi=1.1) == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert weight("geo_mask", hi=1.01) == pytest.approx([0.0, 0.0, 0.0, 1.0])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        weight("nope")
    with pytest.raises(ValueError, match="lo <= 1 <= hi"):
        weight("mis", lo=1.5)


def test_apply_correction_metrics():
    samples = [{"old_logps": OLD, "engine_logps": ENGINE, "action_mask": MASK}]
    out, metrics = apply_correction(samples, "mis", 0.5, 2.0)
    assert out[0]["is_weight"].tolist() == pytest.approx([0.0, 1.5, 0.0, 1.0])
    assert metrics["off_policy/masked_ratio"] == pytest.approx(2 / 3)
    assert metrics["off_policy/weight_mean"] == pytest.approx(1.5 / 3)


def traj(*versions):
    t = Trajectory(uid="u")
    t.turns = [{"versions": [[v, 3]]} for v in versions]
    return t


def test_drop_stale_keeps_groups_within_k():
    groups = [[traj(5), traj(4, 5)], [traj(3), traj(5)], [traj(6)]]
    # training step 6 with k = 2: a trajectory whose oldest tokens are version 3 is 3 versions old
    kept, dropped = drop_stale(groups, step=6, k=2)
    assert kept == [groups[0], groups[2]] and dropped == 1
    assert [t.min_version for t in groups[0]] == [5, 4]
