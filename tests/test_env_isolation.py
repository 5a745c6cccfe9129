"""Env calls that misbehave as a hostile user's would (issue 14): CPU-bound or GIL-holding sync
steps run in worker processes killed on timeout; async steps that raise SystemExit or block the
loop; rewards that are not numbers; results that are far too large."""
import asyncio
import importlib.util
import logging
import os
import textwrap
import time
from pathlib import Path

import pytest

from RL2.rollout.env import EnvError, EnvTimeout, load_env

ROOT = Path(__file__).resolve().parents[1]


def write_env(tmp_path, source: str, name: str = "iso_env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def gather(env, calls):
    async def main():
        return await asyncio.gather(*(env.step(*c) for c in calls), return_exceptions=True)
    return asyncio.run(main())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs the math extra")
def test_shipped_math_env_with_adversarial_answers_finishes_within_2x_timeout():
    # Each of these holds the GIL in a sympy bigint power: in a thread nothing can stop them.
    env = load_env(str(ROOT / "envs/math_env.py"), {}, timeout=3, workers=4)
    env.start()  # workers import sympy up front (the trainer does this while loading)
    try:
        actions = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{10^{10^{10}}!}", r"\boxed{42}", r"so \boxed{41}"]
        t0 = time.monotonic()
        outs = gather(env, [("q", a, {"answer": "42", "uid": i}) for i, a in enumerate(actions)])
        assert time.monotonic() - t0 < 6  # 2 x env_timeout
        assert all(isinstance(o, EnvTimeout) and "killed and replaced" in str(o) for o in outs[:2]), outs
        assert [o["reward"] for o in outs[2:]] == [1.0, 0.0]
        # The replacements serve later calls.
        assert gather(env, [("q", r"\boxed{42}", {"answer": "42", "uid": 9})])[0]["reward"] == 1.0
    finally:
        env.shutdown()


CPU_ENV = """
    def step(state, action, extra_info):
        if action == "hang":
            x = 3 ** (2 * 10**7)   # ~10 s of one C call holding the GIL (like sympy on 9^9^9^9)
        return {"next_state": None, "reward": 1.0, "done": True}
"""


def test_cpu_bound_hangs_do_not_affect_healthy_steps(tmp_path):
    # In-process (a thread per call), each hang froze the event loop and every other step for
    # its whole duration, and the healthy steps timed out behind it.
    env = load_env(write_env(tmp_path, CPU_ENV), {}, timeout=2, workers=3)
    env.start()
    try:
        calls = [("s", "hang" if i % 3 == 0 else "ok", {"uid": i}) for i in range(12)]
        outs = gather(env, calls)
        for i, o in enumerate(outs):
            if i % 3 == 0:
                assert isinstance(o, EnvTimeout) and "killed and replaced" in str(o), o
            else:
                assert isinstance(o, dict) and o["reward"] == 1.0, (i, o)
        pids = [w.proc.pid for w in env.pool.workers]
        assert env.pool.replaced == 4 and len(pids) == 3
    finally:
        env.shutdown()
    assert not any(alive(p) for p in pids)


def test_worker_errors_prints_and_exit_are_failed_calls(tmp_path):
    env = load_env(write_env(tmp_path, """
        import sys
        def step(state, action, extra_info):
            print("noise on stdout must not break the protocol")
            if action == "exit":
                sys.exit(3)
            if action == "raise":
                raise KeyError("boom")
            return {"next_state": state + action + "!", "reward": 0.5, "done": False}
    """), {}, timeout=5, workers=1)
    try:
        ok, exit_, err = gather(env, [("s", "a", {"uid": 0}), ("s", "exit", {"uid": 1}), ("s", "raise", {"uid": 2})])
        assert ok["next_state"] == "sa!" and ok["reward"] == 0.5
        assert isinstance(exit_, EnvError) and "SystemExit: 3" in str(exit_)
        assert isinstance(err, EnvError) and "KeyError: 'boom'" in str(err)
        assert env.pool.replaced == 0  # the worker survived all three
    finally:
        env.shutdown()


STATEFUL_ENV = """
    import time
    GAMES = {}
    def reset(extra_info):
        GAMES[extra_info["uid"]] = 0
        return "start"
    def step(state, action, extra_info):
        if action == "hang":
            time.sleep(60)
        GAMES[extra_info["uid"]] += 1
        return {"next_state": state + action, "reward": float(GAMES[extra_info["uid"]]), "done": False}
    def close(extra_info):
        GAMES.pop(extra_info["uid"], None)
"""


def test_stateful_env_keeps_a_trajectory_on_its_worker(tmp_path):
    env = load_env(write_env(tmp_path, STATEFUL_ENV), {}, timeout=1, workers=2)

    async def trajectory(uid, n):
        info = {"uid": uid}
        state, info = await env.reset(info)
        rewards = [(await env.step(state, "a", info))["reward"] for _ in range(n)]
        await env.close(info)
        return rewards

    async def main():
        return await asyncio.gather(*(trajectory(u, 3) for u in range(4)))

    try:
        assert asyncio.run(main()) == [[1.0, 2.0, 3.0]] * 4

    finally:
        env.shutdown()
    env = load_env(write_env(tmp_path, STATEFUL_ENV), {}, timeout=1, workers=1)

    async def lost():  # a hang kills the worker that also holds another trajectory's state
        a, b = {"uid": "a"}, {"uid": "b"}
        await env.reset(a)
        await env.reset(b)
        with pytest.raises(EnvTimeout):
            await env.step("s", "hang", a)
        with pytest.raises(EnvError, match="state is lost"):
            await env.step("s", "x", b)
    try:
        asyncio.run(lost())
    finally:
        env.shutdown()


def test_env_text_is_cut_in_the_worker(tmp_path):
    env = load_env(write_env(tmp_path, """
        def step(state, action, extra_info):
            return {"next_state": state + action + "x" * 10_000_000, "reward": 0.0, "done": False}
    """), {}, timeout=10, workers=1)
    try:
        out = asyncio.run(env.step("st", "ac", {"uid": 0}, max_new_chars=100))
        assert out["next_state"] == "stac" + "x" * 100
    finally:
        env.shutdown()


def test_async_system_exit_is_a_failed_call(tmp_path):
    env = load_env(write_env(tmp_path, """
        import sys
        async def step(state, action, extra_info):
            sys.exit(3)
    """), {}, timeout=5)

    async def main():  # on a Task, SystemExit used to escape the event loop and end the run
        return await asyncio.gather(env.step("s", "a", {"uid": 0}), return_exceptions=True)

    (out,) = asyncio.run(main())
    assert isinstance(out, EnvError) and "step raised SystemExit: 3" in str(out)


def test_async_step_blocking_the_loop_is_reported(tmp_path, caplog):
    env = load_env(write_env(tmp_path, """
        import time
        async def step(state, action, extra_info):
            if action == "block":
                time.sleep(1.5)   # blocks the event loop: a bug in the env
            return {"next_state": None, "reward": 1.0, "done": True}
    """), {}, timeout=0.5)
    with caplog.at_level(logging.ERROR, logger="RL2.rollout.env"):
        ok, blocked = gather(env, [("s", "fine", {"uid": "u1"}), ("s", "block", {"uid": "u2"})])
    assert ok["reward"] == 1.0
    assert isinstance(blocked, EnvTimeout) and "blocked the event loop" in str(blocked)
    assert any("event loop blocked" in r.message and "uid u2" in r.message for r in caplog.records)


@pytest.mark.parametrize("reward", ['"1.0"', "True", "b'1'"])
def test_reward_must_be_a_number(tmp_path, reward):
    env = load_env(write_env(tmp_path, f"""
        def step(state, action, extra_info):
            return {{"next_state": None, "reward": {reward}, "done": True}}
    """), {})
    with pytest.raises(EnvError, match="'reward' must be a number"):
        asyncio.run(env.step("s", "a", {}))


def test_a_worker_that_dies_is_replaced(tmp_path):
    env = load_env(write_env(tmp_path, """
        import os
        def step(state, action, extra_info):
            if action == "die":
                os._exit(1)
            return {"next_state": None, "reward": 1.0, "done": True, "extra_info": {"pid": os.getpid()}}
    """), {}, timeout=10, workers=1)
    try:
        first, died, after = gather(env, [("s", "a", {"uid": 0}), ("s", "die", {"uid": 1}), ("s", "a", {"uid": 2})])
        assert isinstance(died, EnvError) and "exited" in str(died)
        assert after["reward"] == 1.0 and after["extra_info"]["pid"] != first["extra_info"]["pid"]
        assert env.pool.replaced == 1
    finally:
        env.shutdown()


_NEVER_RETURNS = """
import asyncio, logging, signal, sys, time
from RL2.rollout.env import LoopWatchdog
logging.basicConfig(level=logging.INFO)
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
async def step():
    time.sleep(1000)  # blocks the loop and never gives it back
async def main():
    watchdog = LoopWatchdog(asyncio.get_running_loop(), 0.2, abort_after=1.0, grace=5.0)
    task = asyncio.ensure_future(step())
    task.set_name("step() of env e.py (uid u7)")
    watchdog.tasks.add(task)
    await task
asyncio.run(main())
"""


@pytest.mark.parametrize("sigint", ["default", "ignore"])
def test_an_async_step_that_never_returns_stops_the_run_instead_of_hanging_it(tmp_path, sigint):
    """The watchdog only logs while the call may still return; past abort_after it interrupts
    the main thread (a KeyboardInterrupt out of the blocking sleep), and if that does nothing
    (SIGINT ignored) the process exits after the grace period."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(_NEVER_RETURNS)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), sigint], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert time.monotonic() - start < 30
    assert done.returncode != 0
    assert "stopping the run: step() of env e.py (uid u7) has blocked the event loop" in done.stderr
    if sigint == "default":
        assert "KeyboardInterrupt" in done.stderr
    else:
        assert done.returncode == 1 and "still blocks the event loop; exiting" in done.stderr
