"""A small pool of worker processes that run synchronous environment hooks, so that a timeout is
real: a call that does not return in time has its process killed (SIGKILL) and replaced. CPU-bound
or GIL-holding code (sympy on a huge power, a `while True`) can then neither freeze the trainer's
event loop nor slow down the other trajectories.

Each worker is `python -m RL2.rollout.env_workers ENV_PATH` (a plain subprocess: it imports only
the env script, not the trainer), configured once with `configure(**env_args)`, then serves calls
one at a time over a pipe: `(hook, args, limit)` -> `("ok", result) | ("err", type, message)`,
each message a length-prefixed pickle. The worker writes to a duplicate of its stdout; its own
stdout is pointed at stderr, so a `print` in user code cannot corrupt the protocol. A worker exits
when the trainer dies (parent-death signal on Linux, and EOF on its pipe).

Calls of one trajectory (same `extra_info["uid"]`) go to the same worker while it lives, so
per-trajectory state kept in module globals (e.g. envs/gem_env.py) keeps working. The timeout
counts from the moment a worker starts the call, not the wait for a free worker.
"""
import asyncio
import inspect
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from RL2.utils.process import die_with_parent

_HEADER = struct.Struct("<Q")
# Pickled results above this size are refused in the worker (an env returning gigabytes would
# otherwise grow the trainer until the kernel kills it).
MAX_RESULT_BYTES = 64 * 2**20
STARTUP_TIMEOUT = 120.0  # seconds for a new worker to import the env script and configure it


def startup_bound(timeout: float | None) -> float:
    """Seconds an env script's import + configure may take: a slow import (sympy) must not eat
    the first call's timeout, nor a long env timeout be cut short by the start-up one."""
    return max(STARTUP_TIMEOUT, timeout or 0)


class WorkerError(RuntimeError):
    """A worker died or answered garbage (not the user code's own exception)."""


# ----------------------------------------------------------------------------- worker side
def _cap_result(out, args, limit):
    """Cut next_state to len(state) + len(action) + limit characters before it is pickled."""
    if limit is not None and isinstance(out, dict) and isinstance(out.get("next_state"), str) and len(args) >= 2:
        cap = len(args[0]) + len(args[1]) + limit
        if len(out["next_state"]) > cap:
            out = {**out, "next_state": out["next_state"][:cap]}
    return out


async def _await(awaitable):
    return await awaitable


def _serve(path: str) -> None:
    from RL2.rollout.env import _import_script

    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # user prints go to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nor can user code read requests meant for the worker
    try:
        module, error = _import_script(Path(path).resolve()), None
    except BaseException as e:  # reported on the first call, which is always configure
        module, error = None, ("err", type(e).__name__, str(e))

    def send(data: bytes):
        if len(data) > MAX_RESULT_BYTES:
            data = pickle.dumps(("err", "EnvError", f"result of {len(data)} bytes exceeds the "
                                 f"{MAX_RESULT_BYTES}-byte limit of one env call"))
        proto_out.write(_HEADER.pack(len(data)) + data)
        proto_out.flush()

    while True:
        header = proto_in.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return  # the trainer closed the pipe (or died)
        hook, args, limit = pickle.loads(proto_in.read(_HEADER.unpack(header)[0]))
        if error is not None:
            send(pickle.dumps(error))
            continue
        try:
            if hook == "configure":
                out = module.configure(**args[0]) if hasattr(module, "configure") else None
            else:
                out = getattr(module, hook)(*args)
                if inspect.isawaitable(out):  # a sync wrapper that returned a coroutine
                    out = asyncio.run(_await(out))
            data = pickle.dumps(("ok", _cap_result(out, args, limit)), protocol=pickle.HIGHEST_PROTOCOL)
        except KeyboardInterrupt:
            return  # Ctrl-C reaches the whole process group: stop with the trainer
        except BaseException as e:  # incl. SystemExit and unpicklable results: a failed call
            data = pickle.dumps(("err", type(e).__name__, str(e)))
        send(data)


# ----------------------------------------------------------------------------- trainer side
def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise WorkerError("an env worker exited while answering")
        data += chunk
    return data


class _Worker:
    def __init__(self, path: str, env_args: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "RL2.rollout.env_workers", path], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.env_args = env_args
        self.configured = False

    def write(self, hook, args, limit):
        data = pickle.dumps((hook, args, limit), protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()

    async def read(self):
        """The next answer, read without blocking the event loop."""
        loop = asyncio.get_running_loop()
        fd = self.proc.stdout.fileno()
        buf, need = bytearray(), None
        ready = asyncio.Event()
        loop.add_reader(fd, ready.set)
        try:
            while need is None or len(buf) < need:
                await ready.wait()
                ready.clear()
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise WorkerError(f"env worker {self.proc.pid} exited (code {self.proc.poll()})")
                buf += chunk
                if need is None and len(buf) >= _HEADER.size:
                    need = _HEADER.size + _HEADER.unpack(bytes(buf[:_HEADER.size]))[0]
        finally:
            loop.remove_reader(fd)
        return pickle.loads(bytes(buf[_HEADER.size:need]))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class EnvWorkerPool:
    """`size` worker processes for the sync hooks of one env script, created lazily."""

    def __init__(self, path: str, env_args: dict, size: int, stateful: bool = False):
        self.path, self.env_args, self.size = path, dict(env_args), max(1, int(size))
        self.stateful = stateful    # per-trajectory state lives in the worker (reset/close hooks)
        self.lost: set = set()      # uids whose worker was killed while they were alive
        self.workers: list[_Worker | None] = [None] * self.size
        self.replaced = 0           # workers killed after a timeout (or found dead)
        self.pins: dict = {}        # uid -> slot: a trajectory's calls go to one worker
        self.waiting = [0] * self.size
        self._locks: list[asyncio.Lock] = []
        self._loop = None

    def start(self) -> None:
        """Start every worker and wait until each has imported and configured the env script
        (at load time: a script that fails in a worker stops the run before any model loads)."""
        import select

        for i in range(self.size):
            if self.workers[i] is None:
                self.workers[i] = _Worker(self.path, self.env_args)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for w in self.workers:
            if w.configured:
                continue
            w.write("configure", (w.env_args,), None)
            fd = w.proc.stdout.fileno()
            header = b""
            while len(header) < _HEADER.size:
                if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    self.close()
                    raise WorkerError(f"env workers did not import {self.path} within {STARTUP_TIMEOUT}s")
                chunk = os.read(fd, _HEADER.size - len(header))
                if not chunk:
                    self.close()
                    raise WorkerError(f"an env worker for {self.path} exited at start-up")
                header += chunk
            answer = pickle.loads(_read_exactly(fd, _HEADER.unpack(header)[0]))
            if answer[0] != "ok":
                self.close()
                raise WorkerError(f"importing or configuring env {self.path} failed in an env worker: "
                                  f"{answer[1]}: {answer[2]}")
            w.configured = True

    def _slots(self) -> list[asyncio.Lock]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # asyncio locks belong to one loop (tests use several)
            self._loop, self._locks = loop, [asyncio.Lock() for _ in range(self.size)]
        return self._locks

    def _assign(self, uid) -> int:
        """The slot of a trajectory: where its earlier calls ran, else the least loaded."""
        if uid is not None and uid in self.pins:
            return self.pins[uid]
        locks = self._slots()
        i = min(range(self.size), key=lambda j: (self.waiting[j] + locks[j].locked(),
                                                  self.workers[j] is None or not self.workers[j].configured))
        if uid is not None:
            self.pins[uid] = i
        return i

    async def call(self, hook: str, args: tuple, timeout: float | None, uid=None, limit=None):
        """Run `hook(*args)` in a worker. Returns ("ok", result) or ("err", type, message);
        raises TimeoutError after killing the worker, WorkerError if it died (or, for a stateful
        env, if the worker holding this trajectory's state was replaced)."""
        if uid is not None and uid in self.lost:
            raise WorkerError("the env worker holding this trajectory's state was killed after "
                              "another call timed out; its state is lost")
        i, worker = await self._acquire(uid)
        try:
            if not worker.configured:  # import + configure(**env_args), once per worker
                async with asyncio.timeout(startup_bound(timeout)):
                    worker.write("configure", (worker.env_args,), None)
                    answer = await worker.read()
                if answer[0] != "ok":
                    raise WorkerError(f"importing or configuring env {self.path} failed in an env "
                                      f"worker: {answer[1]}: {answer[2]}")
                worker.configured = True
            async with asyncio.timeout(timeout):
                worker.write(hook, args, limit)
                return await worker.read()
        except BaseException as e:
            self._replace(i, worker, uid)  # timed out, cancelled or died: the process is unusable
            if isinstance(e, OSError) and not isinstance(e, TimeoutError):  # a broken pipe
                raise WorkerError(f"env worker {worker.proc.pid} died: {e}") from None
            raise
        finally:
            self._slots()[i].release()

    async def _acquire(self, uid) -> tuple[int, "_Worker"]:
        i = self._assign(uid)
        self.waiting[i] += 1
        try:
            await self._slots()[i].acquire()  # FIFO: one call at a time per worker
        finally:
            self.waiting[i] -= 1
        worker = self.workers[i]
        if worker is not None and worker.proc.poll() is not None:  # died between calls
            self._replace(i, worker, None)
        if self.workers[i] is None:
            self.workers[i] = _Worker(self.path, self.env_args)
        return i, self.workers[i]

    def _replace(self, i: int, worker: "_Worker", uid) -> None:
        worker.kill()
        self.replaced += 1
        if self.stateful:
            self.lost |= {u for u, j in self.pins.items() if j == i and u != uid}
        if self.workers[i] is worker:  # start the replacement now: it imports while others run
            self.workers[i] = _Worker(self.path, self.env_args)

    def release(self, uid) -> None:
        """The trajectory ended: unpin it."""
        self.lost.discard(uid)
        self.pins.pop(uid, None)

    def close(self) -> None:
        for i, w in enumerate(self.workers):
            if w is not None:
                w.kill()
                self.workers[i] = None


if __name__ == "__main__":
    die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _serve(sys.argv[1])
