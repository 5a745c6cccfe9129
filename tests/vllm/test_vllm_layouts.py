"""Weight sync into a real vLLM engine from the 2-rank layouts fsdp2 and tp2 and the 4-rank
layouts ddp2 x fsdp2 and ddp2 x tp2 (each replica a pure tp2 group), one engine on rank 0 per
world size (benchmarks/bench_vllm_sync.py): after each sync the engine's sampled-token log-probs
equal the trainer's log-probs of the same tokens, per token. (1 process:
tests/vllm/test_vllm_engine.py and test_vllm_disaggregated.py.)"""
import pytest

from benchmarks.bench_vllm_sync import sync_and_compare
from tests.dist_utils import run_dist
from tests.vllm.conftest import tiny_vllm_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("world,layouts", [(2, ["fsdp2", "tp2"]), (4, ["ddp2xfsdp2", "ddp2xtp2"])])
def test_engine_logps_equal_the_trainer_after_syncs_from_each_layout(assets, tmp_path, world, layouts):
    # tp2 splits the key/value heads: 2 of them (head_dim 32)
    model = tiny_vllm_model(assets["tokenizer"], str(tmp_path / "model"), hidden=128, heads=4, kv_heads=2)
    (res, *_) = run_dist(sync_and_compare, world, model, f"{assets['data']}/sft_train.jsonl",
                         layouts, timeout=1500)
    for i, name in enumerate(layouts):
        r = res[name]
        # fp32 on both sides; the gap is kernel rounding (vLLM's CPU matmuls vs torch's), ~1e-6
        assert r["max_err"] < 1e-4, (name, r)
        assert r["version"] == str(i + 1) and r["tokens"] >= 8
        assert r["changed"], f"{name}: the engine served the previous layout's weights"
