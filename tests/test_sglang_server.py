"""SGLang's HTTP server as a disaggregated engine server (RL2/rollout/sglang_server.py), on CPU
against tests/fake_sglang_server.py: a real process serving SGLang 0.5.23's routes and payloads
over RL2's torch engine, joining the trainer's weight-update group as SGLang does (gloo) and
refusing what SGLang refuses. The routes, fields and rules the client and the fake rely on are
checked against the 0.5.23 source (tests/sources.py; skipped only when it cannot be had).

Not shown here (no GPU, no sglang): a real SGLang server's NCCL group and CUDA receive buffers,
its own sampler's seeded determinism, LoRA adapters changing its logits."""
import asyncio
import json
import urllib.request

import pytest
import torch
import torch.distributed as dist

from RL2.rollout.engine import SamplingParams
from RL2.rollout.sglang_server import SGLangServerEngine, server_problems
from RL2.rollout.torch_engine import TorchEngine
from tests.run_utils import cfg_with, run_trainer
from tests.server_utils import kill, prompts, request, run, start_fake_sglang, start_server
from tests.sources import CACHE, SGLANG, download, find, tree
from tests.disagg_utils import (args, assert_same_run, check_inflight_updates, colocated,  # noqa: F401
                                disaggregated, env_path, rows)


@pytest.fixture(scope="module")
def fakes(assets, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fake_sglang")
    started = [start_fake_sglang(assets["model"], logs / f"fake{i}.log", "--enable-deterministic-inference")
               for i in range(2)]
    yield [address for _, address in started], [proc for proc, _ in started]
    for proc, _ in started:
        kill(proc)


def client_for(address, **kw) -> SGLangServerEngine:
    return SGLangServerEngine(f"http://{address}", max_model_len=256, timeout_s=60, connect_timeout_s=60, **kw)


def perturbed(model_dir) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in model.state_dict().items()]


def test_client_generates_and_pushes_weights_like_the_embedded_engine(assets, fakes, tmp_path):
    """Seeded samples repeat; after a weight push the server generates what an in-process torch
    engine holding the same weights generates (tokens and log-probs), and reports the version."""
    client = client_for(fakes[0][0])
    local, loop = TorchEngine(assets["model"], assets["tokenizer"]), asyncio.new_event_loop()
    try:
        ps = prompts(assets["tokenizer"])
        seeded = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=7)
        once = run(client.loop, [client.generate(p, seeded) for p in ps])
        again = run(client.loop, [client.generate(p, seeded) for p in ps])
        assert [[o.token_ids for o in g] for g in once] == [[o.token_ids for o in g] for g in again]
        assert client.weight_version() == "default"  # SGLang's ServerArgs.weight_version default
        weights = perturbed(assets["model"])
        client.update_weights(iter(weights))
        local.update_weights(iter(weights))
        assert client.weight_version() == "1"
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
        got = run(client.loop, [client.generate(p, greedy) for p in ps])
        want = run(loop, [local.generate(p, greedy) for p in ps])
        for g, w in zip(got, want):
            assert g[0].token_ids == w[0].token_ids
            assert torch.allclose(torch.tensor(g[0].logprobs), torch.tensor(w[0].logprobs), atol=1e-5)
        client.update_weights(iter(weights))  # a second sync reuses the group (one session each)
        assert client.weight_version() == "2"
    finally:
        client.shutdown()
        local.shutdown()
        loop.close()


def test_a_weight_push_reaches_a_paused_server_past_more_waiting_requests_than_threads(assets, fakes):
    """A paused SGLang server holds new /generate calls until /continue_generation (tm:938):
    with more of them waiting than the client's generate threads (64), the weight push and
    the version still go through (their own threads), then the resumed requests finish."""
    client = client_for(fakes[0][0])
    try:
        client.pause(10)
        params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=1)
        prompt = prompts(assets["tokenizer"])[0]

        async def go():
            waiting = [asyncio.ensure_future(client.generate(prompt, params)) for _ in range(70)]
            await asyncio.sleep(0.5)  # the generates reach the server (64) or queue behind them
            await asyncio.wait_for(client._update(iter(perturbed(assets["model"])), "7"), 20)
            assert not any(w.done() for w in waiting)
            await asyncio.to_thread(client.resume)
            return await asyncio.wait_for(asyncio.gather(*waiting), 30)

        outs = client.loop.run_until_complete(go())
        assert len(outs) == 70 and all(o[0].finish_reason in ("stop", "length") for o in outs)
        assert client.weight_version() == "7"
    finally:
        client.shutdown()


def post(address, path, body):
    return request(address, "POST", path, body)


def test_the_fake_refuses_what_sglang_0_5_23_refuses(assets, fakes):
    address = fakes[0][0]
    tok = assets["tokenizer"]
    ids = tok.encode("Hello there")
    # /generate: unknown sampling keys fail the contract check (vLLM's "seed" is not SGLang's)
    status, out = post(address, "/generate", {"input_ids": ids, "sampling_params": {"seed": 1}})
    assert status == 400 and "unknown field `seed`" in out["error"]
    status, out = post(address, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 10**6}})
    assert status == 400 and "maximum context length" in out["error"]["message"]
    # a prompt of max_req_input_len tokens (the context less 6 here) is aborted by the scheduler
    limit = request(address, "GET", "/server_info")[1]["max_req_input_len"]
    status, out = post(address, "/generate", {"input_ids": (ids * limit)[:limit], "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "exceeds the maximum allowed length" in out["error"]["message"]
    status, _ = post(address, "/generate", {"input_ids": (ids * limit)[:limit - 1], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200
    status, out = post(address, "/generate", {"input_ids": ids, "lora_path": "nope"})
    assert status == 400 and "not loaded" in out["error"]["message"]
    # weight updates: a session first, and a group joined before any receive
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]]}
    status, out = post(address, "/update_weights_from_distributed", body)
    assert status == 400 and "between begin_weight_update() and end_weight_update()" in out["message"]
    assert post(address, "/end_weight_update", {})[0] == 400
    assert post(address, "/begin_weight_update", {})[0] == 200
    status, out = post(address, "/begin_weight_update", {})
    assert status == 400 and "already open" in out["message"]
    status, out = post(address, "/update_weights_from_distributed", body)
    assert status == 400 and "Please call `init_weights_update_group` first" in out["message"]
    assert post(address, "/end_weight_update", {})[0] == 200
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    status, out = post(address, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": store.port,
                                                               "rank_offset": 1, "world_size": 2})
    assert status == 400 and "Failed to initialize custom process group" in out["message"]  # nccl (default) on CPU
    assert post(address, "/init_weights_update_group", {"master_address": "127.0.0.1"})[0] == 400  # fields
    assert post(address, "/destroy_weights_update_group", {"group_name": "nope"})[0] == 400
    assert post(address, "/pause_generation", {"mode": "later"})[0] == 400
    status, out = post(address, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"})
    assert status == 400 and out["success"] is False and "--enable-lora" in out["error_message"]


def test_pushes_the_server_cannot_load_are_refused(assets, fakes):
    """Names and shapes must be the model's; a group name cannot be joined twice."""
    client = client_for(fakes[0][0])
    try:
        client._run(client.start_update())
        for bucket, message in [([("model.nope.weight", torch.zeros(3))], "unknown parameter"),
                                ([("model.norm.weight", torch.zeros(3))], "has shape")]:
            with pytest.raises(RuntimeError, match=f"HTTP 400.*Failed to update parameter online.*{message}"):
                client._run(client.push(bucket, last=True))
        client._run(client.finish_update("x"))
        again = client.group.request()
        status, out = post(fakes[0][0], "/init_weights_update_group", {**again, "backend": "gloo"})
        assert status == 400 and "Failed to initialize custom process group" in out["message"]
    finally:
        client.shutdown()


def test_adapter_syncs_load_a_new_name_and_unload_the_previous(assets, tmp_path):
    """LoRA adapter-only sync to an SGLang server started with --enable-lora: each sync loads
    the adapter under a new name (a loaded name is refused), requests name it, the previous one
    is unloaded, the version label moves; an adapter beyond --max-lora-rank is refused."""
    from tests.fakes import LORA_CONFIG, lora_tensors

    proc, address = start_fake_sglang(assets["model"], tmp_path / "lora.log", "--enable-lora",
                                      "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj")
    client = client_for(address, lora_rank=4, lora_dir=str(tmp_path / "adapters"))
    try:
        names = []
        for seed in (0, 1):
            client.update_adapter(lora_tensors(seed), LORA_CONFIG)
            names.append(client._lora[0])
            assert client.weight_version() == str(seed + 1)
            out = run(client.loop, [client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))])
            assert len(out[0][0].token_ids) >= 1  # the request named the loaded adapter
        status, out = post(address, "/unload_lora_adapter", {"lora_name": names[0]})
        assert status == 400 and "does not exist" in out["error_message"]  # already unloaded
        status, out = post(address, "/load_lora_adapter", {"lora_name": names[1], "lora_path": client._lora[2]})
        assert status == 400 and "already loaded" in out["error_message"]
        with pytest.raises(RuntimeError, match="HTTP 400.*incompatible"):
            client.update_adapter(lora_tensors(2), {**LORA_CONFIG, "r": 8})
    finally:
        client.shutdown()
        kill(proc)


def test_requests_are_capped_at_what_the_server_admits():
    """/server_info's context_length is only the launch flag (None unless set); the server
    enforces max_req_input_len, which the client's max_model_len then never exceeds."""
    from RL2.rollout.sglang_server import context_limit

    assert context_limit({"context_length": None, "max_req_input_len": 100}, 256) == 100
    assert context_limit({"context_length": 64, "max_req_input_len": 58}, 256) == 58
    assert context_limit({"context_length": 4096, "max_req_input_len": 4090}, 256) == 256
    assert context_limit({}, 256) == 256


def test_start_up_refusals_name_the_server_flag():
    assert server_problems({"dp_size": 2}) and "--dp-size 1" in server_problems({"dp_size": 2})[0]
    assert "--enable-lora" in server_problems({}, lora_rank=8)[0]
    assert "--max-lora-rank" in server_problems({"enable_lora": True, "max_lora_rank": 4,
                                                 "lora_target_modules": ["q_proj"]}, 8, ["q_proj"])[0]
    assert "v_proj" in server_problems({"enable_lora": True, "max_lora_rank": 8,
                                        "lora_target_modules": ["q_proj"]}, 8, ["q_proj", "v_proj"])[0]
    assert server_problems({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"]},
                           8, ["q_proj"]) == []


def test_server_kind_is_checked_at_start(monkeypatch):
    import importlib.util

    from RL2.rollout.remote import check_placement
    from RL2.trainer.ppo import check_config

    base = ("actor.rollout.placement=disaggregated", "actor.rollout.servers=[a:1]")
    with pytest.raises(SystemExit, match="actor.rollout.server_kind='sgl'"):
        check_config(cfg_with(*base, "actor.rollout.server_kind=sgl"))
    # a CUDA trainer's nccl push needs vLLM on the trainer only for vLLM's protocol
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert check_placement(cfg_with(*base, "actor.rollout.server_kind=sglang").actor.rollout, "cuda") == []
    assert "server_kind=sglang" in check_placement(cfg_with(*base).actor.rollout, "cuda")[0]


def test_pool_probes_each_servers_protocol(assets, fakes, tmp_path):
    """server_kind=auto: the SGLang server answers /model_info, RL2's server (vLLM's protocol) 404."""
    from RL2.rollout.remote import RemotePool
    from RL2.rollout.vllm_server import VLLMServerEngine

    proc, rl2 = start_server(assets["model"], tmp_path / "rl2.log")
    try:
        pool = RemotePool([fakes[0][0], rl2], assets["tokenizer"], max_model_len=256, timeout_s=60)
        assert [type(s.client) for s in pool.servers] == [SGLangServerEngine, VLLMServerEngine]
        pool.shutdown()
        # a push queued on a rollout loop that runs after shutdown is dropped, not a reconnect
        # to the closed clients (it hung the in-flight run at exit until the group timeout)
        pool.abort_requests()
        pool.update_weights(iter([("model.norm.weight", torch.ones(32))]))
        with pytest.raises(RuntimeError, match="--enable-lora"):
            RemotePool([fakes[0][0]], assets["tokenizer"], timeout_s=60, lora_rank=4, lora_targets=["q_proj"])
    finally:
        kill(proc)


def sglang_run(assets, env_path, addresses, *extra):
    return args(assets, env_path, *disaggregated(addresses, "actor.rollout.server_kind=auto", *extra))


def test_disaggregated_on_sglang_servers_equals_colocated(assets, env_path, fakes, colocated, tmp_path):
    """k = 0 (max_staleness=0) on two SGLang servers: rewards, losses, grad norms and entropies
    equal the colocated run with the same seeds, exactly (fp32, CPU)."""
    addresses, _ = fakes
    run_trainer("ppo", 1, sglang_run(assets, env_path, addresses), tmp_path)
    got = rows(tmp_path)
    assert_same_run(got, colocated(1))
    assert all(r["rollout/servers_live"] == 2 and r["rollout/servers_lost"] == 0 for r in got)
    assert got[-1]["rollout/server_requests_min"] > 0  # both servers answered
    for address in addresses:  # each reports the trainer's step as its weight version
        with urllib.request.urlopen(f"http://{address}/model_info", timeout=30) as r:
            assert json.load(r)["weight_version"] == "3"


@pytest.mark.slow  # the fast set keeps the disaggregated-on-SGLang run
def test_inflight_updates_pause_sglang_servers_within_the_staleness_bound(assets, fakes, tmp_path):
    """max_staleness=1, inflight_update=pause on SGLang servers: /pause_generation (abort) cuts
    running requests, the push lands mid-batch, /continue_generation resumes (the assertions of
    the RL2-server test: staleness <= 1, a batch mixing versions, no failures)."""
    check_inflight_updates(assets, fakes[0], tmp_path, "pause")


@pytest.mark.slow
def test_a_killed_sglang_server_is_dropped_and_its_requests_retried(assets, env_path, colocated, tmp_path):
    procs = [start_fake_sglang(assets["model"], tmp_path / f"s{i}.log", "--enable-deterministic-inference")
             for i in range(2)]
    try:
        # SIGKILL server 0 at the first env step of step 1 (the env of tests/test_disaggregated.py)
        run_trainer("ppo", 1, sglang_run(assets, env_path, [a for _, a in procs]), tmp_path / "run",
                    extra_env={"RL2_TEST_KILL_PIDS": str(procs[0][0].pid),
                               "RL2_TEST_KILL_MARKER": str(tmp_path / "killed")})
        got = rows(tmp_path / "run")
        assert_same_run(got, colocated(1))
        assert [r["rollout/servers_live"] for r in got] == [1, 1, 1]
        assert got[-1]["rollout/servers_lost"] == 1 and got[-1]["rollout/requests_retried"] >= 1
    finally:
        for p, _ in procs:
            kill(p)


# ---------------------------------------------------------------------- the 0.5.23 source
@pytest.fixture(scope="module")
def src():
    return download(SGLANG, CACHE)


def test_routes_and_fields_exist_in_sglang_0_5_23(src):
    http = (src / "srt/entrypoints/http_server.py").read_text()
    for route in ("/generate", "/init_weights_update_group", "/destroy_weights_update_group",
                  "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
                  "/update_weight_version", "/pause_generation", "/continue_generation",
                  "/load_lora_adapter", "/unload_lora_adapter"):
        assert f'"{route}"' in http, route
    for route in ("/health", "/health_generate", "/model_info", "/server_info", "/get_server_info"):
        assert f'@app.get("{route}")' in http, route
    assert '"weight_version": _global_state.tokenizer_manager.config_value(' in http  # /model_info
    assert 'status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST)' in http  # ValueError -> 400
    assert "Override FastAPI's default 422 validation error with 400." in http
    io = src / "srt/managers/io_struct.py"
    fields = {c: {n.target.id for n in find(tree(io), c).body if isinstance(n, __import__("ast").AnnAssign)}
              for c in ("InitWeightsUpdateGroupReqInput", "UpdateWeightsFromDistributedReqInput",
                        "UpdateWeightVersionReqInput", "PauseGenerationReqInput", "LoadLoRAAdapterReqInput",
                        "UnloadLoRAAdapterReqInput", "LoRAUpdateOutput", "DestroyWeightsUpdateGroupReqInput")}
    assert {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"} <= fields["InitWeightsUpdateGroupReqInput"]
    assert {"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format"} <= fields["UpdateWeightsFromDistributedReqInput"]
    assert {"new_version", "abort_all_requests"} <= fields["UpdateWeightVersionReqInput"]
    assert "abort_all_requests: bool = True" in (io.read_text().split("class UpdateWeightVersionReqInput")[1][:300])
    assert 'mode: Literal["abort", "retract", "in_place"] = "abort"' in io.read_text()
    assert {"lora_name", "lora_path"} <= fields["LoadLoRAAdapterReqInput"]
    assert {"success", "error_message"} <= fields["LoRAUpdateOutput"]
    api = (src / "api/v1/api_types.py").read_text()
    sampling = api.split("class SamplingParams(")[1].split("class ")[0]
    assert "unknown keys rejected" in sampling and "sampling_seed: Optional[int]" in sampling
    for key in ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "skip_special_tokens"):
        assert f"\n    {key}:" in sampling, key
    generate = api.split("class GenerateRequest(")[1].split("class ")[0]
    for key in ("input_ids", "sampling_params", "return_logprob", "lora_path"):
        assert f"\n    {key}:" in generate, key
    meta = api.split("class GenerateMetaInfo(")[1].split("class ")[0]
    assert "finish_reason:" in meta and "output_token_logprobs:" in meta
    assert "[logprob, token_id, text]" in api


def test_input_limits_in_sglang_0_5_23(src):
    """What `context_limit` and the fake rely on: the scheduler publishes max_req_input_len in
    /server_info, derives it from the context and the KV pool, and aborts prompts that long."""
    assert '"max_req_input_len": self.max_req_input_len,' in (src / "srt/managers/scheduler.py").read_text()
    worker = (src / "srt/managers/tp_worker.py").read_text()
    assert "self.model_config.context_len - 1," in worker and "max_req_input_len = max_req_len - 5" in worker
    utils = (src / "srt/managers/utils.py").read_text().split("def validate_input_length(")[1][:1500]
    assert "if len(req.origin_input_ids) >= max_req_input_len:" in utils
    assert "exceeds \"\n                f\"the maximum allowed length" in utils
    info = (src / "srt/utils/common.py").read_text().split("def build_server_info(")[1][:600]
    assert "result.update(scheduler_info)" in info


def test_weight_update_rules_in_sglang_0_5_23(src):
    """The group SGLang joins (the trainer builds the same key space), the session and flush
    rules, the flat bucket layout, seeds and health while paused."""
    common = (src / "srt/utils/common.py").read_text().split("def init_custom_process_group(")[1][:3000]
    assert "store = PrefixStore(group_name, store)" in common and "_new_process_group_helper(" in common
    assert "rendezvous(init_method, rank, world_size, timeout=timeout)" in common
    mwu = (src / "srt/model_executor/model_runner_components/weight_updater.py").read_text()
    assert "rank = rank_offset + self.tp_rank" in mwu and "init_method=na.to_tcp()" in mwu
    assert "Please call `init_weights_update_group` first." in mwu
    assert 'if load_format == "flattened_bucket":' in mwu and "FlattenedTensorBucket.empty(" in mwu
    assert "The group to be destroyed does not exist." in mwu
    bucket = (src / "srt/weight_sync/tensor_bucket.py").read_text()
    assert "Unaligned received tensor" in bucket and "offset += size" in bucket
    wu = (src / "srt/managers/scheduler_components/weight_updater.py").read_text()
    assert "update_weights_from_distributed must run between" in wu
    assert "a weight-update session is already open" in wu and "no weight-update session is open" in wu
    assert "the cache was not flushed because" in wu
    import torch.distributed.distributed_c10d as c10d  # the prefixes UpdateGroup builds by hand
    import inspect
    helper = inspect.getsource(c10d._new_process_group_helper)
    assert 'PrefixStore(f"{group_name}/", store)' in helper and 'PrefixStore(f"{device}/", prefix_store)' in helper
    batch = (src / "srt/sampling/sampling_batch_info.py").read_text()
    assert "enable_deterministic = get_exec().deterministic.enable_deterministic_inference" in batch
    tm = (src / "srt/managers/tokenizer_manager.py").read_text()
    assert "await self.is_pause_cond.wait_for(lambda: not self.is_pause)" in tm
    assert "Requested token count exceeds the model's maximum context length" in tm
    environ = (src / "srt/environ.py").read_text()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in environ
