"""The torch engine in bf16 beside an fp32 trainer (`actor.rollout.torch.dtype=bfloat16`): every
sync hands it the trainer's weights cast to bf16 (tests/test_weight_sync.py checks the tensors),
its log-probs stay within bf16 rounding of the trainer's, and PPO learns from its samples."""
import pytest

from tests.run_utils import FIRST_WORD_ENV, read_metrics, run_trainer


@pytest.mark.slow
def test_bf16_engine_rollouts_follow_the_trainer_and_the_reward_rises(assets, tmp_path):
    env = tmp_path / "env.py"
    env.write_text(FIRST_WORD_ENV)
    runs = {}
    for dtype in ("bfloat16", "float32"):
        run_trainer("ppo", 1, [
            f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={env}", f"actor.rollout.torch.dtype={dtype}", "actor.lr=1e-2",
            "actor.rollout.max_length=128", "actor.rollout.prompts_per_rollout=16",
            "actor.rollout.responses_per_prompt=8", "actor.rollout.train_sampling_params.max_new_tokens=1",
            "actor.tis_coef=2.0", "trainer.total_steps=12"], tmp_path / dtype, timeout=900)
        runs[dtype] = [r for r in read_metrics(tmp_path / dtype) if "rollout/reward" in r]
    for dtype, rows in runs.items():
        rewards = [r["rollout/reward"] for r in rows]
        gaps = [abs(r["rollout/engine_kl"]) for r in rows]
        # measured: the reward ~0.09 -> 0.26-0.29 by step 8 with either engine
        assert len(rows) == 12 and sum(rewards[-3:]) / 3 > rewards[0] + 0.1, (dtype, rewards)
        if dtype == "float32":  # same weights, same dtype: kernel rounding only (measured ~1e-7)
            assert max(gaps) < 1e-6, gaps
        else:  # bf16 rounding, the same at every step: each sync gave it the new weights (~1e-4)
            assert max(gaps) < 2e-3 and sum(g > 1e-6 for g in gaps) >= 10, gaps
