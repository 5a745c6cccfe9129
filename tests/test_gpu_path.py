"""GPU-path defects, each checked on CPU where it can be shown without a GPU (issue 12).

- collectives hand their backend tensors on the device it serves (NCCL: CUDA only). On CPU the
  "NCCL" case is simulated: the group device is patched to `meta` and the collective is replaced
  by a check that the tensor is on it, so a tensor left on the CPU fails the test.
- offload_optimizer: the AdamW state follows its parameter's device for the step.
- PackedContext survives FSDP2's input cast (one cu_seqlens host sync per micro-batch).
- the model is read from disk once (rank 0) and other ranks start on `meta`: values equal the
  checkpoint, and rank 1's peak host memory stays well below one full model.
- engine=auto on a (faked) CUDA machine without sglang builds the torch engine with torch
  arguments; rollout gathers wait on a gloo group.
CUDA-only behaviour (NCCL itself, CUDA caching allocator, SGLang memory) is not run here:
scripts/gpu_smoke.sh is the first thing to run on a GPU.
"""
import re

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.dist_utils import run_dist


class Reached(Exception):
    """Raised by the fake collective once it checked the device."""


def _fake_collective(name, seen):
    from RL2.parallel import collectives

    def fake(tensor, *args, group=None, **kw):
        want = collectives.group_device(group)
        seen.append((name, tensor.device.type))
        if tensor.device.type != want.type:
            raise AssertionError(f"{name} on {tensor.device.type}, group serves {want.type}")
        raise Reached(name)
    return fake


def _device_audit(rank, world):
    """One "NCCL-like" group: every collective RL2 issues on a host-made tensor must move it to
    the group's device first (old code all-reduced CPU tensors: metrics, grad norm with
    offloaded grads, the weight-sync mode flag, the strict on-policy ratio check)."""
    from types import SimpleNamespace
    from unittest import mock

    from RL2.algorithms.on_policy import check_first_ratio
    from RL2.parallel import collectives
    from RL2.rollout import weight_sync
    from RL2.rollout.weight_sync import WeightSync
    from RL2.workers.worker import Worker

    seen, results = [], {}
    meta = torch.device("meta")
    worker = Worker.__new__(Worker)
    worker.dims = SimpleNamespace(tp=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    param.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])  # CPU grads (offload)
    sync = WeightSync.__new__(WeightSync)
    sync.share, sync.model_bytes, sync._shm_free = False, 0, 0
    sync._plan = lambda size: []
    owner = torch.nn.Module()
    owner.weight = param
    gather = WeightSync(owner, "gather")  # the CPU shards are packed on the group's device
    cases = {
        "all_reduce_metric": lambda: worker.all_reduce_metric(1.0),
        "all_reduce_metrics": lambda: worker.all_reduce_metrics([1.0, 2.0]),
        "grad_norm": lambda: collectives.grad_norm_and_clip([param], 1.0),
        "weight_sync_mode": lambda: sync._choose_mode(None),
        "weight_sync_gather": lambda: list(gather.stream()),
        "strict_on_policy_ratio": lambda: check_first_ratio(None, 0.0, 0),
    }
    with mock.patch.object(collectives, "group_device", lambda group=None: meta), \
            mock.patch.object(weight_sync, "group_device", lambda group=None: meta), \
            mock.patch.object(dist, "all_reduce", _fake_collective("all_reduce", seen)), \
            mock.patch.object(dist, "all_gather_single", _fake_collective("all_gather_single", seen)):
        for name, fn in cases.items():
            try:
                fn()
                results[name] = "no collective"
            except Reached:
                results[name] = "ok"
            except (AssertionError, RuntimeError, NotImplementedError) as e:
                results[name] = f"{type(e).__name__}: {e}"
    return results


def test_collectives_use_the_group_device():
    results = run_dist(_device_audit, 2)[0]
    assert results == {"all_reduce_metric": "ok", "all_reduce_metrics": "ok", "grad_norm": "ok",
                       "weight_sync_mode": "ok", "weight_sync_gather": "ok",
                       "strict_on_policy_ratio": "ok"}


def test_check_device_names_the_mismatch(monkeypatch):
    from RL2.parallel import collectives

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match="collective on a cpu tensor.*serves cuda"):
        collectives.check_device(torch.zeros(1))


def test_offload_optimizer_keeps_state_beside_its_parameter():
    """Old code moved the AdamW moments to "cuda" for the step whatever the parameter's device
    (with offload_params the shards stay on the host: mixed-device foreach AdamW fails). Here the
    worker claims CUDA while the parameters are on the CPU, as with offload_params."""
    from RL2.workers.worker import Worker, make_scheduler

    def run(offload):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        w = Worker.__new__(Worker)
        w.cfg = OmegaConf.create(dict(offload_optimizer=offload, max_grad_norm=1.0, warmup_ratio=0.0,
                                      min_lr_ratio=0.0, scheduler="constant"))
        w.device, w.model = "cuda", model
        w.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
        w.scheduler = make_scheduler(w.optimizer, w.cfg, 4)
        for step in range(3):
            model(torch.full((4, 3), float(step + 1))).square().sum().backward()
            with torch.no_grad():
                w.step()
        devices = {v.device.type for s in w.optimizer.state.values() for v in s.values() if v.dim()}
        return [p.detach().clone() for p in model.parameters()], devices

    # grad_norm_and_clip needs no process group for plain tensors
    ref, _ = run(False)
    got, devices = run(True)
    assert devices == {"cpu"}
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _packed_ctx_under_fsdp(rank, world, model_path):
    from transformers import AttentionInterface

    from RL2.parallel import attention
    from RL2.parallel.fsdp import parallelize
    from RL2.parallel.mesh import ParallelDims
    from RL2.workers.loading import load_hf_model

    model = load_hf_model(model_path, False, torch.float64)
    parallelize(model, ParallelDims(world), param_dtype=torch.float32)  # FSDP casts inputs
    seen = []

    def spy(module, q, k, v, mask, **kw):
        seen.append(kw[attention.CTX_KWARG])
        return attention.packed_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register(attention.NAME, spy)
    ctx = attention.PackedContext(torch.tensor([0, 5, 12], dtype=torch.int32), 7)
    ids = torch.arange(12)[None] % 50
    pos = torch.tensor([list(range(5)) + list(range(7))])
    model(input_ids=ids, position_ids=pos, use_cache=False, **attention.packed_kwargs(ctx))
    return len(seen), all(c is ctx for c in seen)


def test_packed_context_survives_fsdp_input_cast(assets):
    """FSDP2 rebuilds dataclasses in forward kwargs at every unit (torch.distributed.utils.
    _apply_to_tensors): the old dataclass context lost its cached bounds at every layer."""
    n_layers_seen, same = run_dist(_packed_ctx_under_fsdp, 1, assets["model"])[0]
    assert n_layers_seen == 2 and same


MEMORY_MODEL = dict(hidden=768, layers=4, heads=12, kv_heads=4, intermediate=2048)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


def _meta_load(rank, world, model_path, tp):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM  # noqa: F401  (imported before measuring)

    from RL2.parallel.fsdp import parallelize
    from RL2.parallel.mesh import ParallelDims
    from RL2.workers.loading import load_sharded

    from RL2.workers.loading import load_hf_model

    dims = ParallelDims(world, tp=tp)
    # import every module the load uses first: lazy imports are not the model's memory
    parallelize(load_hf_model(model_path, False, torch.float32, on_meta=True), dims,
                param_dtype=torch.float32)
    before = reset_peak_rss()
    model = load_sharded(model_path, False, torch.float32, False,
                         lambda m: parallelize(m, dims, param_dtype=torch.float32), torch.device("cpu"))
    peak = peak_rss() - before
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ref, ref_buffers = _checkpoint(model_path)  # after measuring
    buffers = dict(model.named_buffers())
    mismatched = [n for n, t in ref.items() if not torch.equal(full[n], t)] if rank == 0 else []
    mismatched += [n for n, b in ref_buffers.items() if not torch.equal(buffers[n], b)]
    model_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    return peak, model_bytes, sorted(set(full) ^ set(ref)) if rank == 0 else [], mismatched


def _checkpoint(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict(), dict(model.named_buffers())


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_meta_load_reads_the_checkpoint_once(assets, tmp_path, tp):
    """Values equal the checkpoint (parameters and non-persistent buffers such as rotary
    inv_freq, on every rank); with tp=1, rank 1 never holds a full model: its peak host memory
    grows by well under one model (measured: ~0.65 of the model; loading the whole model on
    every rank as before: ~1.15)."""
    from RL2.tools.make_assets import build_tiny_model

    path = assets["model"]
    if tp == 1:
        path = str(tmp_path / "model")
        build_tiny_model(path, assets["tokenizer"], "qwen2", **MEMORY_MODEL)
    results = run_dist(_meta_load, 2, path, tp)
    for rank, (peak, model_bytes, missing, mismatched) in enumerate(results):
        assert missing == [] and mismatched == [], (rank, missing, mismatched)
    if tp == 1:
        peak_rank1, model_bytes = results[1][:2]
        assert model_bytes > 100e6
        assert peak_rank1 < 0.85 * model_bytes, (peak_rank1 / 1e6, model_bytes / 1e6)


def _rollout_choice(rank, world, model_path):
    """engine=auto with CUDA "available" and no sglang: torch engine, torch arguments only."""
    import importlib.util
    from types import SimpleNamespace
    from unittest import mock

    from RL2.rollout import rollout as rollout_mod

    built = {}

    class Recorder:
        loop = None

        def __init__(self, model_path, tokenizer, **kw):
            built.update(kw)

    cfg = OmegaConf.create(dict(engine="auto", tp_size=1, bucket_mb=1, max_model_len=64,
                                sglang=dict(mem_fraction_static=0.5), max_turns=1, max_length=64))
    real_find_spec = importlib.util.find_spec
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: 1), \
            mock.patch.object(importlib.util, "find_spec",
                              lambda name, *a: None if name == "sglang" else real_find_spec(name, *a)), \
            mock.patch("RL2.rollout.torch_engine.TorchEngine", Recorder):
        env = SimpleNamespace(start=lambda: None)
        r = rollout_mod.Rollout(cfg, None, env, model_path, "cuda", seed=0)
    groups = []
    real = rollout_mod.gather_objects  # (one rank: no collective runs, but the group is named)
    with mock.patch.object(rollout_mod, "gather_objects",
                           lambda obj, group=None: (groups.append(group), real(obj, group))[1]):
        r.engine = None  # no trajectories: only the wait is exercised (then no result: KeyError)
        with pytest.raises(KeyError):
            r._generate([{"index": 0}], OmegaConf.create(dict(temperature=0.0)), 1, "t")
    return r.kind, built, dist.get_backend(groups[0]), groups[0] is r.cpu_group, rollout_mod.ROLLOUT_TIMEOUT


def test_engine_auto_without_sglang_and_gloo_wait(assets):
    kind, built, backend, is_cpu_group, timeout = run_dist(_rollout_choice, 1, assets["model"])[0]
    assert kind == "torch" and built == {"max_model_len": 64}  # no tp_size / bucket_bytes / ...
    assert backend == "gloo" and is_cpu_group and timeout.total_seconds() >= 3600


def test_transfer_threads_run_on_the_callers_cuda_device(monkeypatch):
    """Weight-transfer calls (an NCCL group's join and broadcasts) run on a thread of their
    own. CUDA's current device is per host thread and a new thread starts on device 0
    (cudaSetDevice's scope; torch.cuda.set_device calls it), so a rank on GPU 3 would send
    from GPU 0 unless the thread sets it. Fake: a thread-local current device, 0 by default."""
    import asyncio
    import threading

    from RL2.rollout.engine import in_daemon_thread, on_this_cuda_device

    local = threading.local()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(local, "device", d))

    async def main():
        torch.cuda.set_device(3)
        return await in_daemon_thread(torch.cuda.current_device)

    assert asyncio.run(main()) == 3
    # the async-rollout producer thread (RL2/rollout/producer.py) the same way
    set_device, seen = on_this_cuda_device(), []

    def producer():
        set_device()
        seen.append(torch.cuda.current_device())
    thread = threading.Thread(target=producer)
    thread.start()
    thread.join()
    assert seen == [3]
    # a weight sync of the server pool called inside a running loop (an in-flight update) runs
    # on a helper thread of its own, whose transfer threads take the device from it
    from RL2.rollout.remote import RemotePool

    pool = RemotePool.__new__(RemotePool)
    pool.closed = pool._paused = False

    async def in_flight():
        async def sync():
            return torch.cuda.current_device(), await in_daemon_thread(torch.cuda.current_device)
        return pool._run(sync(), timeout=10)

    assert asyncio.run(in_flight()) == (3, 3)


def _mesh_timeouts(rank, world):
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import Backend, _get_default_timeout

    from RL2.parallel.mesh import init_distributed
    from RL2.utils.process import port_below_ephemeral

    # run_dist's own group goes: RL2's set-up makes the default group. On a fresh port (drawn
    # while the old store holds its own): a rank that re-joins first must not reach the old
    # store, which the other rank may not have torn down yet (CI hung there)
    port = [port_below_ephemeral(host="127.0.0.1") if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    init_distributed("cpu", 1234.0)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("a", "b"))
    groups = [dist.group.WORLD, mesh.get_group("a"), mesh.get_group("b")]
    return ([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups],
            _get_default_timeout(Backend.NCCL).total_seconds())


def test_every_group_waits_as_long_as_the_config_says(monkeypatch):
    """Without `timeout=`, torch gives an NCCL group 10 minutes (ProcessGroupNCCL's default;
    distributed_c10d._get_default_timeout), shorter than rank 0 alone may take to read or save a
    large model while the others wait in a collective; gloo's default is 30. A device mesh's
    groups get the backend's default, not the default group's timeout: real gloo groups here,
    and the default NCCL groups would take."""
    import os
    from datetime import timedelta

    from RL2.parallel import mesh

    assert run_dist(_mesh_timeouts, 2, timeout=120)[0] == ([1234.0] * 3, 1234.0)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    from torch.distributed import distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # restored after the test
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    cfg = OmegaConf.load(os.path.join(os.path.dirname(mesh.__file__), "..", "config", "trainer",
                                      "default.yaml"))
    assert mesh.init_distributed("cuda", cfg.dist_timeout) == "cuda"
    assert calls == [("nccl", {"timeout": timedelta(seconds=cfg.dist_timeout)})]
    assert cfg.dist_timeout >= 1800
