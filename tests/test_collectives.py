"""gather_objects: all_gather_object's result on every group size, and why a one-rank group
skips the collective (the OpenMP team a gloo copy creates on gloo's worker thread)."""
import os

import torch
import torch.distributed as dist

from RL2.parallel.collectives import gather_objects
from tests.dist_utils import run_dist


def _gather(rank, world):
    obj = {"rank": rank, "t": torch.arange(3) + rank}
    return [(o["rank"], o["t"].tolist()) for o in gather_objects(obj)]


def test_gather_objects_returns_every_rank_in_order():
    expected = [(0, [0, 1, 2]), (1, [1, 2, 3])]
    assert run_dist(_gather, 2) == [expected, expected]


def _new_threads(fn) -> int:
    before = set(os.listdir("/proc/self/task"))
    fn()
    return len(set(os.listdir("/proc/self/task")) - before)


def _one_rank_threads(rank, world):
    torch.set_num_threads(2)  # the 1 x 2 layout (dist_utils sets 1)
    torch.ones(1 << 20).add_(1)  # the main thread's own OpenMP team exists already
    big = torch.zeros(1 << 17, dtype=torch.uint8)  # more than ATen's 32K-element grain
    obj = {"ids": big}
    assert gather_objects(obj)[0] is obj  # no collective, no copy
    skipped = _new_threads(lambda: gather_objects(obj))
    # the collective copies its output on a gloo worker thread; that copy's parallel_for makes
    # a new OpenMP team (its worker thread is named after gloo's), which is what gather_objects
    # avoids on one rank
    gloo = _new_threads(lambda: dist.all_gather_object([None], obj))
    return skipped, gloo


def test_one_rank_gather_makes_no_openmp_team_on_gloo_threads():
    skipped, gloo = run_dist(_one_rank_threads, 1)[0]
    assert skipped == 0
    assert gloo >= 1  # if this stops holding (torch/gloo changed), the skip is only a saving
