"""Server mode for real: RL2 drives a `vllm serve` process over HTTP (token-in/token-out
/inference/v1/generate and the RL routes), weights pushed over rl2_gloo; a server that dies
mid-rollout is a clear error, not a hang."""
import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.rollout.engine import SamplingParams
from tests.server_utils import kill
from tests.vllm.vllm_utils import connect, hf_logps, prompt_ids, start_vllm_server, stop_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a second vLLM start-up: 2-4 minutes


@pytest.fixture(scope="module")
def server(vllm_model, assets, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    proc, url = start_vllm_server(vllm_model, log)
    engine = connect(proc, url, assets["tokenizer"], log)
    yield proc, engine
    engine.shutdown()
    stop_vllm_server(proc)


def run(engine, *coros):
    async def go():
        return await asyncio.gather(*coros)
    return engine.loop.run_until_complete(go())


def test_server_generates_like_hf_and_takes_new_weights(server, vllm_model, assets):
    _, engine = server
    tok = assets["tokenizer"]
    hf = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    prompts = prompt_ids(tok)
    outs = run(engine, *[engine.generate(p, SamplingParams(temperature=0, max_new_tokens=16)) for p in prompts])
    for prompt, (out,) in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    engine.update_weights(hf.state_dict().items())
    assert engine.weight_version() == "1"
    (outs,) = run(engine, engine.generate(prompts[0], SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=3)))
    for o in outs:
        torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64),
                                   hf_logps(hf, prompts[0], o.token_ids, 0.8), atol=1e-4, rtol=0)


def test_server_dying_mid_rollout_is_a_clear_error(server, assets):
    proc, engine = server
    prompt = prompt_ids(assets["tokenizer"])[0]

    async def keep_generating():
        # Back-to-back requests until one fails: some are always in flight when the server dies
        # (a fixed batch could finish before the kill on an idle machine; CI saw exactly that).
        # Bounded: a server that outlived the kill ends the loop and fails the assert below.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            await engine.generate(prompt, SamplingParams(max_new_tokens=100, n=4))
        return "still answering 90 s after the kill"

    async def rollout_then_kill():
        tasks = [asyncio.ensure_future(keep_generating()) for _ in range(8)]
        await asyncio.sleep(1.0)
        kill(proc)
        return await asyncio.gather(*tasks, return_exceptions=True)

    start = time.monotonic()
    results = engine.loop.run_until_complete(rollout_then_kill())
    assert time.monotonic() - start < 120
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors and all(isinstance(e, RuntimeError) and engine.url in str(e) for e in errors), results
