import os
import shutil
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_configure(config):
    """Child processes get a temp directory removed when the session ends: torchrun makes a
    torchelastic_* log directory per launch in $TMPDIR and never removes it (thousands piled up
    in /tmp). This process keeps /tmp (pytest's own tmp_path directories stay for inspection),
    and compiled kernels stay in torch's usual cache, whose default path follows $TMPDIR."""
    try:  # a private module: if torch moves it, only the cache's place is not pinned
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    except ImportError:
        pass
    tempfile.gettempdir()  # resolved (and cached) before $TMPDIR changes
    config.rl2_child_tmp = tempfile.mkdtemp(prefix="rl2-t-")  # short: socket paths <= 107 bytes
    os.environ["TMPDIR"] = config.rl2_child_tmp


def pytest_unconfigure(config):
    tmp = getattr(config, "rl2_child_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


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


@pytest.fixture(scope="session")
def serial(assets, tmp_path_factory):
    """The 1-process SFT reference runs (float32 and float64) that parallel runs must match."""
    from tests.run_utils import run_trainer, sft_args

    out = {}
    for dtype in ("float32", "float64"):
        d = tmp_path_factory.mktemp(f"serial_{dtype}")
        run_trainer("sft", 1, sft_args(assets, f"actor.dtype={dtype}", "actor.max_length_per_device=4096"), d)
        out[dtype] = d
    return out
