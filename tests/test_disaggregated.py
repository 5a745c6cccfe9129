"""Disaggregated placement end to end (real processes on loopback): torchrun trainers drive RL2
engine servers (`python -m RL2.rollout.server`) by address. With k = 0 the run must equal the
colocated run with the same seeds exactly (fp32, CPU), for 1- and 2-rank trainers; a server
SIGKILLed mid-rollout must leave the results unchanged (its requests are retried on the other);
with every server gone the run must stop with a message naming them."""
import json

import pytest

from tests.run_utils import cfg_with, min_version, read_metrics, run_trainer
from tests.server_utils import kill, start_server

# Two turns, a reward that depends on every generated character (so advantages and losses are
# not all zero on the random tiny model), and an optional fault: on its first call the env
# SIGKILLs the processes named in RL2_TEST_KILL_PIDS (once per run: a marker file).
ENV = '''
import os, signal


async def step(state, action, extra_info):
    pids, marker = os.environ.get("RL2_TEST_KILL_PIDS"), os.environ.get("RL2_TEST_KILL_MARKER")
    if pids and not os.path.exists(marker):
        open(marker, "w").close()
        for pid in pids.split(","):
            os.killpg(int(pid), signal.SIGKILL)
    turn = extra_info.get("turn", 0)
    reward = (sum(map(ord, action)) % 7) / 7.0
    if turn == 1:
        return {"next_state": None, "reward": reward, "done": True}
    return {"next_state": state + action + " and then", "reward": reward, "done": False,
            "extra_info": {**extra_info, "turn": 1}}
'''
KEYS = ("rollout/reward", "rollout/response_length", "adv/mean", "actor/loss", "actor/grad_norm",
        "actor/entropy")


@pytest.fixture(scope="module")
def env_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg_env") / "env.py"
    path.write_text(ENV)
    return str(path)


@pytest.fixture(scope="module")
def servers(assets, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    started = [start_server(assets["model"], logs / f"server{i}.log") for i in range(2)]
    yield [address for _, address in started]
    for proc, _ in started:
        kill(proc)


def args(assets, env_path, *extra):
    return [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={env_path}", "actor.rollout.engine=torch", "actor.rollout.max_turns=2",
            "actor.lr=1e-3", "actor.strict_on_policy=true",  # engine vs trainer log-probs checked, engine_kl
            "actor.rollout.prompts_per_rollout=4", "actor.rollout.responses_per_prompt=4",
            "actor.rollout.train_sampling_params.max_new_tokens=8", "actor.rollout.env_workers=0",
            "trainer.total_steps=3", *extra]


def disaggregated(servers, *extra):
    return ["actor.rollout.placement=disaggregated", f"actor.rollout.servers=[{','.join(servers)}]",
            "actor.rollout.health_timeout=5", *extra]


def rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "rollout/reward" in r]


def assert_same_run(got, want):
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
        assert abs(g["rollout/engine_kl"]) < 1e-5  # the servers hold the trainer's weights
    assert len({r["rollout/reward"] for r in want}) > 1 and any(r["actor/loss"] != 0 for r in want)


@pytest.fixture(scope="module")
def colocated(assets, env_path, tmp_path_factory):
    runs = {}

    def get(nproc):
        if nproc not in runs:
            runs[nproc] = tmp_path_factory.mktemp(f"colocated{nproc}")
            run_trainer("ppo", nproc, args(assets, env_path), runs[nproc])
        return rows(runs[nproc])
    return get


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_disaggregated_equals_colocated(assets, env_path, servers, colocated, nproc, tmp_path):
    run_trainer("ppo", nproc, args(assets, env_path, *disaggregated(servers)), tmp_path)
    got = rows(tmp_path)
    assert_same_run(got, colocated(nproc))
    assert all(r["rollout/servers_live"] == 2 and r["rollout/servers_lost"] == 0 for r in got)
    # least-loaded dispatch: 16 trajectories start at once, so both servers answer about half
    assert 0 < got[-1]["rollout/server_requests_min"] <= got[-1]["rollout/server_requests_max"]
    assert got[-1]["rollout/server_requests_min"] >= 0.25 * got[-1]["rollout/server_requests_max"]
    # both servers report the trainer's step as their weight version
    from urllib.request import urlopen
    for address in servers:
        assert json.load(urlopen(f"http://{address}/weight_info", timeout=30)) == {"weight_version": "3"}
    dumped = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step1.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and all(t["error"] is None for t in dumped)



def test_async_k1_on_servers_equals_colocated_async(assets, env_path, servers, tmp_path):
    """max_staleness=1, inflight_update=none: the producer loads version max(0, t - 1) into the
    servers between batches, so the run equals the colocated asynchronous one exactly."""
    run = args(assets, env_path, "actor.strict_on_policy=false", "actor.rollout.max_staleness=1")
    run_trainer("ppo", 1, run, tmp_path / "colocated")
    run_trainer("ppo", 1, run + disaggregated(servers), tmp_path / "servers")
    got, want = rows(tmp_path / "servers"), rows(tmp_path / "colocated")
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in KEYS + ("async/staleness_max",):
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
        # the engines' own log-probs differ by kernel rounding only (other batch shapes)
        assert abs(g["rollout/engine_kl"] - w["rollout/engine_kl"]) < 1e-5
    for step in (1, 2, 3):  # every trained token generated by version max(0, step - 2)
        dumped = [json.loads(line) for line in
                  (tmp_path / "servers" / "run" / "rollouts" / f"step{step}.jsonl").read_text().splitlines()]
        assert {min_version(t) for t in dumped} == {max(0, step - 2)}
    from urllib.request import urlopen
    for address in servers:  # the last batch (step 3) was generated with version 1
        assert json.load(urlopen(f"http://{address}/weight_info", timeout=30)) == {"weight_version": "1"}


@pytest.mark.slow
def test_a_killed_server_is_replaced_then_none_left_stops_the_run(assets, env_path, colocated, tmp_path):
    procs = [start_server(assets["model"], tmp_path / f"s{i}.log") for i in range(2)]
    try:
        addresses = [a for _, a in procs]
        # SIGKILL server 0 at the first env step of step 1: its in-flight requests move to server 1
        run_trainer("ppo", 1, args(assets, env_path, *disaggregated(addresses)), tmp_path / "one_dies",
                    extra_env={"RL2_TEST_KILL_PIDS": str(procs[0][0].pid),
                               "RL2_TEST_KILL_MARKER": str(tmp_path / "killed1")})
        got = rows(tmp_path / "one_dies")
        assert_same_run(got, colocated(1))
        assert [r["rollout/servers_live"] for r in got] == [1, 1, 1]
        assert got[-1]["rollout/servers_lost"] == 1 and got[-1]["rollout/requests_retried"] >= 1
        # a run on the last one, killed mid-rollout: the run stops, naming the server
        proc = run_trainer("ppo", 1, args(assets, env_path, *disaggregated(addresses[1:])), tmp_path / "all_die",
                           check=False, timeout=300,
                           extra_env={"RL2_TEST_KILL_PIDS": str(procs[1][0].pid),
                                      "RL2_TEST_KILL_MARKER": str(tmp_path / "killed2")})
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "every rollout server is gone" in out and addresses[1] in out, out[-3000:]
        # no server up at start: a clear error within actor.rollout.server_timeout
        proc = run_trainer("ppo", 1, args(assets, env_path, *disaggregated(addresses), "actor.rollout.server_timeout=3"),
                           tmp_path / "none_up", check=False, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"{addresses[0]} not reachable within 3 s" in out, out[-3000:]
    finally:
        for p, _ in procs:
            kill(p)


@pytest.mark.parametrize("overrides,message", [
    (["actor.rollout.placement=remote"], "actor.rollout.placement='remote'"),
    (["actor.rollout.placement=disaggregated"], "needs actor.rollout.servers"),
    (["actor.rollout.placement=disaggregated", "actor.rollout.servers=[localhost]"], "'localhost' is not host:port"),
    (["actor.rollout.placement=disaggregated", "actor.rollout.servers=[a:1]", "actor.rollout.health_timeout=0"],
     "actor.rollout.health_timeout=0"),
    (["actor.rollout.placement=disaggregated", "actor.rollout.servers=[a:1]", "actor.rollout.server_dtype=fp9"],
     "server_dtype"),
    (["actor.rollout.placement=disaggregated", "actor.rollout.servers=[a:1]", "actor.rollout.transfer_backend=gloo"],
     "actor.rollout.transfer_backend='gloo'"),
    (["actor.rollout.placement=disaggregated", "actor.rollout.servers=[a:1]", "actor.rollout.transfer_backend=nccl",
      "trainer.device=cpu"], "transfer_backend=nccl needs a CUDA trainer"),
])
def test_bad_placement_configs_name_the_key(overrides, message):
    from RL2.trainer.ppo import check_config

    with pytest.raises(SystemExit, match=message):
        check_config(cfg_with(*overrides))


def test_a_server_dying_mid_answer_is_a_named_runtime_error():
    """A server killed while it sends its answer leaves a short body: http.client raises
    IncompleteRead (an HTTPException, not an OSError). The client must turn it into its
    RuntimeError so the pool retries the request elsewhere (it crashed a CI run)."""
    import socket
    import threading

    from RL2.rollout.vllm_server import VLLMServerEngine

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_and_die():
        conn, _ = listener.accept()
        request = b""
        while b"\r\n\r\n" not in request:  # the whole request first: else the client sees a reset
            request += conn.recv(65536)
        head, body = request.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"cho")
        conn.close()

    thread = threading.Thread(target=answer_and_die, daemon=True)
    thread.start()
    client = object.__new__(VLLMServerEngine)  # only _http's state: no server handshake
    client.url, client.timeout_s = f"http://127.0.0.1:{port}", 10
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}/inference/v1/generate failed: IncompleteRead"):
        client._http("POST", "/inference/v1/generate", {"token_ids": [1]})
    thread.join(5)
    listener.close()


def test_nccl_push_without_vllm_on_the_trainer_is_refused_at_start(monkeypatch):
    """A CUDA trainer resolves transfer_backend=auto to vLLM's nccl, whose rendezvous helper is
    vLLM's: without vLLM installed the run stops at the config check, naming the key."""
    import importlib.util

    from RL2.rollout.remote import check_placement

    cfg = cfg_with("actor.rollout.placement=disaggregated", "actor.rollout.servers=[a:1]")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert any("transfer_backend=auto means vLLM's nccl" in p for p in check_placement(cfg.actor.rollout, "cuda"))
    assert check_placement(cfg.actor.rollout, "cpu") == []


SLOW_ENV = '''
import asyncio


async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0)
    await asyncio.sleep(0.2)  # a tool call: rollouts outlast the update, so weights land mid-batch
    if turn == 2:
        return {"next_state": None, "reward": (sum(map(ord, action)) % 7) / 7.0, "done": True}
    return {"next_state": state + action + " again:", "reward": 0.0, "done": False,
            "extra_info": {**extra_info, "turn": turn + 1}}
'''


@pytest.mark.parametrize("mode", ["pause", "abort"])
def test_inflight_updates_on_servers_keep_the_staleness_bound(assets, servers, tmp_path, mode):
    """max_staleness=1 with in-flight updates: each new version is pushed to the servers as soon
    as it is published (running requests aborted and continued / restarted); every trained
    token is at most one version old and later tokens come from newer weights."""
    (tmp_path / "env.py").write_text(SLOW_ENV)
    run = args(assets, str(tmp_path / "env.py"), *disaggregated(servers), "actor.strict_on_policy=false",
               "actor.rollout.max_turns=3", "actor.rollout.max_staleness=1",
               f"actor.rollout.inflight_update={mode}", "actor.rollout.train_sampling_params.max_new_tokens=24",
               "actor.is_correction=seq_mis", "actor.is_high=10", "trainer.total_steps=5")
    run_trainer("ppo", 1, run, tmp_path / "out")
    got = rows(tmp_path / "out")
    assert len(got) == 5 and all(r["rollout/failed"] == 0 and r["async/dropped_stale"] == 0 for r in got)
    assert got[-1]["rollout/inflight_updates"] >= 1  # a pause per version published mid-batch (timing)
    root = tmp_path / "out" / "run" / "rollouts"
    trajs = {s: [json.loads(line) for line in (root / f"step{s}.jsonl").read_text().splitlines()]
             for s in range(1, 6)}
    assert all(s - 1 - min_version(t) <= 1 for s in trajs for t in trajs[s])
    versions = {s: {v for t in trajs[s] for turn in t["turns"] for v, _ in turn["versions"]} for s in trajs}
    assert max(max(v) for v in versions.values()) >= 3
    # weights changed in the middle of a batch (with inflight_update=none each batch has one version)
    assert any(len(v) > 1 for v in versions.values()), versions


def test_a_server_refusing_the_weight_group_stops_the_run_at_once(assets, env_path, tmp_path):
    """A server that answers /init_weight_transfer_engine with an error never joins the group,
    so the trainer's side of the rendezvous would wait out server_timeout (120 s here) in a
    thread the process's exit joins. The run must stop right after the error, naming it."""
    import http.server
    import threading
    import time

    class Refusing(http.server.BaseHTTPRequestHandler):
        def _answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/model_info":
                return self._answer(404, {"detail": "Not Found"})  # not SGLang: vLLM's protocol
            self._answer(200, {"world_size": 1} if self.path == "/get_world_size" else {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer(500, {"error": {"message": "cannot join: test refusal", "type": "Internal Server Error",
                                         "param": None, "code": 500}})

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        proc = run_trainer("ppo", 1, args(assets, env_path, *disaggregated([f"127.0.0.1:{server.server_port}"]),
                                          "actor.rollout.server_timeout=120"),
                           tmp_path, check=False, timeout=600)
        took = time.monotonic() - start
    finally:
        server.shutdown()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "cannot join: test refusal" in out, out[-3000:]
    assert took < 90, took  # measured ~15 s (start-up included); before, 120 s + start-up
