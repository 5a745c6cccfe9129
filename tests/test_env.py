"""RL2/rollout/env.py: loading env scripts, validating step results, timeouts that really fire."""
import asyncio
import textwrap
import time

import pytest

from RL2.rollout.env import EnvError, EnvTimeout, load_env


def write_env(tmp_path, source: str, name: str = "my_env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- start-up errors
def test_missing_path_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(EnvError, match="nope.py does not exist"):
        load_env(missing, {})


def test_missing_step_names_the_path(tmp_path):
    path = write_env(tmp_path, "def reset(extra_info):\n    return 'x'\n")
    with pytest.raises(EnvError, match=r"my_env.py defines no step"):
        load_env(path, {})


def test_step_not_callable(tmp_path):
    path = write_env(tmp_path, "step = 3\n")
    with pytest.raises(EnvError, match="'step' must be callable"):
        load_env(path, {})


def test_import_error_is_reported_with_path(tmp_path):
    path = write_env(tmp_path, "import not_a_module_xyz\ndef step(s, a, e):\n    pass\n")
    with pytest.raises(EnvError, match="importing env_path .*my_env.py failed: ModuleNotFoundError"):
        load_env(path, {})


@pytest.mark.parametrize("where", ["import", "configure"])
def test_an_env_that_exits_at_load_is_an_error_naming_it(tmp_path, where):
    """sys.exit (an argparse at import, say) is a SystemExit: it ended the run at once, with
    status 0 and no message (found by a hostile-input probe)."""
    source = ("import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n" if where == "import"
              else "import sys\ndef configure(**kw):\n    sys.exit(0)\n")
    path = write_env(tmp_path, source + "def step(s, a, e):\n    pass\n")
    with pytest.raises(EnvError, match=r"my_env.py.* failed: SystemExit"):
        load_env(path, {})


@pytest.mark.parametrize("where", ["import", "configure"])
def test_an_env_that_hangs_at_load_is_an_error_naming_it(tmp_path, monkeypatch, where):
    """A script that sleeps (or waits on a dead server) at import or in configure hung start-up:
    the in-process load had no bound, unlike the env workers' STARTUP_TIMEOUT."""
    from RL2.rollout import env_workers

    monkeypatch.setattr(env_workers, "STARTUP_TIMEOUT", 0.5)
    body = "time.sleep(60)" if where == "import" else "def configure(**kw):\n    time.sleep(60)"
    path = write_env(tmp_path, f"import time\n{body}\ndef step(s, a, e):\n    pass\n")
    start = time.monotonic()
    with pytest.raises(EnvError, match=r"my_env.py did not finish within 0.5s") as info:
        load_env(path, {}, timeout=0.5)
    assert time.monotonic() - start < 10
    assert ("importing" if where == "import" else "configure") in str(info.value)
    # a load that ends in time leaves no interrupt behind for the code that follows it
    monkeypatch.setattr(env_workers, "STARTUP_TIMEOUT", 1.0)
    load_env(write_env(tmp_path, "import time\ntime.sleep(0.2)\ndef step(s, a, e):\n    pass\n"), {})
    time.sleep(1.5)


def test_an_env_that_ignores_the_interrupt_at_load_exits_the_process(tmp_path):
    """Past the grace period, a load that swallows every KeyboardInterrupt ends the process with
    status 1 and a message, instead of hanging it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = write_env(tmp_path, """
        import time
        while True:
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                pass
        def step(s, a, e):
            pass
    """)
    code = ("import logging; logging.basicConfig()\n"
            "from RL2.rollout import env, env_workers\n"
            "env_workers.STARTUP_TIMEOUT = 0.5; env._LoadDeadline.grace = 1.0\n"
            f"env.load_env({path!r}, {{}}, timeout=0.5)\n")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "still has not returned; exiting" in out.stderr


# ---------------------------------------------------------------- env_args, sync/async, reset
ECHO = """
    CONFIG = {}
    def configure(**kw):
        CONFIG.update(kw)
    def step(state, action, extra_info):
        return {"next_state": state + action, "reward": len(action), "done": False,
                "extra_info": {**extra_info, "scale": CONFIG["scale"]}}
    async def reset(extra_info):
        return "start:" + extra_info["level"]
"""


def test_env_args_configure_and_extra_info_defaults(tmp_path):
    env = load_env(write_env(tmp_path, ECHO), {"scale": 3, "level": "easy"})
    assert env.module.CONFIG == {"scale": 3, "level": "easy"}
    info = env.initial_extra_info({"level": "hard"}, uid="u1")  # row values win over env_args
    assert info == {"scale": 3, "level": "hard", "uid": "u1"}
    state, info2 = run(env.reset(info))
    assert state == "start:hard" and info2 is info
    out = run(env.step("s", "abc", info))
    assert out == {"next_state": "sabc", "reward": 3.0, "done": False, "score": 3.0,
                   "extra_info": {**info, "scale": 3}}


def test_async_step_and_defaults(tmp_path):
    path = write_env(tmp_path, """
        async def step(state, action, extra_info):
            return {"next_state": None, "reward": 0.5, "done": True, "score": 1}
    """)
    env = load_env(path, {})
    assert not env.has_reset
    info = {"uid": "a"}
    out = run(env.step("s", "a", info))
    assert out["score"] == 1.0 and out["reward"] == 0.5 and out["extra_info"] is info
    with pytest.raises(EnvError, match="defines no reset"):
        run(env.reset(info))


# ---------------------------------------------------------------- malformed results
@pytest.mark.parametrize("ret, match", [
    ("[1, 2]", "must return a dict, got list"),
    ("{'reward': 1.0, 'done': True}", "returned no 'next_state'"),
    ("{'next_state': None, 'done': True}", "returned no 'reward'"),
    ("{'next_state': None, 'reward': 1.0}", "returned no 'done'"),
    ("{'next_state': 3, 'reward': 1.0, 'done': True}", "'next_state' must be a str or None"),
    ("{'next_state': None, 'reward': 'high', 'done': True}", "'reward' must be a number"),
    ("{'next_state': None, 'reward': float('nan'), 'done': True}", "'reward' must be finite"),
    ("{'next_state': None, 'reward': 1.0, 'done': 1}", "'done' must be a bool"),
    ("{'next_state': None, 'reward': 1.0, 'done': False}", "'next_state' is None but 'done' is False"),
    ("{'next_state': None, 'reward': 1.0, 'done': True, 'score': []}", "'score' must be a number"),
    ("{'next_state': None, 'reward': 1.0, 'done': True, 'extra_info': 5}", "'extra_info' must be a dict"),
])
def test_malformed_result_names_the_key(tmp_path, ret, match):
    env = load_env(write_env(tmp_path, f"def step(state, action, extra_info):\n    return {ret}\n"), {})
    with pytest.raises(EnvError, match=match):
        run(env.step("s", "a", {"uid": "x"}))


def test_numpy_bool_and_float_accepted(tmp_path):
    env = load_env(write_env(tmp_path, """
        import numpy as np
        def step(state, action, extra_info):
            return {"next_state": None, "reward": np.float32(0.25), "done": np.bool_(True)}
    """), {})
    out = run(env.step("s", "a", {}))
    assert out["done"] is True and out["reward"] == 0.25


# ---------------------------------------------------------------- timeouts
def test_async_hang_times_out(tmp_path):
    env = load_env(write_env(tmp_path, """
        import asyncio
        async def step(state, action, extra_info):
            await asyncio.sleep(3600)
    """), {}, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(EnvTimeout, match=r"step\(\) of env .*my_env.py timed out after 0.5s \[async\]"):
        run(env.step("s", "a", {}))
    assert time.monotonic() - t0 < 1.0  # within 2x the limit


def test_sync_hang_times_out_and_does_not_block_the_loop(tmp_path):
    env = load_env(write_env(tmp_path, """
        import time
        def step(state, action, extra_info):
            time.sleep(20)   # a blocking call that nothing can interrupt
    """), {}, timeout=0.5)

    async def main():
        ticks = 0

        async def ticker():  # proves the event loop keeps running while the step blocks
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        task = asyncio.create_task(ticker())
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout, match="abandoned"):
            await env.step("s", "a", {})
        elapsed = time.monotonic() - t0
        task.cancel()
        return elapsed, ticks

    elapsed, ticks = run(main())
    assert 0.5 <= elapsed < 1.0  # within 2x the limit
    assert ticks >= 5


def test_sync_steps_run_concurrently(tmp_path):
    env = load_env(write_env(tmp_path, """
        import time
        def step(state, action, extra_info):
            time.sleep(0.3)
            return {"next_state": None, "reward": 1.0, "done": True}
    """), {}, timeout=5)

    async def main():
        return await asyncio.gather(*(env.step("s", "a", {"uid": i}) for i in range(4)))

    t0 = time.monotonic()
    outs = run(main())
    assert [o["reward"] for o in outs] == [1.0] * 4
    assert time.monotonic() - t0 < 0.9  # 4 x 0.3 s serially


def test_exceptions_propagate_from_sync_and_async(tmp_path):
    for src in ("def step(s, a, e):\n    raise KeyError('boom')\n",
                "async def step(s, a, e):\n    raise KeyError('boom')\n"):
        env = load_env(write_env(tmp_path, src), {})
        with pytest.raises(KeyError, match="boom"):
            run(env.step("s", "a", {}))


def test_close_hook_errors_are_swallowed(tmp_path):
    env = load_env(write_env(tmp_path, """
        CLOSED = []
        def step(s, a, e):
            return {"next_state": None, "reward": 0, "done": True}
        def close(extra_info):
            CLOSED.append(extra_info["uid"])
            raise RuntimeError("cleanup failed")
    """), {})
    run(env.close({"uid": "z"}))
    assert env.module.CLOSED == ["z"]


def test_own_timeout_error_is_not_reported_as_env_timeout(tmp_path):
    env = load_env(write_env(tmp_path, "def step(s, a, e):\n    raise TimeoutError('db slow')\n"), {}, timeout=5)
    with pytest.raises(TimeoutError, match="db slow") as info:
        run(env.step("s", "a", {}))
    assert not isinstance(info.value, EnvTimeout)


def test_sys_exit_in_sync_step_becomes_env_error(tmp_path):
    env = load_env(write_env(tmp_path, "import sys\ndef step(s, a, e):\n    sys.exit(3)\n"), {})
    with pytest.raises(EnvError, match="step raised SystemExit"):
        run(env.step("s", "a", {}))


def test_sync_wrapper_returning_a_coroutine(tmp_path):
    env = load_env(write_env(tmp_path, """
        async def _step(state, action, extra_info):
            return {"next_state": None, "reward": 2, "done": True}
        def step(state, action, extra_info):
            return _step(state, action, extra_info)
    """), {})
    assert run(env.step("s", "a", {}))["reward"] == 2.0
