"""The CUDA-graph decode path (RL2/rollout/cuda_graph.py) without a GPU: its static-shape step
(`llama_forward.decode_static`: whole KV buffers, a mask, the write column as a tensor) and its
bookkeeping (row buckets, padding rows, re-capture after a buffer reallocation or a weight
change) run on the CPU with a stand-in for torch.cuda.CUDAGraph, against the ordinary decode.
The capture itself (streams, torch.cuda.graph) is not run here: no GPU."""
import asyncio

import torch

from RL2.rollout.cuda_graph import GraphedDecode
from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine
from tests.test_torch_engine import CharTokenizer, random_prompts, staggered, tiny_model


class ReplayGraph:
    """Stands in for a captured torch.cuda.CUDAGraph under its rules: `replay` re-runs the
    captured step on the very tensors it was captured with (new values in the static inputs
    are seen, nothing else is) and writes the same output tensor."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.copy_(self.step())


class CPUGraphedDecode(GraphedDecode):
    captures = 0

    def _record(self, step, device):
        CPUGraphedDecode.captures += 1
        out = step()
        return ReplayGraph(step, out), out


def _engine(model, graphed: bool) -> TorchEngine:
    engine = TorchEngine(model, CharTokenizer(), cpu_matmul="aten")
    if graphed:
        engine.runner.graphed = CPUGraphedDecode(model, engine.runner.linear)
    return engine


def _run(engine, prompts, lengths, gap):
    jobs = [(p, SamplingParams(temperature=0, max_new_tokens=k))
            for p, k in zip(prompts, lengths)]
    outs = asyncio.run(staggered(engine, jobs, gap=gap))
    return [(o[0].token_ids, o[0].logprobs) for o in outs]


def test_static_decode_with_graph_bookkeeping_equals_decode():
    model = tiny_model(max_pos=256)
    prompts = random_prompts(11, seed=3)
    lengths = [4 + 7 * (i % 4) for i in range(11)]  # rows finish at different steps: buckets shrink
    plain, graphed = _engine(model, False), _engine(model, True)
    CPUGraphedDecode.captures = 0
    for gap in (0, 3):  # all at once; staggered, so rows join a decoding batch (reallocations)
        want = _run(plain, prompts, lengths, gap)
        got = _run(graphed, prompts, lengths, gap)
        for (t1, l1), (t2, l2) in zip(want, got):
            assert t1 == t2
            torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=1e-6)
    assert CPUGraphedDecode.captures >= 4  # several buckets and re-captures were exercised
    buckets = set(graphed.runner.graphed.graphs)
    assert buckets and all(b & (b - 1) == 0 or b == graphed.runner.kv.k[0].shape[0] for b in buckets)
    # new weights: graphs are dropped and the next steps follow the new model
    other = tiny_model(seed=1, max_pos=256)
    for engine in (plain, graphed):
        engine.update_weights(other.state_dict().items())
    assert not graphed.runner.graphed.graphs
    want, got = _run(plain, prompts, lengths, 0), _run(graphed, prompts, lengths, 0)
    assert [t for t, _ in want] == [t for t, _ in got]


def test_full_bias_masks_all_but_each_rows_tokens_and_the_write_column():
    from RL2.rollout.kv_cache import BatchKV

    kv = BatchKV()
    keys = [torch.randn(2, 1, 5, 4)]
    kv.add(keys, keys, torch.tensor([3, 5]), room=4)
    bias = kv.full_bias(4)[:, 0, 0]
    open_cols = [(row == 0).nonzero().flatten().tolist() for row in bias]
    end = kv.end
    assert open_cols[0] == list(range(end - 3, end + 1))
    assert open_cols[1] == list(range(end - 5, end + 1))
    assert open_cols[2] == open_cols[3] == [end]  # padding rows: the write column only


def test_cuda_graph_calls_exist_in_this_torch():
    """The torch.cuda calls `_record` makes, checked against the installed torch (its CPU build
    ships the same Python API) since they cannot run here."""
    import inspect

    assert "pool" in inspect.signature(torch.cuda.graph.__init__).parameters
    assert all(hasattr(torch.cuda.CUDAGraph, m) for m in ("pool", "replay"))
    assert "device" in inspect.signature(torch.cuda.Stream.__new__).parameters
    assert "device" in inspect.signature(torch.cuda.current_stream).parameters
    assert hasattr(torch.cuda.Stream, "wait_stream") and callable(torch.cuda.stream)
