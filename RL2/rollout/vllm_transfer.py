"""Weight transfer into vLLM over a gloo process group: the CPU backend of vLLM's RL API.

vLLM 0.32 streams new weights through pluggable "weight-transfer engines"
(vllm/distributed/weight_transfer/): the trainer calls `init_weight_transfer_engine(init_info)`
once, then per sync `start_weight_update()`, `update_weights(update_info)` per bucket and
`finish_weight_update(weight_version)`. vLLM ships NCCL/IPC backends (CUDA); this module adds
`rl2_gloo`, registered through RL2's `vllm.general_plugins` entry point (pyproject.toml), so the
same start -> update -> finish path runs on CPU:

- init: the trainer opens a TCPStore and a gloo group of 1 + n_workers ranks (trainer = rank 0,
  vLLM worker w = rank 1 + w); the workers join inside `init_weight_transfer_engine`.
- update: `update_info` names the bucket's tensors (names, dtypes, shapes); the trainer packs them
  into one flat byte buffer (each tensor at a 64-byte aligned offset) and broadcasts it; each
  worker unpacks views and calls the model's `load_weights` (vLLM's own HF-name loader).

This half (trainer side, wire format) imports no vLLM, so a trainer can drive a `vllm serve`
process from an environment without vLLM. The worker half is RL2/rollout/vllm_plugin.py.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import urllib.parse

import torch
import torch.distributed as dist

from RL2.rollout.weight_layout import ALIGN, padded
from RL2.utils.process import port_below_ephemeral

BACKEND = "rl2_gloo"


def register() -> None:
    """vLLM general-plugin entry point (runs in every vLLM process; must be idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "RL2.rollout.vllm_plugin", "GlooWeightTransferEngine")
    except ValueError as e:  # vLLM 0.32 raises on a second registration of the same name
        if "already registered" not in str(e):
            raise


# One API server must front every DP engine: the group is per server URL (1 + its
# /get_world_size ranks, which counts all DP ranks), and a worker's rank counts from DP rank 0.
SPLIT_DP = ("rl2_gloo: vLLM's {mode} data-parallel mode (one API server per DP rank or per "
            "node) is not supported: each URL's weight group would wait for DP engines another "
            "server fronts. Serve with internal load balancing instead (one API server, "
            "--data-parallel-size N; other nodes --headless), or, for a dense model, independent "
            "`vllm serve` instances without --data-parallel-* flags, each listed as a server.")


def split_dp_mode(parallel_config) -> str | None:
    """The DP mode (vLLM 0.32's flags, vllm/config/parallel.py) in which the engines behind one
    API server are not all the DP ranks: external or hybrid load balancing; None otherwise.
    `parallel_config`: vLLM's ParallelConfig or its JSON form (/server_info?config_format=json)."""
    get = parallel_config.get if isinstance(parallel_config, dict) else (
        lambda k: getattr(parallel_config, k, False))
    if get("data_parallel_external_lb"):
        return "external-LB (--data-parallel-external-lb / --data-parallel-rank)"
    if get("data_parallel_hybrid_lb"):
        return "hybrid-LB (--data-parallel-hybrid-lb / --data-parallel-start-rank)"
    return None


def worker_rank(parallel_config, world_size: int) -> int:
    """A vLLM worker's rank in the transfer group: trainer = 0, then workers in vLLM's
    (dp, tp*pp) order, as vLLM's NCCL backend (weight_transfer/nccl_common.py
    worker_init_process_group). data_parallel_index is the global DP rank, kept when a dense
    model's engine resets data_parallel_rank to 0 (v1/engine/core.py run_engine_core). A mode
    or rank the group cannot hold is an error here, not a rendezvous that waits its timeout."""
    mode = split_dp_mode(parallel_config)
    if mode is not None:
        raise RuntimeError(SPLIT_DP.format(mode=mode))
    pc = parallel_config
    rank = 1 + pc.data_parallel_index * pc.world_size + pc.rank
    if not 0 < rank < world_size:
        raise RuntimeError(
            f"rl2_gloo: worker rank {rank} (DP index {pc.data_parallel_index}, {pc.world_size} "
            f"workers per DP rank, worker {pc.rank}) is outside the trainer's group of "
            f"{world_size}; the trainer sizes it from this server's /get_world_size")
    return rank


def layout(shapes: list, dtypes: list[torch.dtype]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed bucket, and the bucket size (same on both sides)."""
    offsets, size = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(size)
        n = dtype.itemsize
        for s in shape:
            n *= s
        size += padded(n)
    return offsets, max(size, ALIGN)


def unpack(buffer: torch.Tensor, names, shapes, dtypes) -> list[tuple[str, torch.Tensor]]:
    offsets, _ = layout(shapes, dtypes)
    out = []
    for name, shape, dtype, off in zip(names, shapes, dtypes, offsets):
        n = dtype.itemsize
        for s in shape:
            n *= s
        out.append((name, buffer[off:off + n].view(dtype).view(list(shape))))
    return out


def route_address(host: str, port: int = 80) -> str:
    """This machine's IP address on the route to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def address_towards(url: str) -> str:
    """This machine's IP address on the route to `url` (what the server must dial back to join
    the weight-transfer group); no packet is sent."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"{url!r}: expected http://host:port")
    try:
        return route_address(parts.hostname, parts.port or 80)
    except OSError as e:
        raise RuntimeError(f"no route to {url} for the weight-transfer group ({e}): set "
                           "actor.rollout.transfer_host to this machine's address") from None


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, store=None,
               own_address: str | None = None):
    """A gloo group outside torch.distributed's default group (the trainer has its own), over
    the TCPStore at host:port. Gloo's default device binds to what this machine's hostname
    resolves to, often 127.0.0.1 or 127.0.1.1, and tells its peers to dial that: a peer on
    another host cannot. So the device binds to `own_address` (the trainer: the address it
    published as `host`; a worker: its address on the route to the trainer), unless
    GLOO_SOCKET_IFNAME names an interface."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return gloo_group(dist.PrefixStore("rl2_weights", store), rank, world_size, timeout,
                      own_address or route_address(host, port))


def gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta, own_address: str):
    """A gloo group whose device binds to `own_address` (or GLOO_SOCKET_IFNAME's interface):
    the address its peers are told to dial (see `open_group`)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface) if interface else
                        dist.ProcessGroupGloo.create_device(hostname=own_address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def cast_copies(named_tensors, dtype: torch.dtype, device: torch.device | None = None):
    """Floating tensors cast to the wire dtype (and moved to `device`, if given), every tensor
    a copy, made once: the weight-sync stream reuses its buffers (shm views are valid until the
    bucket after next), and bucketing reads ahead or holds tensors back."""
    return ((n, t.to(device=device or t.device, dtype=dtype if t.is_floating_point() else t.dtype,
                     copy=True)) for n, t in named_tensors)


class GlooSender:
    """Trainer side of `rl2_gloo`: owns the TCPStore and rank 0 of the transfer group."""

    def __init__(self, n_workers: int = 1, timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.host, self.timeout_s, self.world_size = host, timeout_s, 1 + n_workers
        # port 0: the OS picks a free port (no race with other runs on this host)
        self.store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port
        self.group = None

    def init_info(self) -> dict:
        return {"host": self.host, "port": self.port, "world_size": self.world_size,
                "timeout_s": self.timeout_s}

    def connect(self) -> None:
        """Join the group; blocks until every worker joined (run while the workers' init RPC is
        in flight)."""
        self.group = open_group(self.host, self.port, 0, self.world_size, self.timeout_s, self.store,
                                own_address=self.host)

    @staticmethod
    def update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict:
        return {"names": [n for n, _ in bucket],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket]}

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        offsets, size = layout([t.shape for _, t in bucket], [t.dtype for _, t in bucket])
        buffer = torch.empty(size, dtype=torch.uint8)
        for (_, t), off in zip(bucket, offsets):
            nbytes = t.numel() * t.element_size()
            buffer[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        self.group.broadcast(buffer, 0).wait()

    def close(self) -> None:
        self.group = None
        self.store = None


class NcclSender:
    """CUDA: vLLM's own `nccl` backend in its unpacked wire mode (one broadcast per tensor, as
    `NCCLTrainerWeightTransferEngine` does with packed=False), through vLLM's public rendezvous
    helper; same interface as GlooSender. NOT RUN: no GPU was available. The rendezvous waits
    vLLM's fixed 300 s (`trainer_init` takes no timeout); `timeout_s` bounds the init call the
    caller makes meanwhile (its failure ends the wait for the run; the daemon thread stays)."""

    def __init__(self, n_workers: int = 1, timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.port = port_below_ephemeral(host=host)  # vLLM binds it later
        self.host, self.world_size, self.group = host, 1 + n_workers, None
        self._lock = threading.Lock()

    def init_info(self) -> dict:
        return {"master_address": self.host, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "packed": False}

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init(self.init_info(), rank=0)

    update_info = staticmethod(GlooSender.update_info)  # same fields as NCCLWeightTransferUpdateInfo

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        stream = torch.cuda.current_stream()
        for _, t in bucket:
            t = t.cuda().contiguous()
            with self._lock:  # close() destroys the communicator between calls, never inside one
                if self.group is None:
                    raise RuntimeError("the weight-transfer group was closed (the server was dropped)")
                self.group.broadcast(t, src=0, stream=stream)
        stream.synchronize()  # outside the lock: an abort by close() ends a broadcast stuck here

    def close(self) -> None:
        """Frees the communicator: PyNcclCommunicator.destroy aborts it from a daemon thread
        joined for at most 5 s (vllm/distributed/device_communicators/pynccl.py), so it returns
        also when the server side is gone."""
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            group.destroy()  # blocks up to 5 s (a dropped server: on the pool's loop)
