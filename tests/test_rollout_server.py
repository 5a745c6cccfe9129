"""The RL2 engine server (`python -m RL2.rollout.server`, a real process on loopback) against the
in-process TorchEngine, driven by the same client as a real `vllm serve` (VLLMServerEngine):
greedy and seeded outputs equal, a weight push over rl2_gloo gives the trainer's log-probs and
the version label, bad requests are clear 4xx errors in vLLM's error shape."""
import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.rollout.engine import SamplingParams, make_engine
from RL2.rollout.torch_engine import TorchEngine
from tests.server_utils import kill, prompts, request, run, start_server


@pytest.fixture(scope="module")
def server(assets, tmp_path_factory):
    proc, address = start_server(assets["model"], tmp_path_factory.mktemp("server") / "server.log")
    client = make_engine("vllm", None, assets["tokenizer"], server_url=f"http://{address}",
                         max_model_len=256, timeout_s=60, connect_timeout_s=60)
    yield address, client
    client.shutdown()
    kill(proc)


def trainer_logps(model, prompt, tokens, temperature):
    """log_softmax(logits / T) of each generated token: what the trainer computes."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_server_generates_what_the_embedded_engine_generates(server, assets):
    address, client = server
    tok = assets["tokenizer"]
    local = TorchEngine(assets["model"], tok)
    loop = asyncio.new_event_loop()
    cases = [SamplingParams(temperature=0, max_new_tokens=12),
             SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=11),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=5)]
    for params in cases:
        want = run(loop, [local.generate(p, params) for p in prompts(tok)])
        got = run(client.loop, [client.generate(p, params) for p in prompts(tok)])
        for w, g in zip(want, got):
            assert [o.token_ids for o in g] == [o.token_ids for o in w]
            assert [o.finish_reason for o in g] == [o.finish_reason for o in w]
            for a, b in zip(g, w):
                # same tokens; log-probs up to fp32 noise of different batch compositions
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                           rtol=0, atol=1e-4)
    local.shutdown()
    loop.close()


@pytest.mark.parametrize("path,body,param,words", [
    ("/inference/v1/generate", {"sampling_params": {}}, "token_ids", "non-empty list"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"temprature": 1}},
     "sampling_params.temprature", "unsupported"),
    ("/inference/v1/generate", {"token_ids": [1, 10**9], "sampling_params": {}}, "token_ids", "must be in"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n", "one sample"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params", "top_p"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "stream": True}, "output_mode", "streaming"),
    ("/update_weights", {"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}},
     None, "init_weight_transfer_engine was not called"),
    ("/init_weight_transfer_engine", {"init_info": {"host": "127.0.0.1"}}, "init_info", "port"),
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "h", "master_port": 1, "rank_offset": 1,
                                                    "world_size": 2}}, "init_info", "rl2_gloo only, not nccl"),
    ("/update_weight_version", {}, "new_version", "new_version"),
])
def test_bad_requests_are_clear_400s(server, path, body, param, words):
    status, out = request(server[0], "POST", path, body)
    assert status == 400, out
    assert out["error"]["code"] == 400 and out["error"]["param"] == param and words in out["error"]["message"], out


def test_weight_push_gives_the_trainers_logprobs_and_version(server, assets):
    address, client = server
    tok = assets["tokenizer"]
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    prompt = prompts(tok)[0]
    params = SamplingParams(temperature=0.9, max_new_tokens=10, n=2, seed=3)
    (before,) = run(client.loop, [client.generate(prompt, params)])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    client.update_weights(model.state_dict().items())
    assert client.weight_version() == "1"
    (after,) = run(client.loop, [client.generate(prompt, params)])
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    old_model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    for o in after:
        got = torch.tensor(o.logprobs, dtype=torch.float64)
        # fp32 kernels of a batched decode vs one full forward: ~1e-5 apart (measured)
        torch.testing.assert_close(got, trainer_logps(model, prompt, o.token_ids, 0.9), rtol=0, atol=1e-4)
        assert (got - trainer_logps(old_model, prompt, o.token_ids, 0.9)).abs().max() > 1e-2
    # the label is the caller's: /update_weight_version, and spans on every response
    assert request(address, "POST", "/update_weight_version", {"new_version": "7"})[0] == 200
    status, out = request(address, "POST", "/inference/v1/generate", {
        "token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 4}})
    assert status == 200 and out["choices"][0]["weight_versions"] == [{"version": "7", "start": 0, "end": 4}]
    assert out["choices"][0]["logprobs"] is None and out["usage"]["completion_tokens"] == 4
    assert request(address, "GET", "/weight_info") == (200, {"weight_version": "7"})


def test_routes_methods_json_and_pause(server):
    address = server[0]
    assert request(address, "GET", "/nope")[0] == 404
    assert request(address, "GET", "/inference/v1/generate")[0] == 405
    status, out = request(address, "POST", "/inference/v1/generate", raw=b"{not json")
    assert status == 400 and "invalid JSON" in out["error"]["message"]
    assert request(address, "GET", "/get_world_size") == (200, {"world_size": 1})
    assert request(address, "GET", "/health") == (200, None)
    assert request(address, "POST", "/pause?mode=later")[0] == 400
    for mode in ("abort", "wait", "keep"):
        assert request(address, "POST", f"/pause?mode={mode}") == (200, {"status": "paused"})
        assert request(address, "GET", "/is_paused") == (200, {"is_paused": True})
        assert request(address, "POST", "/resume") == (200, {"status": "resumed"})
        assert request(address, "GET", "/is_paused") == (200, {"is_paused": False})
    status, out = request(address, "POST", "/inference/v1/generate",
                          {"token_ids": [1, 2], "sampling_params": {"temperature": 0, "max_tokens": 2}})
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 2
