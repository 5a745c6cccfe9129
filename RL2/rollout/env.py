"""Loading user environments (a Python script given by path) and calling them safely.

An environment script defines (see "Environment contract" in the README):

    [async] def step(state: str, action: str, extra_info: dict) -> dict   # required
        # -> {"next_state": str | None, "reward": float, "done": bool,
        #     "score": float (optional, defaults to reward),
        #     "extra_info": dict (optional, defaults to the input extra_info)}
    [async] def reset(extra_info: dict) -> str | (str, dict)    # optional: initial state when a
                                                                # prompt row has none
    [async] def close(extra_info: dict) -> None                 # optional: called once when a
                                                                # trajectory ends (even on failure)
    def configure(**env_args) -> None                           # optional: called once at load

`env_args` (config `actor.rollout.env_args`) reach the script in two ways: `configure(**env_args)`
is called once at load time if the script defines it, and every trajectory's `extra_info` starts
as `{**env_args, **row_extra_info, "uid": uid}` (values in the prompt row win).

Where hooks run and how timeouts (`timeout` seconds, None or <= 0 disables) fire:
- sync hooks run, with `workers > 0` (config `actor.rollout.env_workers`), in a small pool of
  worker processes (RL2/rollout/env_workers.py): on timeout the worker is killed and replaced, so
  CPU-bound or GIL-holding code cannot stall the rollout. Arguments and results must pickle; the
  calls of one trajectory go to the same worker. With `workers=0` they run in-process in a daemon
  thread per call; a timed-out thread is ABANDONED and keeps running (and holding the GIL).
- async hooks run on the caller's event loop under `asyncio.timeout`. They must not block the
  loop (use `asyncio.to_thread` for blocking work): a watchdog thread logs which call blocks the
  loop for longer than the timeout, and such a call fails with EnvTimeout when it returns; one
  that blocks it past 2 x the timeout + 30 s stops the run (`LoopWatchdog`).
Any exception from user code, BaseException included (SystemExit, ...), is an EnvError that fails
the trajectory; only KeyboardInterrupt and cancellation propagate. The in-process import and
configure() at load have the workers' start-up bound (`_LoadDeadline`).
"""
import asyncio
import contextvars
import hashlib
import importlib.util
import inspect
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from RL2.rollout.env_workers import EnvWorkerPool, WorkerError, startup_bound

logger = logging.getLogger(__name__)


class EnvError(RuntimeError):
    """An environment misbehaved: bad script, malformed result, exception or timeout."""


class EnvTimeout(EnvError):
    """An environment hook did not return within the configured timeout."""


def _is_async(fn: Callable) -> bool:
    # inspect sees through functools.partial; callable objects expose an async __call__.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _run_sync_in_daemon_thread(fn: Callable, *args) -> Any:
    """Run a blocking call in its own daemon thread; the returned awaitable can be cancelled
    (e.g. by a timeout) while the thread keeps running and its result is discarded."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    ctx = contextvars.copy_context()

    def deliver(result, exc):
        if fut.done():  # cancelled by a timeout: nobody waits for this result any more
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def target():
        try:
            result, exc = ctx.run(fn, *args), None
        except Exception as e:  # delivered to the awaiting coroutine, not lost in the thread
            result, exc = None, e
        except BaseException as e:  # sys.exit() in a user step must not stop the rollout
            result, exc = None, EnvError(f"{getattr(fn, '__name__', 'env call')} raised {type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(deliver, result, exc)
        except RuntimeError:  # the loop was closed while this abandoned call was running
            pass

    threading.Thread(target=target, daemon=True, name=f"rl2-env-{getattr(fn, '__name__', 'call')}").start()
    return await fut


async def _guarded(awaitable, name: str) -> Any:
    """Await user code; SystemExit & co. become an EnvError here, inside the task, because an
    asyncio Task re-raises SystemExit out of the event loop (ending the whole run)."""
    try:
        return await awaitable
    except (Exception, asyncio.CancelledError, KeyboardInterrupt):
        raise
    except BaseException as e:
        raise EnvError(f"{name} raised {type(e).__name__}: {e}") from None


def _interrupt_main() -> None:
    # a real signal (not _thread.interrupt_main) ends a blocking sleep or socket wait
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _exit_now(message: str) -> None:
    """The last resort of a watchdog whose interrupts went unanswered: log, flush, exit 1."""
    logger.critical(message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


class LoopWatchdog:
    """A daemon thread that notices when the event loop stops ticking for longer than
    `threshold` seconds while one of the env tasks in `tasks` is running on it, and logs which.
    A call that never gives the loop back would hang the run: past `abort_after` seconds
    (default 2 x threshold + 30) it sends SIGINT to the main thread (KeyboardInterrupt there,
    which also ends a blocking sleep; the trainer's cleanup runs), and `grace` seconds later, if
    the process is still here, exits it with status 1."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold: float, abort_after: float | None = None,
                 grace: float = 30.0):
        self.loop, self.threshold, self.grace = loop, threshold, grace
        self.abort_after = 2 * threshold + 30 if abort_after is None else abort_after
        self.interrupted_at = self.signalled_at = None
        self.tasks: set = set()
        self.blocked: dict = {}  # task -> longest stall seen while it ran
        self.last = time.monotonic()
        loop.call_soon(self._tick)
        threading.Thread(target=self._watch, daemon=True, name="rl2-loop-watchdog").start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def _tick(self) -> None:
        self.last = time.monotonic()
        if not self.loop.is_closed():
            self.loop.call_later(min(0.05, self.threshold / 4), self._tick)

    def _watch(self) -> None:
        while not self.loop.is_closed():
            time.sleep(min(0.1, self.threshold / 4))
            stalled = time.monotonic() - self.last
            if stalled <= self.threshold:
                continue
            task = asyncio.current_task(self.loop)  # a dict read; safe from another thread
            if task is None or task not in self.tasks:
                continue
            if task not in self.blocked:
                logger.error("event loop blocked for more than %.1fs by %s", self.threshold, task.get_name())
            self.blocked[task] = stalled
            if stalled > self.abort_after:
                self._abort(task, stalled)

    def _abort(self, task, stalled: float) -> None:
        now = time.monotonic()
        if self.interrupted_at is None:
            self.interrupted_at = self.signalled_at = now
            logger.critical("stopping the run: %s has blocked the event loop for %.0fs (async env "
                            "hooks must not block; use asyncio.to_thread)", task.get_name(), stalled)
        elif now - self.interrupted_at > self.grace:
            _exit_now(f"{task.get_name()} still blocks the event loop; exiting")
        elif now - self.signalled_at < 1.0:
            return
        self.signalled_at = now
        # once a second, since asyncio.run's own SIGINT handler raises KeyboardInterrupt only at
        # the second
        _interrupt_main()

    def release(self, task) -> float:
        self.tasks.discard(task)
        return self.blocked.pop(task, 0.0)


class Env:
    """A loaded environment script. Use `load_env` to build one."""

    def __init__(self, module, path: str, env_args: dict | None = None, timeout: float | None = 60.0,
                 workers: int = 0):
        self.module = module
        self.path = path
        self.env_args = dict(env_args or {})
        self.timeout = timeout if timeout and timeout > 0 else None
        self._step = module.step
        self._reset = getattr(module, "reset", None)
        self._close = getattr(module, "close", None)
        self.pool = None
        hooks = [f for f in (self._step, self._reset, self._close) if f is not None]
        stateful = self.has_reset or self._close is not None  # per-trajectory state in the module
        mixed = len({_is_async(f) for f in hooks}) > 1
        if workers > 0 and mixed and stateful:
            # async hooks run here, sync ones in a worker: they would see two copies of the state
            logger.warning("env %s mixes async and sync hooks with reset/close: its sync hooks run "
                           "in-process threads (not in env worker processes)", path)
        elif workers > 0 and not all(_is_async(f) for f in hooks):
            self.pool = EnvWorkerPool(str(Path(path).resolve()), self.env_args, workers, stateful=stateful)
        self._watchdog = None

    @property
    def has_reset(self) -> bool:
        return self._reset is not None

    def initial_extra_info(self, row_extra_info: dict | None, uid: str) -> dict:
        """The extra_info a trajectory starts with: env_args defaults, row values, then the uid."""
        return {**self.env_args, **(row_extra_info or {}), "uid": uid}

    async def _call(self, name: str, fn: Callable, *args, limit: int | None = None) -> Any:
        uid = args[-1].get("uid") if args and isinstance(args[-1], dict) else None
        if not _is_async(fn) and self.pool is not None:
            return await self._call_in_worker(name, args, uid, limit)
        if _is_async(fn):
            call = self._call_async(name, fn, args, uid)
        else:
            call = _run_sync_in_daemon_thread(fn, *args)
        deadline = asyncio.timeout(self.timeout)
        try:
            async with deadline:
                out = await call
                if inspect.isawaitable(out):  # a sync wrapper that returned a coroutine
                    out = await _guarded(out, name)
            return out
        except TimeoutError:
            if not deadline.expired():  # the env's own TimeoutError: an ordinary failure
                raise
            kind = "async" if _is_async(fn) else "sync (its thread is abandoned and keeps running)"
            raise EnvTimeout(f"{name}() of env {self.path} timed out after {self.timeout}s [{kind}]") from None

    async def _call_async(self, name: str, fn: Callable, args: tuple, uid) -> Any:
        """Run an async hook as its own named task, so that the loop watchdog can say which call
        blocks the loop; a call that blocked it past the timeout fails when it returns."""
        label = f"{name}() of env {self.path} (uid {uid})"
        if self.timeout is not None:
            if self._watchdog is None or self._watchdog.loop is not asyncio.get_running_loop():
                self._watchdog = LoopWatchdog(asyncio.get_running_loop(), self.timeout)
            self._watchdog.beat()
        task = asyncio.ensure_future(_guarded(fn(*args), name))
        task.set_name(label)
        watchdog = self._watchdog if self.timeout is not None else None
        if watchdog is not None:
            watchdog.tasks.add(task)
        try:
            out = await task
        finally:
            task.cancel()
            blocked = watchdog.release(task) if watchdog is not None else 0.0
        if blocked:
            raise EnvTimeout(f"{label} blocked the event loop for {blocked:.1f}s (timeout "
                             f"{self.timeout}s); async hooks must not block (use asyncio.to_thread)")
        return out

    async def _call_in_worker(self, name: str, args: tuple, uid, limit) -> Any:
        try:
            answer = await self.pool.call(name, args, self.timeout, uid=uid, limit=limit)
        except TimeoutError:
            raise EnvTimeout(f"{name}() of env {self.path} timed out after {self.timeout}s "
                             f"[sync; its worker process was killed and replaced]") from None
        except WorkerError as e:
            raise EnvError(f"{name}() of env {self.path}: {e}") from None
        if answer[0] == "ok":
            return answer[1]
        raise EnvError(f"{answer[1]}: {answer[2]}")

    async def reset(self, extra_info: dict) -> tuple[str, dict]:
        """Initial state (and extra_info) of a trajectory whose prompt row has no prompt."""
        if self._reset is None:
            raise EnvError(f"env {self.path} defines no reset(), but a prompt row has no prompt")
        out = await self._call("reset", self._reset, extra_info)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out, extra_info = out
        if not isinstance(out, str):
            raise EnvError(f"reset() of env {self.path} must return a str (or (str, dict)), "
                           f"got {type(out).__name__}")
        return out, extra_info

    async def step(self, state: str, action: str, extra_info: dict, max_new_chars: int | None = None) -> dict:
        """Call the script's step and return a validated dict with all five keys. With
        `max_new_chars`, next_state is cut to len(state) + len(action) + max_new_chars characters
        (in the worker, before it is sent back), so memory stays bounded whatever step returns."""
        out = await self._call("step", self._step, state, action, extra_info, limit=max_new_chars)
        out = self._validate(out, extra_info)
        if max_new_chars is not None and out["next_state"] is not None:
            out["next_state"] = out["next_state"][:len(state) + len(action) + max_new_chars]
        return out

    async def close(self, extra_info: dict) -> None:
        """Call the optional close hook; failures are logged, never raised."""
        try:
            if self._close is not None:
                await self._call("close", self._close, extra_info)
        except Exception as e:
            logger.warning("close() of env %s failed: %s", self.path, e)
        finally:
            if self.pool is not None:
                self.pool.release(extra_info.get("uid"))

    def start(self) -> None:
        """Start the env worker processes now (each imports the script)."""
        if self.pool is not None:
            self.pool.start()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _validate(self, out: Any, extra_info: dict) -> dict:
        where = f"step() of env {self.path}"
        if not isinstance(out, dict):
            raise EnvError(f"{where} must return a dict, got {type(out).__name__}")
        for key in ("next_state", "reward", "done"):
            if key not in out:
                raise EnvError(f"{where} returned no '{key}' (keys: {sorted(out)})")
        next_state, done = out["next_state"], out["done"]
        if next_state is not None and not isinstance(next_state, str):
            raise EnvError(f"{where}: 'next_state' must be a str or None, got {type(next_state).__name__}")
        # numpy.bool_ is common in envs built on numpy; anything else (ints, strings) is a bug.
        if not (isinstance(done, bool) or (type(done).__module__ == "numpy" and "bool" in type(done).__name__)):
            raise EnvError(f"{where}: 'done' must be a bool, got {type(done).__name__}")
        done = bool(done)
        if next_state is None and not done:
            raise EnvError(f"{where}: 'next_state' is None but 'done' is False")
        reward = self._number(out["reward"], "reward", where)
        score = self._number(out["score"], "score", where) if out.get("score") is not None else reward
        new_info = out.get("extra_info")
        if new_info is None:
            new_info = extra_info
        elif not isinstance(new_info, dict):
            raise EnvError(f"{where}: 'extra_info' must be a dict, got {type(new_info).__name__}")
        return {"next_state": next_state, "reward": reward, "done": done, "score": score,
                "extra_info": new_info}

    @staticmethod
    def _number(value: Any, key: str, where: str) -> float:
        # bool is an int subclass and "1.0" parses as a float: both are bugs in the env, not numbers
        if isinstance(value, (bool, str, bytes)) or "bool" in type(value).__name__:
            raise EnvError(f"{where}: '{key}' must be a number, got {type(value).__name__} {value!r}")
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise EnvError(f"{where}: '{key}' must be a number, got {value!r}") from None
        if not math.isfinite(x):  # a NaN/inf reward would silently poison every advantage
            raise EnvError(f"{where}: '{key}' must be finite, got {x}")
        return x


def _import_script(path: Path):
    # A unique module name per resolved path, registered in sys.modules so that dataclasses,
    # pickling and relative imports inside the script behave as for a normal module.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"rl2_env_{path.stem}_{digest}"  # re-imported on every load: no stale module state
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise EnvError(f"env_path {path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, (Exception, SystemExit)):  # sys.exit or argparse at import would end the run silently
            raise EnvError(f"importing env_path {path} failed: {type(e).__name__}: {e}") from e
        raise
    return module


class _LoadDeadline:
    """Bounds the in-process import and configure() of an env script, as the env workers'
    STARTUP_TIMEOUT bounds theirs: a script that sleeps or waits on a dead server at import
    would otherwise hang start-up. Past `limit` seconds a daemon thread sends SIGINT to the main
    thread once a second (a real signal ends a blocking sleep or socket wait; the
    KeyboardInterrupt becomes an EnvError), and `grace` seconds later, if the call still has
    not returned (C code that never checks for signals), exits the process with status 1.
    Off the main thread nothing can interrupt the call: there it only logs."""

    grace = 30.0

    def __init__(self, limit: float, what: str):
        self.limit, self.what = limit, what
        self.fired = False
        self._done = threading.Event()

    def _watch(self) -> None:
        if self._done.wait(self.limit):
            return
        self.fired = True
        logger.critical("%s has not finished after %gs; interrupting it", self.what, self.limit)
        start = time.monotonic()
        while not self._done.is_set():
            _interrupt_main()
            if self._done.wait(1.0):
                return
            if time.monotonic() - start > self.grace:
                _exit_now(f"{self.what} still has not returned; exiting")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            threading.Thread(target=self._watch, daemon=True, name="rl2-env-load-deadline").start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._done.set()
        if self.fired and exc_type is KeyboardInterrupt:
            raise EnvError(f"{self.what} did not finish within {self.limit:g}s (the start-up "
                           "bound of an env script's import and configure)") from None
        return False


def load_env(env_path: str, env_args: dict | None = None, timeout: float | None = 60.0,
             workers: int = 0) -> Env:
    """Import the environment script at `env_path` and check its hooks (at start-up, so that a
    bad path fails before any model is loaded). `timeout` (seconds, None/<=0 disables) bounds
    every reset/step/close call; `workers` > 0 runs sync hooks in that many worker processes."""
    if not env_path:
        raise EnvError("no env_path given: set actor.rollout.env_path to an environment script")
    path = Path(env_path).expanduser().resolve()
    if not path.is_file():
        raise EnvError(f"env_path {env_path} does not exist (resolved to {path})")
    limit = startup_bound(timeout)  # the env workers' own start-up bound
    with _LoadDeadline(limit, f"importing env_path {env_path}"):
        module = _import_script(path)
    step = getattr(module, "step", None)
    if step is None:
        raise EnvError(f"env_path {env_path} defines no step(state, action, extra_info) function")
    for hook in ("step", "reset", "close", "configure"):
        fn = getattr(module, hook, None)
        if fn is not None and not callable(fn):
            raise EnvError(f"env_path {env_path}: '{hook}' must be callable, got {type(fn).__name__}")
    env_args = dict(env_args or {})
    configure = getattr(module, "configure", None)
    if configure is not None:
        try:
            with _LoadDeadline(limit, f"configure(**env_args) of env {env_path}"):
                configure(**env_args)
        except EnvError:
            raise
        except (Exception, SystemExit) as e:
            raise EnvError(f"configure(**env_args) of env {env_path} failed: {type(e).__name__}: {e}") from e
    env = Env(module, str(env_path), env_args, timeout, workers)
    logger.info("Loaded env %s (step: %s, reset: %s, timeout: %s, worker processes: %s)", env_path,
                "async" if _is_async(step) else "sync", env.has_reset, env.timeout,
                env.pool.size if env.pool else 0)
    return env


__all__ = ["Env", "EnvError", "EnvTimeout", "load_env"]
