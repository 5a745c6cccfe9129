"""Weight sync: training shards (FSDP2 / TP DTensors) -> full tensors with HF names -> engine.

The engine receives one lazy stream of (HF name, full tensor); the torch engine copies each as it
arrives, the SGLang adapter groups them into dtype-homogeneous buckets of bounded size. How the
full tensors are produced (the transport) is chosen once per run by `WeightSync`:

- "local": every tensor lives on a one-rank mesh; its local shard already is the full tensor.
  An engine in this process's CPU memory without a dtype cast uses those tensors as its weights
  ("aliased": the optimizer's in-place updates are the sync); other engines copy them.
- "shm" (CPU, every rank on one host): each rank writes its own shard, at the offset DCP would
  use, into a shared-memory file mapped by every rank; gloo moves every byte through loopback
  TCP instead (a PPO step on SmolLM2-135M, 2 ranks: see benchmarks/README.md). Two modes:
  * shared weights (engines that can, i.e. the torch engine on CPU, when the model fits in
    /dev/shm): the file holds the whole model and the engines use it as their weights. A sync is
    each rank writing its shards (1/world of the model) between two barriers; no engine copy,
    and one copy of the engine weights per host instead of one per rank.
  * buckets (otherwise): two bounded buckets used in turn; one barrier marks a bucket complete
    and every engine copies full tensors out of it.
  The barriers go over named pipes (a pipe round trip is far cheaper than a gloo all-reduce).
- "gather": one flat all-gather per bucket of the shards each rank owns (NCCL on GPU; the
  multi-host fallback).

Every rank walks the state dict in the same order (the transports are collectives), so a sync
must run outside any rollout coroutine. Where each tensor sits in a bucket (pure planning, the
same on every rank): RL2/rollout/weight_layout.py.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from RL2.parallel.collectives import gather_objects, group_device
from RL2.rollout.shm import SHM_DIR, SharedFile
from RL2.rollout.weight_layout import ALIGN, Region, gather_plan, padded, piece, plan

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "local", "shm", "gather")


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _state(model) -> dict:
    """The model's state dict without detach copies (a DTensor detach is not free)."""
    with torch.no_grad():
        return model.state_dict(keep_vars=True)


@torch.no_grad()
def _local(tensor) -> torch.Tensor:
    """This rank's shard (views, no grad tracking)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def _raw_local(tensor) -> torch.Tensor:
    """This rank's shard itself: `to_local()` is an autograd function (a large share of a small
    model's sync); the raw attribute is only read under no_grad, as a copy source."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class WeightSync:
    """Moves a trainer model's current weights into an engine. Build once per run, on every rank
    of the model's process groups (construction and calls are collectives), after the model is
    parallelized and any checkpoint loaded in place: the parameter objects are kept, so a model
    whose parameters are replaced (e.g. `load_state_dict(assign=True)`) needs a new WeightSync."""

    def __init__(self, model, transport: str = "auto", bucket_mb: float = 512,
                 dtype: torch.dtype | None = None, share: bool = True, adapter_only: bool = False):
        """share: let engines that can use the trainer's tensors (local) or the shared file (shm)
        as their weights; False makes every engine copy. adapter_only: with LoRA, move only the
        adapters (`Engine.update_adapter`) instead of merged weights."""
        if transport not in TRANSPORTS:
            raise ValueError(f"weight sync transport must be one of {TRANSPORTS}, got {transport!r}")
        self.model, self.dtype, self.share = model, dtype, share
        self.requested_share = share  # (`share` is turned off below where it cannot apply)
        from RL2.workers.lora import adapter_config, is_adapter, scalings

        # LoRA: the engine gets merged HF weights (W + scale * B @ A), streamed and copied (an
        # engine cannot alias or share tensors that do not exist on the trainer side), or only
        # the adapters (the base never changes).
        self.lora_scaling = scalings(model) or None
        self.adapter = adapter_config(model) if self.lora_scaling and adapter_only else None
        if self.lora_scaling:
            self.share = False
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._shm_free = 0
        # The parameter objects, fetched once (FSDP2 keeps its sharded parameters for the whole
        # run and updates them in place; a state_dict() call costs as much as syncing 1M params).
        self._params = _state(model)
        if self.adapter:
            self._params = {n: t for n, t in self._params.items() if is_adapter(n)}
        self.transport = self._choose(transport)
        # chosen on the first sync: "aliased" (local, the engine uses the trainer's tensors),
        # "shared" / "buckets" (shm); None = streamed copies
        self.mode = None
        self._regions: list[Region] | None = None
        self._file: SharedFile | None = None
        self._views: list[list[torch.Tensor]] = []
        self._used = 0  # buckets written so far: selects the half to write next
        self._shared_with = None  # the engine using the shared weights
        self._share_key = None
        self._local_engine = None  # the engine the local transport last decided for
        logger.info("weight sync transport: %s", self.transport)

    def _choose(self, transport: str) -> str:
        tensors = list(self._params.values())
        sizes = [padded(t.numel() * self._dtype_of(t).itemsize) for t in tensors]
        self.model_bytes = sum(sizes)
        # A bucket never needs more than the whole model, and must hold the largest tensor.
        self.bucket_bytes = max(min(self.bucket_bytes, self.model_bytes), max(sizes, default=0), ALIGN)
        dtensors = [t for t in tensors if isinstance(t, DTensor)]
        one_rank = all(t.device_mesh.size() == 1 for t in dtensors)
        if transport == "local" and not one_rank:
            raise ValueError("weight sync transport 'local' needs a model on a one-rank mesh")
        if transport in ("auto", "local") and one_rank:
            return "local"
        if transport in ("auto", "shm"):
            reason = self._shm_unavailable(tensors)
            if reason is None:
                return "shm"
            if transport == "shm":
                raise RuntimeError(f"weight sync transport 'shm' is unavailable: {reason}")
            logger.info("weight sync: shared memory unavailable (%s); all-gathering per tensor", reason)
        return "gather"

    def _shm_unavailable(self, tensors) -> str | None:
        """Why the shared-memory transport cannot run here (None = it can); the same answer on
        every rank (a collective)."""
        if not dist.is_initialized():
            return "no process group"
        if any(t.device.type != "cpu" for t in tensors):
            return "tensors are not on the CPU"
        try:
            stat = os.statvfs(SHM_DIR)
            free = stat.f_bavail * stat.f_frsize
        except OSError:
            free = 0
        facts = gather_objects((socket.gethostname(), free))
        if len({host for host, _ in facts}) > 1:
            return "ranks on several hosts"
        self._shm_free = min(f for _, f in facts)
        need = 2 * self.bucket_bytes
        if self._shm_free < need:
            return f"{SHM_DIR} has {self._shm_free / 2**20:.0f} MiB free, needs {need / 2**20:.0f} MiB"
        return None

    def _dtype_of(self, tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype

    # ------------------------------------------------------------------ local / gather
    def _stream_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._params.items():
            yield name, _cast(_local(tensor), self.dtype)

    # ------------------------------------------------------------------ gather
    def _setup_gather(self) -> None:
        """Bucket layout and, once, which part of every tensor each rank packs (one object
        all-gather): per bucket and rank, the (region, slices, byte offset) pieces."""
        self._regions = self._plan(self.bucket_bytes)
        indices = gather_objects([r.index for r in self._regions])
        self._pieces, self._segment = gather_plan(self._regions, indices)

    def _stream_gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One flat all-gather per bucket (NCCL on GPU, gloo on CPU): every rank packs the shards
        it owns (`shard_index`: replicas send nothing) into one byte buffer, and cuts the full
        tensors out of the concatenation of all ranks' buffers."""
        if self._regions is None:
            self._setup_gather()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = group_device()  # CUDA for NCCL even when parameters are offloaded to the CPU
        for bucket, pieces in enumerate(self._pieces):
            seg = self._segment[bucket]
            send = torch.empty(seg, dtype=torch.uint8, device=device)
            for i, index, offset in pieces[rank]:
                local = _cast(_raw_local(self._params[self._regions[i].name]).detach(), self.dtype)
                piece(send, offset, local.shape, local.dtype).copy_(local)
            recv = torch.empty(world * seg, dtype=torch.uint8, device=device)
            dist.all_gather_single(recv, send)
            full = {}
            for q in range(world):
                for i, index, offset in pieces[q]:
                    r = self._regions[i]
                    if i not in full:
                        full[i] = torch.empty(r.shape, dtype=r.dtype, device=device)
                    part = full[i][index]
                    part.copy_(piece(recv, q * seg + offset, part.shape, r.dtype))
            for i in sorted(full):
                yield self._regions[i].name, full[i]

    # ------------------------------------------------------------------ shared memory
    def _plan(self, bucket_bytes: int) -> list[Region]:
        """Bucket layout (same on every rank: it depends on names, shapes and dtypes only)."""
        return plan(self._params, bucket_bytes, self._dtype_of)

    def _setup_shm(self, shared: bool) -> None:
        size = self.model_bytes if shared else self.bucket_bytes
        self.mode = "shared" if shared else "buckets"
        self._regions = self._plan(size)
        self._file = SharedFile(size, 1 if shared else 2)
        # views made once: per sync only the copies remain
        self._views = [[self._file.view(h, r) for r in self._regions] for h in range(1 if shared else 2)]
        self._targets = [[v[r.index] if r.index is not None else None for v, r in zip(views, self._regions)]
                         for views in self._views]

    def _write(self, half: int, members) -> None:
        """This rank's shards of `members` into their regions, as one foreach copy (the slices
        of the shared file are made once)."""
        dsts = self._targets[half]
        members = [i for i in members if dsts[i] is not None]
        if not members:  # e.g. a data-parallel replica: another rank writes these
            return
        with torch.no_grad():
            torch._foreach_copy_([dsts[i] for i in members],
                                 [_raw_local(self._params[self._regions[i].name]) for i in members])

    def _stream_buckets(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Double buffering: writing bucket k+1 only needs every rank to be done reading bucket
        k-1, which the collective completing bucket k proves, so one collective per bucket."""
        by_bucket: dict[int, list[int]] = {}
        for i, r in enumerate(self._regions):
            by_bucket.setdefault(r.bucket, []).append(i)
        for members in by_bucket.values():
            half = self._used % 2
            self._write(half, members)
            self._file.collective()
            self._used += 1
            for i in members:
                yield self._regions[i].name, self._views[half][i]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, for engines that copy; consume it completely
        on every rank. Tensors from the shm transport are views valid until the next bucket."""
        if self.adapter:  # (PEFT name, copy): bucket views are reused, engines may hold them
            from RL2.workers.lora import peft_name

            return ((peft_name(n), t.clone()) for n, t in self._stream_full())
        if self.lora_scaling:
            from RL2.workers.lora import merged_items

            return merged_items(self._stream_full(), self.lora_scaling, copy=self.transport != "local")  # bucket views are reused
        return self._stream_full()

    def load(self, engine, weights) -> None:
        """Give `engine` the pairs of `stream()` (now, or kept by `Rollout.snapshot`)."""
        if self.adapter:
            engine.update_adapter(iter(weights), self.adapter)
        else:
            engine.update_weights(iter(weights))

    def _stream_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.transport == "local":
            return self._stream_local()
        if self.transport == "shm":
            if self.mode == "shared":
                raise RuntimeError("this WeightSync shares its weights with an engine; call it, "
                                   "do not stream it")
            if self._regions is None:
                self._setup_shm(shared=False)
            return self._stream_buckets()
        return self._stream_gathered()

    def _choose_mode(self, engine) -> bool:
        """Shared weights when every engine can use them and the model fits (a collective)."""
        layout = [(r.name, torch.empty(r.shape, dtype=r.dtype, device="meta"))
                  for r in self._plan(self.model_bytes)]
        can = self.share and (engine is None or engine.can_share_weights(layout))
        fits = self.model_bytes <= self._shm_free // 2  # leave room for everything else
        from RL2.parallel.collectives import all_reduce_floats

        return bool(all_reduce_floats([1.0 if can and fits else 0.0], op=dist.ReduceOp.MIN)[0])

    def _sync_shared(self, engine) -> None:
        self._file.collective()  # every engine is idle: nobody reads while the weights change
        self._write(0, range(len(self._regions)))
        self._file.collective()  # every shard is written
        if engine is not None:
            self._share(engine, [(r.name, v) for r, v in zip(self._regions, self._views[0])], None)

    def _share(self, engine, named: list, key) -> None:
        """Hand `engine` the tensors it must use as weights, unless it already uses them (`key`
        identifies the storage for aliased trainer tensors)."""
        if self._shared_with is engine and engine.weights_shared() and key == self._share_key:
            engine.weights_changed()
        else:
            engine.share_weights(named)
            self._shared_with, self._share_key = engine, key

    def _can_alias(self, engine) -> bool:
        """One rank, engine sharing this process's CPU memory, no dtype cast: the engine can use
        the trainer's shard storage itself."""
        if not self.share:
            return False
        if any(t.device.type != "cpu" or self._dtype_of(t) != t.dtype for t in self._params.values()):
            return False
        return engine.can_share_weights([(n, _raw_local(t)) for n, t in self._params.items()])

    def _sync_aliased(self, engine) -> int:
        """The optimizer updates the shards in place, so the engine already holds the new values:
        a sync only announces them. The storage is checked each time (a reloaded checkpoint may
        have replaced it) and shared again if it moved."""
        local = [(n, _raw_local(t)) for n, t in self._params.items()]
        key = [t.data_ptr() for _, t in local]
        self._share(engine, [(n, t.detach()) for n, t in local], key)
        return sum(t.numel() * t.element_size() for _, t in local)

    def __call__(self, engine) -> dict:
        """Bring `engine` up to the current weights (None on ranks that hold no engine; they still
        take part). Returns timing metrics."""
        start = time.perf_counter()
        if self.transport == "shm" and self.mode is None and self._choose_mode(engine):
            self._setup_shm(shared=True)
        if engine is not None:
            free_device_cache()  # the engine re-maps exactly what it sized at start-up
            engine.resume_memory(["weights"])
        if self.transport == "local" and engine is not None and engine is not self._local_engine:
            # decided once per engine: alias its weights to the trainer's, or copy (mode None)
            self._local_engine = engine
            self.mode = "aliased" if self._can_alias(engine) else None
        if self.mode == "aliased":
            n_bytes = self._sync_aliased(engine) if engine is not None else 0
        elif self.mode == "shared":
            self._sync_shared(engine)
            n_bytes = sum(r.nbytes for r in self._regions)
        else:
            n_bytes = 0

            def counted():
                nonlocal n_bytes
                for name, t in self.stream():
                    n_bytes += t.numel() * t.element_size()
                    yield name, t

            if engine is None:
                for _ in counted():
                    pass
            else:
                self.load(engine, counted())
        if engine is not None:
            engine.resume_memory()  # the rest (SGLang: cuda_graph, kv_cache)
        return {"sync_seconds": time.perf_counter() - start, "sync_bytes": n_bytes}


def free_device_cache() -> None:
    """Hand the trainer's cached CUDA blocks back to the driver before an engine resumes its
    memory: SGLang re-maps the KV pool it sized at start-up, before the optimizer state existed,
    and the caching allocator would otherwise still hold the trainer's freed blocks (OOM)."""
    if torch.cuda.is_initialized():  # initialised implies available
        torch.cuda.empty_cache()

