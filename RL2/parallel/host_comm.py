"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU process groups whose ranks
all run on one host.

Why: gloo moves FSDP's parameters and gradients over loopback TCP. Between two processes here a
100 MB all-gather took ~0.24 s and a reduce-scatter ~0.19 s, and a training step does three of
them (forward and backward all-gathers, the gradient reduce-scatter): most of the gap between
2 processes x 1 thread and 1 process x 2 threads (benchmarks/README.md, fix 12). Through one
shared file the same collectives are a few memory copies.

How: FSDP2 accepts custom collectives (`FSDPModule.set_custom_all_gather` /
`set_custom_reduce_scatter`, torch/distributed/fsdp/_fully_shard/_fsdp_api.py: `__call__(
output_tensor, input_tensor, group, [op,] async_op)` returning a Work or None). Each rank writes its
input into its own slot of a file every rank of the group maps (RL2/rollout/shm.py), waits at a
pipe barrier, reads what it needs, and waits again before any slot may be written over. Results
are exact: an all-gather is a copy, and a reduce-scatter adds the ranks' chunks in rank order
(for two ranks a + b, bitwise what gloo returns).

Buffers: FSDP asks its collectives for the buffers it fills (`allocate`). A fresh buffer per call
costs page faults on every first touch (a copy into fresh pages took twice as long as into
reused ones); these buffers are kept and handed out again once nothing else holds them. The
reduce-scatter's input goes straight into this rank's slot of the shared file, so FSDP's
gradient copy-in is also the publish. The all-gather's output is a region of a second shared
file (`GatherRegions`): FSDP's copy-in writes this rank's shard into it and its copy-out reads the
gathered unit from it, so the collective itself copies nothing (it was two copies, shard into
the slot and every slot into the output: 23 of a 2 x 1 GRPO step's ~300 ms forward).

Falls back to the group's own collective (gloo) when the ranks are not on one host, for inputs
bigger than the largest shared file that could be made (a small /dev/shm), for a reduction other
than SUM, and for inputs whose slots would exceed `max_bytes`.
"""
from __future__ import annotations

import logging
import math
import socket
import weakref

import torch
import torch.distributed as dist

from RL2.parallel.collectives import gather_objects
from RL2.parallel.fsdp import fsdp_units
from RL2.rollout.shm import SharedFile
from RL2.rollout.weight_layout import padded

logger = logging.getLogger(__name__)

CHOICES = ("shm", "gloo")
MAX_BYTES = 2 << 30  # the whole file (every rank's slot), bytes


def host_id() -> str:
    """This machine: hostname and boot id (containers on one host share the boot id, machines
    with one hostname do not)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class HostGroup:
    """The shared slots of one process group, grown as the inputs grow (every rank sees the same
    sizes in the same order, so every rank grows at the same call)."""

    def __init__(self, group, max_bytes: int = MAX_BYTES, what: str = "fsdp comm"):
        self.group, self.max_bytes, self.what = group, max_bytes, what
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.usable = len(set(gather_objects(host_id(), group))) == 1
        self.file: SharedFile | None = None
        self.calls = 0  # collectives served through shared memory (tests check no silent fallback)

    def slots(self, nbytes: int) -> torch.Tensor | None:
        """[world, nbytes] uint8 views of the ranks' slots, or None: use the group's collective."""
        need = nbytes * self.world
        if not self.usable or need > self.max_bytes:
            return None
        if self.file is None or self.file.size < need:
            old = self.file.size if self.file else 0
            self.file = None  # the old mapping goes first: the peak is the new file, not both
            # doubled (fewer regrowths), else just what is needed; when neither fits (a small
            # /dev/shm) the old size is made again so inputs that fitted before stay here
            if not self._make(max(need, min(2 * old, self.max_bytes)), need):
                logger.warning("%s: %s go to %s", self.what,
                               f"inputs over {old} bytes" if old else "all inputs",
                               dist.get_backend(self.group))
                self.max_bytes = old
                if not (old and self._make(old)):
                    self.usable = False
                return None
        return self.file.buffer[:need].view(self.world, nbytes)

    def _make(self, *sizes: int) -> bool:
        """The file at the first of `sizes` that can be made. A failure on any rank is reported
        to every rank, so all ranks try the same sizes and agree on the result."""
        for size in dict.fromkeys(sizes):
            try:
                self.file = SharedFile(size, 1, self.group, self.what)
                return True
            except RuntimeError as e:
                logger.warning("%s: no %d-byte shared file: %s", self.what, size, e)
        return False

    def barrier(self) -> None:
        self.file.collective()

    def publish(self, t: torch.Tensor) -> torch.Tensor | None:
        """Write `t`'s bytes into this rank's slot and wait until every rank has written its own.
        Returns all slots ([world, nbytes] uint8) to read from, after which every rank calls
        `release()`; or None (nothing written): use the group's own collective instead."""
        src = as_bytes(t)
        slots = self.slots(src.numel())
        if slots is not None:
            if src.data_ptr() != slots[self.rank].data_ptr():  # else written there already
                slots[self.rank].copy_(src)
            self.barrier()
            self.calls += 1
        return slots

    def release(self) -> None:
        self.barrier()  # every rank has read what it needs: the slots may be written again


_SHARED: "weakref.WeakValueDictionary[tuple, HostGroup]" = weakref.WeakValueDictionary()


def shared_group(group, what: str, max_bytes: int = MAX_BYTES) -> HostGroup:
    """One HostGroup per set of ranks and use while any user holds it: the actor, reference and
    critic each build their own (equal) groups, and one shared file serves them all, since their
    collectives run one after another on the trainer thread, each finished before it returns. A
    new default group (process group re-initialised) gets a new one. Collective (every rank of
    `group` calls it at the same point)."""
    key = (tuple(dist.get_process_group_ranks(group)), what, max_bytes)
    host = _SHARED.get(key)
    live = host is not None and host.default_group is dist.group.WORLD
    # an entry is freed when the garbage collector reaches its last holder (a deleted model's
    # FSDP state is a reference cycle), at a different time on each rank: reuse only if every
    # rank still has it, else one rank would wait at the old file's barrier, the rest in gloo
    if not all(gather_objects(live, group)):
        host = _SHARED[key] = HostGroup(group, max_bytes, what)
        host.default_group = dist.group.WORLD  # held: its id cannot be reused while the entry lives
    return host


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _within(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= t.data_ptr() < start + buffer.numel()


def _held(buf: torch.Tensor) -> bool:
    """Whether any tensor but the pool's holds `buf`'s memory: every tensor on a storage (each
    view handed out, each view of those) counts once, as does the storage object asked here.
    FSDP keeps tensors, never bare storages, of what it allocates."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2


class _HostComm:
    """The shared HostGroup of each process group handed to `__call__` (all-gather and
    reduce-scatter share one file), held here, and the buffers FSDP allocates, reused."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.groups: dict[str, HostGroup] = {}
        self.calls = 0  # served through shared memory (tests: no silent fallback)
        self.pool: dict[tuple, list[torch.Tensor]] = {}

    def host_group(self, group) -> HostGroup:
        key = group.group_name
        if key not in self.groups:
            self.groups[key] = shared_group(group, "fsdp comm", self.max_bytes)
        return self.groups[key]

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer nothing else holds, as a new view (the pool keeps the base only, so every
        user is seen by `_held`)."""
        size = tuple(int(s) for s in size)
        key = (math.prod(size), dtype, device)
        bufs = self.pool.setdefault(key, [])
        buf = next((b for b in bufs if not _held(b)), None)
        if buf is None:  # the pool grows to the most FSDP holds at once (two or three)
            buf = torch.empty(key[0], dtype=dtype, device=device)
            bufs.append(buf)
        return buf.view(size)

    def trim(self) -> None:
        """Drop the pool (what FSDP still holds lives on with its holder): its buffers are as
        big as the unsharded units, and no memory should stay behind between steps."""
        self.pool.clear()


class GatherRegions:
    """Two regions of a shared file that every rank maps, handed out as FSDP's all-gather outputs
    (`take`), so that the gathered unit is there once every rank's copy-in has written its shard:
    one barrier, no copy. FSDP reads an output (its copy-out) after the collective returns and,
    in forward, holds it until the next unit's copy-out (torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py: wait_for_unshard defers the free in `all_gather_state`), so a region
    is handed out again only when no rank holds anything of it: each `take` asks every rank
    which regions it still holds and hands out the first one free on all, else None (the
    caller then uses a private buffer and the copying path). The answers go through the file:
    each rank writes its flags, all wait at the barrier, all read the same flags, so every rank
    decides alike. Collective: every rank of the group calls `take` at the same point."""

    def __init__(self, group, max_bytes: int = MAX_BYTES):
        self.group, self.max_bytes = group, max_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # two sets of a flag byte per rank and region, at the end: take n writes and reads set
        # n % 2, which take n + 2 writes again only after every rank has left take n + 1's
        # barrier, so after every rank has read take n's (one set: a rank that left the
        # barrier first could write its next flags before a slower one read these)
        self.ctrl = padded(4 * self.world)
        self.file: SharedFile | None = None
        self.regions: list[torch.Tensor] = []
        self._flags = None
        self.usable = True
        self.turns = 0  # takes that reached the flags (every rank alike)
        self.taken = 0  # outputs handed out in a region (tests)
        self.used = False  # since the last `idle` call

    def take(self, size: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = math.prod(size) * dtype.itemsize
        region = padded(nbytes)
        if not self.usable or 2 * region + self.ctrl > self.max_bytes:
            return None  # the same sizes on every rank: every rank returns here alike
        if self.file is None or self.file.size < 2 * region + self.ctrl:
            # a new file: an output still held in the old one keeps its mapping alive (a view
            # holds the map), and nothing writes there again
            self.regions, self._flags, self.file = [], None, None
            try:
                self.file = SharedFile(2 * region + self.ctrl, 1, self.group, "fsdp gather")
            except RuntimeError as e:  # every rank fails alike (SharedFile agrees on errors)
                logger.warning("fsdp gather: all-gathers copy through the comm file: %s", e)
                self.usable = False
                return None
            # a storage of its own per region, so that `_held` sees only views of that region
            self.regions = [torch.frombuffer(self.file._map, dtype=torch.uint8, count=region,
                                             offset=i * region) for i in range(2)]
            self._flags = torch.frombuffer(self.file._map, dtype=torch.uint8, count=4 * self.world,
                                           offset=2 * region).view(2, self.world, 2)
        flags = self._flags[self.turns % 2]
        self.turns += 1
        flags[self.rank] = torch.tensor([not _held(r) for r in self.regions], dtype=torch.uint8)
        self.file.collective()
        free = flags.all(0).tolist()
        if not any(free):
            return None
        self.taken += 1
        self.used = True
        return self.regions[free.index(True)][:nbytes].view(dtype).view(size)

    def holds(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Whether `output` is a region as `take` handed it out and `input` this rank's chunk
        of it (what FSDP's copy-in passes: torch.ops.fsdp.all_gather_copy_in narrows it)."""
        if not any(output.data_ptr() == r.data_ptr() for r in self.regions):
            return False
        chunk = input.numel() * input.element_size()
        return (output.is_contiguous() and input.is_contiguous() and input.dtype == output.dtype
                and output.numel() == input.numel() * self.world
                and input.data_ptr() == output.data_ptr() + self.rank * chunk)

    def idle(self) -> bool:
        """True when nothing was taken since the last call (a frozen model's file: it gathered
        once and can go)."""
        idle, self.used = not self.used, False
        return idle


class HostAllGather(_HostComm):
    """Outputs in a `GatherRegions` once the group is known (the first call tells it), else from
    the pool; inputs published through the group's comm file when the output is not a region."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        super().__init__(max_bytes)
        self.region: GatherRegions | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        size = tuple(int(s) for s in size)
        if len(self.groups) == 1 and device.type == "cpu":
            host = next(iter(self.groups.values()))
            if host.usable and host.world > 1:
                if self.region is None:
                    self.region = GatherRegions(host.group, self.max_bytes)
                out = self.region.take(size, dtype)
                if out is not None:
                    return out
        return super().allocate(size, dtype=dtype, device=device)

    def trim(self) -> None:
        super().trim()
        # decided by counts alone, which every rank shares (a rank that dropped its regions
        # while another kept them would meet it at a different barrier); an output still held
        # keeps the old file's mapping alive. Regions whose file could not be made stay, so
        # that it is not tried (and warned about) again every step.
        if self.region is not None and self.region.usable and self.region.idle():
            self.region = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        region = self.region
        if region is not None and region.holds(output_tensor, input_tensor):
            region.file.collective()  # every rank's shard is in: the output is complete
            self.calls += 1
            return None
        if region is not None and any(_within(output_tensor, r) for r in region.regions):
            # a region taken for another all-gather (of another group, or out of the order
            # FSDP keeps): every rank would write the whole unit into the same shared bytes
            raise RuntimeError("fsdp comm: an all-gather output in a shared region that is not "
                               "this call's (FSDP allocated in an order host_comm does not know)")
        host = self.host_group(group)
        slots = host.publish(input_tensor) if output_tensor.is_contiguous() else None
        if slots is None:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        as_bytes(output_tensor).copy_(slots.reshape(-1))
        host.release()
        self.calls += 1
        return None  # done already (FSDP waits only on a returned Work)


class HostReduceScatter(_HostComm):
    """FSDP allocates the input, then the output, then calls (torch/distributed/fsdp/
    _fully_shard/_fsdp_collectives.py: foreach_reduce). The input is this rank's slot of the
    group's file once the group is known (from the first call): published as it is written."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        super().__init__(max_bytes)
        self._input_next = True
        self.in_slot = 0  # inputs handed out as this rank's slot (tests)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        is_input, self._input_next = self._input_next, not self._input_next
        if is_input and len(self.groups) == 1 and device.type == "cpu":
            host = next(iter(self.groups.values()))
            nbytes = math.prod(int(s) for s in size) * dtype.itemsize
            slots = host.slots(nbytes)  # collective growth: every rank allocates alike
            if slots is not None:
                self.in_slot += 1
                return slots[host.rank].view(dtype).view(*size)
        # the output (the sharded gradients, held to the optimizer step) and the first input
        # (before the group is known): not pooled
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        self._input_next = True
        host = self.host_group(group)
        if host.file is not None and _within(output_tensor, host.file.buffer):
            # the output is read after the next collectives have written the file over
            raise RuntimeError("fsdp comm: a reduce-scatter output in the shared file (FSDP "
                               "allocated in an order host_comm does not know)")
        usable = op == dist.ReduceOp.SUM and output_tensor.is_contiguous()
        slots = host.publish(input_tensor) if usable else None
        if slots is None:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        chunks = slots.view(input_tensor.dtype).view(host.world, host.world, -1)[:, host.rank]
        out = output_tensor.view(-1)
        if host.world == 1:
            out.copy_(chunks[0])
        else:
            torch.add(chunks[0], chunks[1], out=out)  # one pass for the first two
        for r in range(2, host.world):  # rank order: the same sum whatever the rank
            out.add_(chunks[r])
        host.release()
        self.calls += 1
        return None


def install(model: torch.nn.Module, max_bytes: int = MAX_BYTES) -> None:
    """Route the all-gathers and reduce-scatters of every FSDP unit of `model` through shared
    memory (one file per set of ranks, shared with the other models on them; made at the first
    collective)."""
    gather, scatter = HostAllGather(max_bytes), HostReduceScatter(max_bytes)
    for unit in fsdp_units(model):
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)
    model._rl2_host_comms = (gather, scatter)  # for `served` (tests)


def trim(model: torch.nn.Module) -> None:
    """Free the buffers pooled for `model`'s collectives (after a step or a no-grad pass)."""
    for comm in getattr(model, "_rl2_host_comms", ()):
        comm.trim()


def served(model: torch.nn.Module) -> int:
    """Collectives of `model`'s FSDP units served through shared memory so far (this rank)."""
    return sum(c.calls for c in getattr(model, "_rl2_host_comms", ()))
