"""The CUDA-graph decode path (RL2/rollout/cuda_graph.py) without a GPU: its static-shape step
(`llama_forward.decode_static`: whole KV buffers, a mask, the write column as a tensor) and its
bookkeeping (row buckets, padding rows, re-capture after a buffer reallocation or a weight
change) run on the CPU with a stand-in for torch.cuda.CUDAGraph, against the ordinary decode.
The capture itself (streams, torch.cuda.graph) is not run here: no GPU."""
import asyncio

import pytest
import torch

from RL2.rollout.cuda_graph import GraphedDecode
from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine
from tests.test_torch_engine import CharTokenizer, random_prompts, staggered, tiny_model


def _addresses(kv) -> list[int]:
    return [t.data_ptr() for t in kv.k + kv.v]


class ReplayGraph:
    """Stands in for a captured torch.cuda.CUDAGraph under its rules: `replay` re-runs the
    captured step on the very tensors it was captured with (new values in the static inputs
    are seen, nothing else is) and writes the same output tensor. A real graph replays on the
    addresses it was captured on, whatever now lives there (torch/cuda/graphs.py warns of
    inputs freed between capture and replay): here a replay while the engine's KV buffers are
    not the captured ones fails instead of quietly reading the old (kept alive) buffers."""

    def __init__(self, step, out, owner):
        self.step, self.out, self.owner = step, out, owner
        self.captured = _addresses(owner.kv_now)

    def replay(self):
        now = _addresses(self.owner.kv_now)
        assert now == self.captured, "replayed on KV buffers other than the captured ones"
        self.out.copy_(self.step())


class CPUGraphedDecode(GraphedDecode):
    captures = 0
    buckets: set = set()  # (bucket, the cache's row capacity) of every graph replayed

    def __call__(self, kv, tokens):
        self.kv_now = kv  # what the real graph cannot see: the buffers the engine uses now
        out = super().__call__(kv, tokens)
        CPUGraphedDecode.buckets |= {(b, kv.k[0].shape[0]) for b in self.graphs}
        return out

    def _record(self, step, device):
        CPUGraphedDecode.captures += 1
        out = step()
        return ReplayGraph(step, out, self), out


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
    CPUGraphedDecode.captures, CPUGraphedDecode.buckets = 0, set()
    for gap in (0, 3):  # all at once; staggered, so rows join a decoding batch (reallocations)
        want = _run(plain, prompts, lengths, gap)
        got = _run(graphed, prompts, lengths, gap)
        for (t1, l1), (t2, l2) in zip(want, got):
            assert t1 == t2
            torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=1e-6)
    assert graphed.runner.graphed is not None  # graphs all along, no fallback
    assert CPUGraphedDecode.captures >= 4  # several buckets and re-captures were exercised
    buckets = CPUGraphedDecode.buckets
    assert len(buckets) > 1 and all(b & (b - 1) == 0 or b == cap for b, cap in buckets)
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

    assert callable(torch.cuda.device) and callable(torch.cuda.set_stream)
    assert {"pool", "capture_error_mode"} <= set(inspect.signature(torch.cuda.graph.__init__).parameters)
    assert all(hasattr(torch.cuda.CUDAGraph, m) for m in ("pool", "replay"))
    assert "device" in inspect.signature(torch.cuda.Stream.__new__).parameters
    assert "device" in inspect.signature(torch.cuda.current_stream).parameters
    assert hasattr(torch.cuda.Stream, "wait_stream") and callable(torch.cuda.stream)


def _same(got, want):
    for (t1, l1), (t2, l2) in zip(want, got, strict=True):
        assert t1 == t2
        torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=1e-6)


def _decode_steps(runner, last, n):
    out = []
    for _ in range(n):
        logits = runner.decode(last)
        last = logits.argmax(-1)
        out.append(logits)
    return out, last


@torch.inference_mode()  # as the engine runs its runner
def test_a_new_cache_is_never_replayed_on_with_graphs_of_the_old_one():
    """The engine's failure and abort paths replace the KV cache (`runner.reset`): its graphs
    go too. And validity is the cache object and its reallocations, not the first buffer's
    address: a new cache whose layer-0 buffer lands where the old one was (the allocator reuses
    blocks) while the others land elsewhere must not be replayed on with the old graphs."""
    from RL2.rollout.kv_cache import BatchKV
    from RL2.rollout.model_runner import KVRunner

    model = tiny_model(max_pos=256)
    prompts = random_prompts(5, seed=5)
    runners = [KVRunner(model, "cpu", onednn=False) for _ in range(2)]
    graphed = runners[1]
    graphed.graphed = CPUGraphedDecode(model, graphed.linear)
    lasts = []
    for runner in runners:
        first = runner.prefill(prompts, [(0, None)] * len(prompts)).argmax(-1)
        runner.join(list(range(len(prompts))), room=16)
        lasts.append(first)
    (want, lasts[0]), (got, lasts[1]) = [_decode_steps(r, x, 3) for r, x in zip(runners, lasts)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert graphed.graphed is not None and graphed.graphed.graphs
    old, new = graphed.kv, BatchKV()  # the same first buffer, every other buffer a copy
    new.k = [old.k[0]] + [b.clone() for b in old.k[1:]]
    new.v = [b.clone() for b in old.v]
    new.lens, new.rows, new.start, new.end = old.lens, old.rows, old.start, old.end
    graphed.kv = new
    want, _ = _decode_steps(runners[0], lasts[0], 3)
    got, _ = _decode_steps(graphed, lasts[1], 3)  # the fake fails a replay on the old buffers
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert graphed.graphed is not None  # replayed, not fallen back
    graphed.reset()
    assert not graphed.graphed.graphs and graphed.graphed.buffers is None


def test_a_failed_capture_falls_back_to_the_eager_step(caplog):
    class Failing(CPUGraphedDecode):
        def _record(self, step, device):
            raise RuntimeError("operation not permitted when stream is capturing")

    model = tiny_model(max_pos=256)
    prompts, lengths = random_prompts(5, seed=7), [6] * 5
    plain, graphed = _engine(model, False), _engine(model, False)
    graphed.runner.graphed = Failing(model, graphed.runner.linear)
    with caplog.at_level("WARNING"):
        _same(_run(graphed, prompts, lengths, 0), _run(plain, prompts, lengths, 0))
    assert graphed.runner.graphed is None
    assert "decoding without graphs from now on" in caplog.text


class _Stream:
    def __init__(self, name="side"):
        self.name = name

    def wait_stream(self, other):
        pass


class _Streams:
    """torch.cuda's current stream (one thread). `stream(s)` restores the previous one on exit
    whatever happened, as torch.cuda.StreamContext.__exit__ does."""

    def __init__(self):
        self.current = _Stream("default")

    def current_stream(self, device=None):
        return self.current

    def set_stream(self, s):
        self.current = s

    def stream(self, s):
        return _StreamContext(self, s)


class _StreamContext:  # a class, not a generator: a generator's finally would run when collected
    def __init__(self, streams, s):
        self.streams, self.stream = streams, s

    def __enter__(self):
        self.before, self.streams.current = self.streams.current, self.stream

    def __exit__(self, *exc):
        self.streams.current = self.before


class _CapturingGraph:
    """torch.cuda.CUDAGraph's capture: an op the capture cannot take (a host sync, say)
    invalidates it, and capture_end then raises (cudaStreamEndCapture's error, AT_CUDA_CHECKed
    in aten/src/ATen/cuda/CUDAGraph.cpp)."""

    def __init__(self):
        self.capturing = self.invalid = False

    def capture_begin(self, *pool, capture_error_mode="global", check_input_liveness=False):
        self.capturing = True

    def capture_end(self):
        self.capturing = False
        if self.invalid:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def pool(self):
        return ("pool",)


def test_a_failed_capture_leaves_the_engine_thread_on_its_own_stream(monkeypatch):
    """The real torch.cuda.graph's __enter__/__exit__ (only its __init__, which makes a CUDA
    stream, is replaced): its __exit__ calls capture_end() before restoring the stream, so a
    failed capture must not leave the engine's later eager steps on the capture stream."""
    streams, capture_stream = _Streams(), _Stream("capture")
    made = []

    class RealGraphContext(torch.cuda.graphs.graph):
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            # the attributes torch 2.13's __init__ sets, with a stand-in capture stream
            self.pool = () if pool is None else (pool,)
            self.capture_stream = capture_stream
            self.stream_ctx = streams.stream(capture_stream)
            self.cuda_graph, self.capture_error_mode = cuda_graph, capture_error_mode
            self._enable_annotations, self.check_input_liveness = False, False

    def new_graph():
        made.append(_CapturingGraph())
        return made[-1]

    for name, value in dict(Stream=lambda device=None: _Stream(), CUDAGraph=new_graph,
                            graph=RealGraphContext, current_stream=streams.current_stream,
                            set_stream=streams.set_stream, stream=streams.stream,
                            synchronize=lambda *a: None, empty_cache=lambda: None).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)

    def step():  # fine while warming up; an op the capture rejects once capturing
        if made and made[-1].capturing:
            made[-1].invalid = True
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.zeros(2)

    default = streams.current
    decoder = GraphedDecode(tiny_model(), None)
    with pytest.raises(RuntimeError):
        decoder._record_on(step, "cuda:0")
    assert streams.current is default
    made.clear()
    graph, out = decoder._record_on(lambda: torch.ones(2), "cuda:0")  # a capture that works
    assert graph is made[0] and streams.current is default and decoder.pool == ("pool",)


def test_dynamic_rope_decodes_without_graphs(caplog):
    from RL2.rollout.model_runner import KVRunner

    model = tiny_model(max_pos=256)
    model.model.rotary_emb.rope_type = "dynamic"  # as transformers sets it from rope_parameters
    with caplog.at_level("WARNING"):
        runner = KVRunner(model, "cuda", onednn=False, cuda_graph=True)  # builds nothing on CUDA
    assert runner.graphed is None and "dynamic RoPE" in caplog.text
    assert KVRunner(tiny_model(), "cuda", onednn=False, cuda_graph=True).graphed is not None


def test_cuda_runner_leaves_the_cpu_libraries_off():
    """oneDNN's packed weights and RL2's AVX-512 kernel are CPU libraries: a CUDA engine's
    runner turns both off whatever cpu_matmul and small_gemm say (found by a review: on CUDA
    every product paid PackedLinears' checks before falling back to F.linear)."""
    from RL2.rollout.model_runner import KVRunner
    from RL2.utils import onednn

    if not onednn.available():
        pytest.skip("no oneDNN in this torch: PackedLinears is off everywhere")
    cuda = KVRunner(tiny_model(), "cuda", onednn=True, small_gemm=True)
    assert not cuda.linear.enabled and not cuda.linear.small
    assert KVRunner(tiny_model(), "cpu", onednn=True).linear.enabled == onednn.available()
