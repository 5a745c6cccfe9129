import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Tokenizer, tiny causal LM (tied), tiny value model and JSONL datasets, built once."""
    from RL2.tools.make_assets import build_tiny_model, build_tokenizer, write_datasets

    root = tmp_path_factory.mktemp("assets")
    tok = build_tokenizer(str(root / "tokenizer"))
    build_tiny_model(str(root / "model"), tok, "qwen2", hidden=32, layers=2, heads=4, kv_heads=2,
                     intermediate=64)
    write_datasets(str(root / "data"), n_train=64, n_test=16)
    return {"root": root, "tokenizer": tok, "model": str(root / "model"), "data": str(root / "data")}
