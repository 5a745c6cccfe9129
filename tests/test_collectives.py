"""gather_objects: all_gather_object's result on every group size, and why a one-rank group
skips the collective (the OpenMP team a gloo copy creates on gloo's worker thread)."""
import os
import pickle

import torch
import torch.distributed as dist

from RL2.parallel.collectives import gather_objects
from tests.dist_utils import run_dist


def _kinds(rank: int) -> dict:
    # what trajectories and per-sample results hold, and tensors the byte path must leave to
    # PyTorch's own pickling (requires_grad, a Parameter, complex)
    g = torch.Generator().manual_seed(rank)
    return {"rank": rank, "t": torch.arange(3) + rank, "f": torch.randn(2, 5, generator=g),
            "strided": torch.randn(4, 6, generator=g)[:, ::2], "scalar": torch.tensor(2.5 + rank),
            "empty": torch.zeros(0, 3), "bf16": torch.randn(3, generator=g).bfloat16(),
            "mask": torch.tensor([True, rank == 1]), "grad": torch.ones(2, requires_grad=True),
            "param": torch.nn.Parameter(torch.ones(2)), "complex": torch.ones(2, dtype=torch.complex64),
            "other": [1, "x", None]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))
    return a == b


def _gather(rank, world):
    got = gather_objects(_kinds(rank))
    return [all(_same(v, o[k]) for k, v in _kinds(r).items()) and o.keys() == _kinds(r).keys()
            for r, o in enumerate(got)]


def test_gather_objects_returns_every_rank_in_order():
    # tensors travel as their bytes (fix 39): equal in type, dtype, shape, values, requires_grad
    assert run_dist(_gather, 2) == [[True, True], [True, True]]


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


def test_plain_cpu_tensors_pickle_as_their_bytes():
    from RL2.parallel.collectives import _dumps

    plain = _dumps({"ids": torch.arange(100), "logps": torch.randn(100)})
    assert b"_tensor_from_bytes" in plain and b"_rebuild_tensor" not in plain  # not torch.save's
    assert b"_rebuild" in _dumps(torch.ones(2, requires_grad=True))  # left to PyTorch
    tagged = torch.ones(2)
    tagged.note = "kept"
    odd = [torch._neg_view(torch.ones(3)), torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
           tagged]
    back = pickle.loads(_dumps(odd))  # each left to PyTorch's reduction, which keeps them
    assert torch.equal(back[0], -torch.ones(3)) and back[1].is_nested and back[2].note == "kept"


def _metrics(rank, world):
    from types import SimpleNamespace
    from unittest import mock

    from RL2.workers.worker import Worker

    worker = Worker.__new__(Worker)
    worker.dims = SimpleNamespace(tp=2)  # tp ranks hold copies: the sums are divided by tp
    values = [0.1 * (rank + 1), -3.0 * rank, 1e-17 + rank]
    one = [worker.all_reduce_metric(v) for v in values]
    calls = []
    real = dist.all_reduce
    with mock.patch.object(dist, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1]):
        batched = worker.all_reduce_metrics(v for v in values)  # any iterable (dict values)
    return one, batched, len(calls)


def test_metrics_reduce_in_one_collective_as_each_alone():
    """Worker.all_reduce_metrics: the same float64 sums (/ tp) as one all-reduce per value, bit
    for bit, from one collective."""
    for one, batched, calls in run_dist(_metrics, 2):
        assert batched == one and calls == 1
        assert one == [(0.1 + 0.2) / 2, -1.5, (1e-17 + 1e-17 + 1) / 2]
