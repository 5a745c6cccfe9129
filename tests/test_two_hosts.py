"""README's two-host launch with the engine server on another "host": its own network namespace
(own interfaces and address, reached over a veth link as a machine on the LAN would be), the
trainer in this one. Nothing may assume loopback: the trainer reaches the server by address, the
server dials back into the trainer's weight-transfer group at the address the route gives
(`remote.address_towards`). With k = 0 the run equals the colocated run exactly.
Needs root and `ip netns` (skipped otherwise). Not two machines: the filesystem and the kernel
are shared, so only the network path is what two hosts would have."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.run_utils import read_metrics, run_trainer

ENV = '''
async def step(state, action, extra_info):
    reward = (sum(map(ord, action)) % 7) / 7.0  # depends on every generated character
    return {"next_state": None, "reward": reward, "done": True}
'''
KEYS = ("rollout/reward", "rollout/response_length", "adv/mean", "actor/loss", "actor/grad_norm")


def _ip(*args, ns=None):
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def other_host():
    """(namespace, this host's address on the link, the other host's address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) to make a second network host")
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"rl2host{tag}", f"rl2a{tag}", f"rl2b{tag}"
    subnet = f"10.{random.randint(100, 199)}.{random.randint(0, 255)}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"ip netns add failed: {e.stderr.strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("addr", "add", f"{subnet}.2/24", "dev", there, ns=ns)
        _ip("link", "set", there, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        yield ns, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def server(assets, other_host, tmp_path_factory):
    """An RL2 engine server listening on the other host's address only."""
    ns, _, there = other_host
    log_path = tmp_path_factory.mktemp("other_host") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "RL2.rollout.server",
                                 "--model", assets["model"], "--host", there, "--port", "0", "--threads", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline, address = time.monotonic() + 300, None
        while address is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"listening on http://([\d.]+:\d+)", log_path.read_text())
            address = m.group(1) if m else time.sleep(0.2)
        assert address, f"server did not start:\n{log_path.read_text()[-3000:]}"
        yield address
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_server_on_another_host_equals_colocated(assets, other_host, server, tmp_path):
    from RL2.rollout.remote import address_towards

    _, here, there = other_host
    assert server.startswith(there + ":")
    # the server reaches the trainer at its address on the link, not at 127.0.0.1
    assert address_towards(f"http://{server}") == here
    (tmp_path / "env.py").write_text(ENV)
    common = [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
              f"actor.rollout.env_path={tmp_path / 'env.py'}", "actor.rollout.engine=torch",
              "actor.lr=1e-3", "actor.strict_on_policy=true", "actor.rollout.prompts_per_rollout=4",
              "actor.rollout.responses_per_prompt=4", "actor.rollout.train_sampling_params.max_new_tokens=8",
              "actor.rollout.env_workers=0", "trainer.total_steps=3"]
    run_trainer("ppo", 1, common, tmp_path / "colocated")
    run_trainer("ppo", 1, common + ["actor.rollout.placement=disaggregated",
                                    f"actor.rollout.servers=[{server}]"], tmp_path / "two_hosts")
    want, got = ([r for r in read_metrics(tmp_path / d) if "rollout/reward" in r]
                 for d in ("colocated", "two_hosts"))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
        assert abs(g["rollout/engine_kl"]) < 1e-5  # every sync crossed the link
        assert g["rollout/servers_live"] == 1
    assert len({r["rollout/reward"] for r in want}) > 1
    with urllib.request.urlopen(f"http://{server}/weight_info", timeout=30) as r:
        assert json.load(r) == {"weight_version": "3"}
