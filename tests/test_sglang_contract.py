"""SGLang adapter: the bucket builder (pure, CPU), the adapter's mapping against a fake
`sglang.Engine`, and — only where sglang is installed (its own GPU environment:
`pip install -e .[sglang]`, then `pytest tests/test_sglang_contract.py`) — the contract that every
SGLang method and parameter the adapter uses exists."""
import asyncio
import importlib.util
import inspect
import random
import sys
import types

import pytest
import torch

from RL2.rollout.engine import SamplingParams
from RL2.utils.seeding import derive_seed
from RL2.rollout.sglang_engine import SGLangEngine, make_buckets, param_names

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def random_tensors(seed=0, n=60):
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    return [(f"w{i}", torch.zeros(rng.randint(1, 300), dtype=rng.choice(dtypes))) for i in range(n)]


@pytest.mark.parametrize("bucket_bytes", [1, 100, 700, 4096, 10**9])
def test_make_buckets_properties(bucket_bytes):
    named = random_tensors()
    buckets = list(make_buckets(iter(named), bucket_bytes))
    flat = [name for bucket in buckets for name, _ in bucket]
    assert sorted(flat) == sorted(name for name, _ in named)       # every tensor exactly once
    order = {name: i for i, (name, _) in enumerate(named)}
    for dtype in {t.dtype for _, t in named}:                     # order kept within a dtype
        seen = [name for name in flat if dict(named)[name].dtype == dtype]
        assert seen == sorted(seen, key=order.get)
    size = lambda b: sum(t.numel() * t.element_size() for _, t in b)
    for bucket in buckets:
        assert len({t.dtype for _, t in bucket}) == 1               # one dtype per bucket
        assert size(bucket) <= bucket_bytes or len(bucket) == 1     # bounded (big tensor alone)
    # Greedy closing: a bucket was closed only because the next tensor of its dtype overflowed it.
    by_dtype = {}
    for bucket in buckets:
        by_dtype.setdefault(bucket[0][1].dtype, []).append(bucket)
    for group in by_dtype.values():
        for a, b in zip(group, group[1:]):
            assert size(a) + b[0][1].numel() * b[0][1].element_size() > bucket_bytes
    if bucket_bytes == 10**9:
        assert len(buckets) == len({t.dtype for _, t in named})


def test_make_buckets_rejects_bad_size_and_streams():
    with pytest.raises(ValueError):
        list(make_buckets([], 0))

    def endless():
        i = 0
        while True:
            yield f"w{i}", torch.zeros(10)
            i += 1
    first = next(make_buckets(endless(), 100))  # a generator: works on an unbounded stream
    assert [n for n, _ in first] == ["w0", "w1"]


class FakeSGLang:
    """Records calls; answers like sglang.Engine.async_generate with return_logprob=True."""

    def __init__(self, **server_args):
        self.server_args, self.calls = server_args, []
        self.loop = asyncio.new_event_loop()

    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False):
        self.calls.append(("generate", input_ids, dict(sampling_params), return_logprob))
        n = len(self.calls)
        return {"text": "xy", "output_ids": [10 + n, 20 + n],
                "meta_info": {"output_token_logprobs": [(-0.5, 10 + n, None), (-0.25, 20 + n, None)],
                              "finish_reason": {"type": "stop" if n % 2 else "length", "matched": 3}}}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [name for name, _ in named_tensors], flush_cache))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def shutdown(self):
        self.calls.append(("shutdown",))


class FakeSamplingParams:
    def __init__(self, max_new_tokens=128, stop=None, stop_token_ids=None, temperature=1.0, top_p=1.0,
                 top_k=-1, skip_special_tokens=True, sampling_seed=None):
        pass


@pytest.fixture
def fake_sglang(monkeypatch):
    sampling = types.ModuleType("sglang.srt.sampling.sampling_params")
    sampling.SamplingParams = FakeSamplingParams
    modules = {"sglang": types.ModuleType("sglang"), "sglang.srt": types.ModuleType("sglang.srt"),
               "sglang.srt.sampling": types.ModuleType("sglang.srt.sampling"),
               "sglang.srt.sampling.sampling_params": sampling}
    modules["sglang"].Engine = FakeSGLang
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_adapter_maps_requests_and_outputs(fake_sglang):
    engine = SGLangEngine("/models/x", None, tp_size=2, mem_fraction_static=0.6, base_gpu_id=2,
                          port=31000, bucket_bytes=100, log_level="warning")
    fake = engine.engine
    assert fake.server_args == dict(model_path="/models/x", tp_size=2, mem_fraction_static=0.6,
                                    base_gpu_id=2, port=31000, enable_memory_saver=True, log_level="warning")
    assert engine.loop is fake.loop
    params = SamplingParams(temperature=0.7, top_k=0, max_new_tokens=5, stop=["</a>"], n=2, seed=9)
    outs = engine.loop.run_until_complete(engine.generate([1, 2, 3], params))
    assert [(o.token_ids, o.logprobs, o.finish_reason) for o in outs] == [
        ([11, 21], [-0.5, -0.25], "stop"), ([12, 22], [-0.5, -0.25], "length")]
    sent = [c[2] for c in fake.calls]
    assert [c[1] for c in fake.calls] == [[1, 2, 3]] * 2 and all(c[3] for c in fake.calls)
    assert sent[0] == dict(temperature=0.7, top_p=1.0, top_k=-1, max_new_tokens=5, stop=["</a>"],
                           skip_special_tokens=False, sampling_seed=derive_seed(9, 0))
    assert sent[1]["sampling_seed"] == derive_seed(9, 1)
    assert set(sent[0]) <= param_names(FakeSamplingParams)
    with pytest.raises(ValueError):
        engine.loop.run_until_complete(engine.generate([], params))
    engine.loop.close()


def test_adapter_weight_update_flushes_once_and_memory_tags(fake_sglang):
    engine = SGLangEngine("/models/x", bucket_bytes=100)
    fake = engine.engine
    named = [(f"w{i}", torch.zeros(10)) for i in range(7)] + [("h", torch.zeros(10, dtype=torch.bfloat16))]
    engine.release_memory()
    engine.resume_memory(["weights"])
    engine.update_weights(iter(named))
    engine.resume_memory(["kv_cache"])
    engine.shutdown()
    engine.loop.close()
    updates = [c for c in fake.calls if c[0] == "update"]
    assert [n for c in updates for n in c[1]] == [n for n, _ in named]
    assert [c[2] for c in updates] == [False] * (len(updates) - 1) + [True]
    assert [c for c in fake.calls if c[0] != "update"] == [
        ("release", None), ("resume", ["weights"]), ("resume", ["kv_cache"]), ("shutdown",)]


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not installed (optional GPU extra)")
def test_sglang_api_contract():
    import sglang
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    from sglang.srt.server_args import ServerArgs

    engine = sglang.Engine
    expected = {
        "async_generate": {"input_ids", "sampling_params", "return_logprob"},
        "update_weights_from_tensor": {"named_tensors", "flush_cache"},
        "release_memory_occupation": {"tags"},
        "resume_memory_occupation": {"tags"},
        "flush_cache": set(),
        "shutdown": set(),
    }
    for method, params in expected.items():
        assert hasattr(engine, method), method
        assert params <= set(inspect.signature(getattr(engine, method)).parameters), method
    assert inspect.iscoroutinefunction(engine.async_generate)
    assert {"model_path", "tp_size", "mem_fraction_static", "enable_memory_saver", "base_gpu_id",
            "port"} <= param_names(ServerArgs)
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
            "skip_special_tokens"} <= param_names(SGLangSamplingParams)
