"""Process-group set-up and the two device meshes of a worker.

Parameters live on (ddp, fsdp, tp); data and compute on (dp, sp, tp), dp = world / (sp * tp).
tp is the innermost dimension of both, so the tp groups of the two meshes are the same ranks.
"""
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)


def resolve_device(device: str = "auto") -> str:
    """trainer.device -> "cuda" | "cpu" (auto: CUDA when present)."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> str:
    """Initialise the default process group from torchrun's env (or a 1-rank group without it).

    Returns the device type: "cuda" (NCCL) when CUDA is present and not disabled, else "cpu" (gloo).
    """
    device = resolve_device(device)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if "MASTER_PORT" not in os.environ:
            from RL2.utils.process import port_below_ephemeral

            os.environ["MASTER_PORT"] = str(port_below_ephemeral(host="127.0.0.1"))
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:  # a CPU step's tensors are malloc'd memory: reuse it, no fresh pages each step
            from RL2.utils.process import cap_onednn_caches, keep_freed_memory

            keep_freed_memory()
            cap_onednn_caches()
        # Rank 0 alone may read or write a large model for longer than NCCL's default 10
        # minutes (gloo: 30) while the other ranks wait. A group made without a timeout, as
        # init_device_mesh makes its groups, takes the backend's default from these module
        # globals (distributed_c10d._get_default_timeout), not the default group's timeout.
        timeout = timedelta(seconds=timeout_s)
        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)
    return device


@dataclass
class ParallelDims:
    world_size: int
    ddp: int = 1
    tp: int = 1
    sp: int = 1
    device_type: str = "cpu"

    def __post_init__(self):
        w = self.world_size
        for name, size in (("ddp_size", self.ddp), ("tp_size", self.tp), ("sp_size", self.sp)):
            if size < 1:
                raise ValueError(f"actor.{name}={size} must be >= 1")
        if w % (self.ddp * self.tp):
            raise ValueError(
                f"world size {w} is not divisible by ddp_size*tp_size = {self.ddp}*{self.tp}; "
                f"change actor.ddp_size/tp_size or the number of processes")
        if w % (self.sp * self.tp):
            raise ValueError(
                f"world size {w} is not divisible by sp_size*tp_size = {self.sp}*{self.tp}; "
                f"change actor.sp_size/tp_size or the number of processes")
        self.fsdp = w // (self.ddp * self.tp)
        self.dp = w // (self.sp * self.tp)
        self._param_mesh = self._data_mesh = None

    @property
    def param_mesh(self) -> DeviceMesh:
        if self._param_mesh is None:
            self._param_mesh = init_device_mesh(
                self.device_type, (self.ddp, self.fsdp, self.tp), mesh_dim_names=("ddp", "fsdp", "tp"))
        return self._param_mesh

    @property
    def data_mesh(self) -> DeviceMesh:
        if self._data_mesh is None:
            self._data_mesh = init_device_mesh(
                self.device_type, (self.dp, self.sp, self.tp), mesh_dim_names=("dp", "sp", "tp"))
        return self._data_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """HSDP (replicate x shard) when ddp > 1, else plain sharding over all non-tp ranks."""
        if self.ddp > 1:
            return self.param_mesh["ddp", "fsdp"]
        return self.param_mesh["fsdp"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.param_mesh["tp"] if self.tp > 1 else None

    @property
    def sp_group(self):
        return self.data_mesh.get_group("sp") if self.sp > 1 else None

    @property
    def dp_rank(self) -> int:
        return self.data_mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        return self.data_mesh.get_local_rank("sp")
