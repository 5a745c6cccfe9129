"""SGLang adapter, checked on CPU against `tests/fakes.py::FakeSGLang`, a fake that enforces
SGLang 0.5.23's state machine (released-tag set, torch_memory_saver pause/resume rules, weight
update sessions, (success, message) results, one payload per TP rank). The signatures and rules
the fake encodes are checked against the real sglang 0.5.23 source in
tests/test_sglang_source.py (the wheel's Python files, parsed; no import, no GPU).

What only a GPU can show (not run here): CUDA-IPC payloads actually opened by SGLang's TP workers,
torch_memory_saver's real memory behaviour, SGLang's log-probs equal to the trainer's after a
sync (scripts/gpu_smoke.sh checks these on a GPU)."""
import importlib.util
import inspect
import os
import random

import pytest
import torch
from torch import nn

from RL2.rollout.engine import SamplingParams
from RL2.rollout.sglang_engine import SGLangEngine, SGLangPeer, param_names
from RL2.rollout.weight_layout import make_buckets
from RL2.rollout.weight_sync import WeightSync
from RL2.utils.seeding import derive_seed
from tests.dist_utils import run_dist
from tests.fakes import LORA_CONFIG, SGLANG_ENGINE_METHODS, FakeSamplingParams, FakeSGLang, install_fake_sglang, lora_tensors

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
ALL = ["weights", "cuda_graph", "kv_cache"]


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


@pytest.fixture
def fake_sglang(monkeypatch):
    install_fake_sglang(monkeypatch)


def new_engine(**kw) -> SGLangEngine:
    kw.setdefault("dtype", "bfloat16")  # no config to read: /models/x does not exist
    return SGLangEngine("/models/x", None, **kw)


def test_adapter_maps_requests_and_outputs(fake_sglang):
    engine = new_engine(tp_size=2, mem_fraction_static=0.6, base_gpu_id=2, port=31000,
                        bucket_bytes=100, log_level="warning")
    fake = engine.engine
    port = fake.server_args.pop("nccl_port")
    assert fake.server_args == dict(model_path="/models/x", tp_size=2, mem_fraction_static=0.6,
                                    base_gpu_id=2, port=31000, enable_memory_saver=True,
                                    dtype="bfloat16", log_level="warning")
    assert 22000 + 2 * 2666 <= port < 22000 + 3 * 2666  # base GPU 2's slice (no CUDA: 3 slices)
    assert engine.loop is fake.loop
    # released at start-up: generating needs a sync (which resumes) first
    assert fake.calls == [("release", ALL)]
    params = SamplingParams(temperature=0.7, top_k=0, max_new_tokens=5, stop=["</a>"], n=2, seed=9)
    with pytest.raises(RuntimeError, match="released"):
        engine.loop.run_until_complete(engine.generate([1, 2, 3], params))
    engine.resume_memory()
    fake.weights_lost = False  # as after a sync's full push (tested below)
    fake.calls.clear()
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


def test_requests_stay_within_what_the_scheduler_admits(fake_sglang):
    """The engine reads the scheduler's max_req_input_len (get_server_info, as a server's
    /server_info): new tokens are cut to fit and a longer prompt is refused by RL2, naming the
    limit, where SGLang would raise on it (the fake raises as SGLang does)."""
    engine = new_engine(context_length=40)
    fake = engine.engine
    engine.resume_memory()
    fake.weights_lost = False
    assert engine.max_model_len == fake.max_req_input_len == 34
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine.loop.run_until_complete(engine.generate(list(range(1, 31)), params))
    assert fake.calls[-1][2]["max_new_tokens"] == 4  # 30 + 4 = 34
    with pytest.raises(ValueError, match="max_model_len=34"):
        engine.loop.run_until_complete(engine.generate(list(range(1, 35)), params))
    with pytest.raises(ValueError, match="maximum allowed length"):  # what RL2 now avoids
        fake.loop.run_until_complete(fake.async_generate(input_ids=list(range(1, 35)),
                                                         sampling_params={"max_new_tokens": 1}))
    engine.loop.close()


def test_fake_enforces_sglang_lora_rules(tmp_path):
    from RL2.workers.lora import write_adapter

    write_adapter(str(tmp_path / "a"), lora_tensors(0), LORA_CONFIG)
    plain = FakeSGLang(tp_size=1)
    assert not plain.load_lora_adapter(lora_name="a", lora_path=str(tmp_path / "a")).success
    fake = FakeSGLang(tp_size=1, enable_lora=True, max_lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    assert fake.load_lora_adapter(lora_name="a", lora_path=str(tmp_path / "a")).success
    assert not fake.load_lora_adapter(lora_name="a", lora_path=str(tmp_path / "a")).success  # loaded
    write_adapter(str(tmp_path / "big"), lora_tensors(0), {**LORA_CONFIG, "r": 8})
    assert not fake.load_lora_adapter(lora_name="big", lora_path=str(tmp_path / "big")).success
    assert not fake.unload_lora_adapter(lora_name="b").success
    with pytest.raises(ValueError, match="not loaded"):
        fake.loop.run_until_complete(fake.async_generate([1], {}, True, lora_path="b"))
    fake.release_memory_occupation()  # no CPU backup: the base is gone until a full push
    fake.resume_memory_occupation()
    with pytest.raises(RuntimeError, match="CPU backup"):
        fake.loop.run_until_complete(fake.async_generate([1], {}, True, lora_path="a"))
    fake.loop.close()
    plain.loop.close()


def test_adapter_sync_loads_each_adapter_under_a_new_name(fake_sglang, tmp_path):
    """LoRA adapter-only sync: the engine starts with the LoRA pool arguments, each sync loads
    the adapter under a new name (SGLang refuses a loaded name) and unloads the previous one,
    requests name the current one, and a failed load raises."""
    engine = new_engine(lora_rank=4, lora_target_modules=["q_proj", "v_proj"], lora_dir=str(tmp_path))
    fake = engine.engine
    assert (fake.server_args["enable_lora"], fake.server_args["max_lora_rank"],
            fake.server_args["lora_target_modules"]) == (True, 4, ["q_proj", "v_proj"])
    assert fake.server_args["enable_weights_cpu_backup"]  # the base survives every release
    (own,) = os.listdir(tmp_path)  # the engine's own directory inside lora_dir
    for version in (1, 2):
        engine.release_memory()  # training
        engine.resume_memory(["weights"])
        tensors = lora_tensors(version)
        engine.update_adapter(iter(tensors), LORA_CONFIG)
        engine.resume_memory()
        name = f"{own}-v{version}"  # unique per engine: a server may hold another run's adapters
        assert list(fake.loras) == [name]  # the previous adapter is unloaded
        assert all(torch.equal(fake.loras[name][n], t) for n, t in tensors)
        engine.loop.run_until_complete(engine.generate([1, 2], SamplingParams(max_new_tokens=2)))
        assert fake.calls[-1][-1] == name  # the request's lora_path
    assert os.listdir(tmp_path / own) == [f"{own}-v2"]  # older adapter files removed
    with pytest.raises(RuntimeError, match="load_lora_adapter failed"):
        engine.update_adapter(iter(lora_tensors(3)), {**LORA_CONFIG, "r": 8})  # beyond max_lora_rank
    with pytest.raises(RuntimeError, match="without LoRA"):
        new_engine().update_adapter(iter(lora_tensors(0)), LORA_CONFIG)
    engine.shutdown()
    assert os.listdir(tmp_path) == []
    engine.loop.close()


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3, bias=False))


def test_fake_enforces_sglang_rules(fake_sglang):
    """The fake refuses what SGLang 0.5.23 refuses (else the tests below prove nothing)."""
    fake = FakeSGLang(tp_size=1)
    with pytest.raises(KeyError):
        fake.resume_memory_occupation(["weights"])          # never released: offload_tags.remove
    fake = FakeSGLang(tp_size=1)
    fake.release_memory_occupation()                      # None = all tags
    with pytest.raises(RuntimeError, match="not active"):
        fake.release_memory_occupation(["cuda_graph"])    # paused twice
    fake.resume_memory_occupation(["weights"])
    ok, message = fake.update_weights_from_tensor([("w", torch.zeros(1))])
    assert not ok and "begin_weight_update" in message
    assert fake.begin_weight_update() == (True, "Success")
    assert fake.begin_weight_update()[0] is False
    assert fake.end_weight_update() == (True, "Success")
    assert fake.end_weight_update()[0] is False


def test_weight_sync_cycles_follow_sglang_order(fake_sglang):
    """First sync right after start-up, then release/sync cycles: explicit tags, each resumed
    once, update inside begin/end, engine dtype, flush on the last bucket only. On the old
    adapter the first sync resumed a tag that was never released (KeyError in SGLang's
    scheduler) and updated outside a session."""
    engine = new_engine(bucket_bytes=16)
    fake = engine.engine
    model = small_model()
    sync = WeightSync(model, "local")
    for cycle in range(2):
        fake.calls.clear()
        sync(engine)
        engine.loop.run_until_complete(engine.generate([1], SamplingParams(max_new_tokens=2)))
        engine.release_memory()
        kinds = [c[0] for c in fake.calls]
        assert kinds[:2] == ["resume", "begin"] and fake.calls[0] == ("resume", ["weights"])
        n_updates = kinds.count("update")
        assert kinds[2:2 + n_updates + 2] == ["update"] * n_updates + ["end", "resume"]
        assert fake.calls[3 + n_updates] == ("resume", ["cuda_graph", "kv_cache"])
        assert fake.calls[-1] == ("release", ALL)
        flushes = [c[2] for c in fake.calls if c[0] == "update"]
        assert n_updates > 1 and flushes == [False] * (n_updates - 1) + [True]
    for name, tensor in model.state_dict().items():
        assert fake.weights[name].dtype == torch.bfloat16
        assert torch.equal(fake.weights[name], tensor.to(torch.bfloat16))
    engine.shutdown()
    engine.loop.close()


def test_trainer_cache_is_freed_before_the_engine_resumes(fake_sglang, monkeypatch):
    """Defect 8: SGLang re-maps the KV pool it sized at start-up, so the trainer's cached CUDA
    blocks must go back to the driver before every resume. CUDA is faked (is_initialized,
    empty_cache); the real allocator's effect shows only on a GPU."""
    engine = new_engine()
    fake = engine.engine
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake.calls.append(("empty_cache",)))
    sync = WeightSync(small_model(), "local")
    for _ in range(2):
        fake.calls.clear()
        sync(engine)
        engine.release_memory()
        kinds = [c[0] for c in fake.calls]
        assert kinds[0] == "empty_cache" and kinds[1] == "resume"  # freed before the first resume
        assert kinds.count("resume") == 2
    engine.loop.close()


def test_failed_update_raises_and_closes_the_session(fake_sglang):
    """(success, message) is checked: a failed update raises (old adapter: silently sampled from
    stale weights) and the session is closed, so the next sync works."""
    engine = new_engine()
    fake = engine.engine
    sync = WeightSync(small_model(), "local")
    fake.fail_update = "shape mismatch for w"
    with pytest.raises(RuntimeError, match="shape mismatch for w"):
        sync(engine)
    assert not fake.session
    sync(engine)
    assert fake.weights
    engine.loop.close()


def test_release_and_resume_are_idempotent(fake_sglang):
    engine = new_engine()
    engine.release_memory()
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["weights"])
    engine.resume_memory(["weights"])
    engine.resume_memory()
    engine.resume_memory()
    assert engine.engine.offload_tags == set() and engine.released == set()
    with pytest.raises(ValueError, match="unknown SGLang memory tags"):
        engine.release_memory(["kv"])
    engine.loop.close()


def test_engine_starts_without_torchrun_agent_store(fake_sglang, monkeypatch):
    """SGLang's subprocesses must not inherit TORCHELASTIC_USE_AGENT_STORE (their c10d stores
    would all be clients: start-up hangs); the trainer's environment is restored afterwards."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    engine = new_engine()
    assert not any(k.startswith("TORCHELASTIC_") for k in engine.engine.env_at_start)
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    engine.loop.close()


def _tp_group_update(rank, world):
    """Rank 0 holds the engine (tp_size=2), rank 1 a peer. Each rank streams tensors filled with
    its own rank id: payload i must come from rank i (each SGLang TP rank reads its own GPU
    copy), cast to the engine dtype."""
    import torch.distributed as dist

    class Patch:
        def setitem(self, d, k, v):
            d[k] = v
    install_fake_sglang(Patch())
    group = dist.new_group([0, 1], backend="gloo")
    named = [(f"w{i}", torch.full((4,), float(rank))) for i in range(3)]
    if rank == 0:
        actor = SGLangEngine("/models/x", tp_size=2, dtype="bfloat16", bucket_bytes=16, group=group)
        actor.resume_memory()
    else:
        actor = SGLangPeer(group, 16, torch.bfloat16)
    actor.update_weights(iter(named))
    if rank == 0:
        actor.engine.fail_update = "bad bucket"
    try:
        actor.update_weights(iter(named))
        failed = None
    except RuntimeError as e:
        failed = str(e)
    if rank == 0:
        updates = [c for c in actor.engine.calls if c[0] == "update"]
        per_rank = [[(n, t.dtype, t.tolist()) for n, t in payload] for payload in updates[0][3]]
        return per_rank, [c[2] for c in updates[:2]], failed
    return None, None, failed


def test_each_tp_rank_hands_its_own_copy():
    (per_rank, flushes, failed0), (_, _, failed1) = run_dist(_tp_group_update, 2)
    assert per_rank == [[(f"w{i}", torch.bfloat16, [float(r)] * 4) for i in range(2)] for r in range(2)]
    assert flushes == [False, True]  # 3 tensors of 8 bytes on the wire (bf16), 16-byte buckets
    assert "bad bucket" in failed0 and "bad bucket" in failed1  # every rank raises


def test_fake_sglang_has_the_engine_methods():
    for method, params in SGLANG_ENGINE_METHODS.items():
        assert params <= set(inspect.signature(getattr(FakeSGLang, method)).parameters), method


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not installed (optional GPU extra)")
def test_sglang_api_contract():
    import sglang
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    from sglang.srt.server_args import ServerArgs

    engine = sglang.Engine
    for method, params in SGLANG_ENGINE_METHODS.items():
        assert hasattr(engine, method), method
        assert params <= set(inspect.signature(getattr(engine, method)).parameters), method
    assert inspect.iscoroutinefunction(engine.async_generate)
    assert {"model_path", "tp_size", "mem_fraction_static", "enable_memory_saver", "base_gpu_id",
            "port", "dtype"} <= param_names(ServerArgs)
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
            "skip_special_tokens"} <= param_names(SGLangSamplingParams)


def _shm_sync_into_sglang(rank, world):
    class Patch:
        def setitem(self, d, k, v):
            d[k] = v
    install_fake_sglang(Patch())
    model = nn.ParameterDict({f"w{i}": nn.Parameter(torch.full((1024,), float(i)))
                              for i in range(12)})
    engine = SGLangEngine("/models/x", dtype="float32", bucket_bytes=4 * 4096)  # 4 per bucket
    sync = WeightSync(model, "shm", bucket_mb=4 * 4096 / 2**20)
    sync(engine)
    got = {n: t[0].item() for n, t in engine.engine.weights.items()}
    return sync.transport, sync.mode, got


def test_shm_weight_sync_into_sglang_delivers_every_weight():
    """The shm transport's tensors are views of two buffers reused in turn (valid until the
    bucket after next is written), and SGLang's bucketing reads ahead: the adapter copies each
    tensor as it takes it. Before, w0, w1, w10, w11 arrived holding other weights' values (the
    GPU case: actor.offload_params=true with several ranks on a host picks shm)."""
    for transport, mode, got in run_dist(_shm_sync_into_sglang, 2):
        assert (transport, mode) == ("shm", "buckets")
        assert got == {f"w{i}": float(i) for i in range(12)}


def test_ignored_seeds_are_announced(fake_sglang, caplog):
    """SGLang 0.5.23 builds the per-request seed tensor only with
    enable_deterministic_inference (srt/sampling/sampling_batch_info.py); without it
    `sampling_seed` is ignored and a resumed run does not repeat its samples: said at start."""
    with caplog.at_level("WARNING"):
        new_engine()
    assert "ignores per-request seeds" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        new_engine(enable_deterministic_inference=True)
    assert "ignores per-request seeds" not in caplog.text


def test_a_groups_sglang_engine_starts_on_its_leaders_own_gpu(monkeypatch):
    """base_gpu_id is the leader's CUDA device as the worker set it, not a guess from its rank
    (a launch whose ranks do not follow the node's device order)."""
    from RL2.rollout.rollout import engine_kwargs
    from RL2.utils.config import load_config

    cfg = load_config("ppo", ["actor.model_name=m", "data.train.path=x", "actor.rollout.env_path=x",
                              "actor.rollout.engine=sglang", "actor.rollout.tp_size=2"]).actor.rollout
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert engine_kwargs("sglang", cfg)["base_gpu_id"] == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_kwargs("sglang", cfg)["base_gpu_id"] == 0


def test_engines_of_one_host_draw_nccl_ports_from_disjoint_slices():
    """SGLang samples a free port in 22000-29999 for each engine's rendezvous, but binds it only
    later (srt/server_args.py PortArgs.init_new): engines started together could draw the same.
    Each engine draws from its base GPU's slice, skipping ports in use."""
    import socket

    from RL2.rollout.sglang_engine import nccl_port

    ports = [nccl_port(gpu, 8) for gpu in range(8) for _ in range(20)]
    assert [(p - 22000) // 1000 for p in ports] == [gpu for gpu in range(8) for _ in range(20)]
    with socket.socket() as taken:  # a slice of one port, in use: the OS picks one elsewhere
        taken.bind(("0.0.0.0", 0))
        busy = taken.getsockname()[1]
        assert nccl_port(0, 1, low=busy, high=busy) != busy
