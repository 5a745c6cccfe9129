"""Host-local shared memory: a file in /dev/shm mapped by every rank of a group on one host, and
a barrier over named pipes. Used by the weight sync's "shm" transport (RL2/rollout/weight_sync.py)
and by FSDP's CPU collectives (RL2/parallel/host_comm.py)."""
import mmap
import os
import select
import uuid

import torch
import torch.distributed as dist

from RL2.parallel.collectives import gather_objects

SHM_DIR = "/dev/shm"


class PipeBarrier:
    """A barrier for the ranks of one host over named pipes, rank 0 the hub: a pipe round trip
    is several times cheaper than a gloo all_reduce over loopback TCP. The kernel's pipe
    locking orders each rank's shared-memory writes before the barrier ahead of any read after
    it, on any CPU architecture. The pipes are created by rank 0 (`paths`) before construction."""

    TIMEOUT = 1800.0  # seconds, torch's default process-group timeout

    @staticmethod
    def paths(prefix: str, world: int) -> list[str]:
        return [f"{prefix}-up"] + [f"{prefix}-down{r}" for r in range(1, world)]

    def __init__(self, prefix: str, group=None, what: str = "weight sync"):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.what = what
        paths = self.paths(prefix, self.world)
        mine = paths if self.rank == 0 else [paths[0], paths[self.rank]]
        self._fds: list[int] = []
        # O_RDWR: opening never blocks on the other end being open yet (Linux).
        for path in mine:
            self._fds.append(os.open(path, os.O_RDWR))
        self._up, self._down = self._fds[0], self._fds[1:]

    def _read(self, fd: int, n: int) -> None:
        poll = select.poll()  # not select(): it fails for descriptors >= 1024
        poll.register(fd, select.POLLIN)
        got = 0
        while got < n:
            if not poll.poll(self.TIMEOUT * 1000):
                raise TimeoutError(f"{self.what}: rank {self.rank} waited {self.TIMEOUT:.0f} s for "
                                   "the other ranks of this host (did one of them die?)")
            got += len(os.read(fd, n - got))

    def wait(self) -> None:
        if self.world == 1:
            return
        if self.rank == 0:
            self._read(self._up, self.world - 1)
            for fd in self._down:
                os.write(fd, b"x")
        else:
            os.write(self._up, b"x")
            self._read(self._down[0], 1)

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def __del__(self):
        self.close()


class SharedFile:
    """`halves` buffers of `size` bytes in one shared-memory file mapped by every rank of `group`
    (all on one host), and a barrier over pipes. The names are removed as soon as every rank has
    opened them, so nothing is left behind on a crash; a failure on any rank fails every rank
    (no hang). `what` names the user in file names and errors."""

    def __init__(self, size: int, halves: int, group=None, what: str = "weight sync"):
        self.size = size
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [None, None]  # [path, error creating it]
        if rank == 0:
            name = f"rl2-{what.replace(' ', '-')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            box[0] = os.path.join(SHM_DIR, name)
            try:
                with open(box[0], "wb") as f:
                    # pages reserved now: a file only truncated to size on a /dev/shm too small
                    # for it (Docker's default is 64 MB) kills the process with SIGBUS at the
                    # first write past the space left; reserved, it fails here and callers fall back
                    os.posix_fallocate(f.fileno(), 0, halves * size)
                for fifo in PipeBarrier.paths(box[0], world):
                    os.mkfifo(fifo, 0o600)
            except OSError as e:
                box[1] = f"rank 0 could not create {box[0]}: {e}"
        dist.broadcast_object_list(box, group=group, group_src=0)
        path, error = box
        self._barrier, self._map = None, None
        if error is None:
            try:
                with open(path, "r+b") as f:
                    self._map = mmap.mmap(f.fileno(), halves * size)
                self._barrier = PipeBarrier(path, group, what)
            except OSError as e:
                error = f"rank {rank} could not open {path}: {e}"
        # one collective: everyone has opened the names (they can go) and agrees on success
        errors = gather_objects(error, group)
        if rank == 0:
            for name in [path, *PipeBarrier.paths(path, world)]:
                if os.path.exists(name):
                    os.unlink(name)
        failed = [e for e in errors if e]
        if failed:
            if self._barrier is not None:
                self._barrier.close()
            raise RuntimeError(f"{what}: shared-memory setup failed: " + "; ".join(failed))
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, half: int, region) -> torch.Tensor:
        """The typed view of buffer `half` where `region` (weight_layout.Region) lives."""
        start = half * self.size + region.offset
        return self.buffer[start:start + region.nbytes].view(region.dtype).view(region.shape)

    def collective(self) -> None:
        """Every rank of the host reached this point; writes before it are visible after it."""
        self._barrier.wait()
