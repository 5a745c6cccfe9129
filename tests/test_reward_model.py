"""A reward model as a PPO reward: the output of RL2.trainer.rm, sharded over 2 ranks, scores
trajectories exactly as an HF forward of the same checkpoint reads the RM trainer's format; the
score is added on the last action token with its coefficient and logged as a component."""
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_dist
from tests.run_utils import run_trainer


@pytest.fixture(scope="module")
def trained_rm(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    run_trainer("rm", 1, [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/pref_train.jsonl",
                          "data.train.batch_size=16", "actor.lr=1e-3", "trainer.total_steps=3"], out)
    return str(out / "run" / "final")


def trajectories(tokenizer):
    """Trajectories: one whose response ends with eos (the RM reads after the chat template's
    suffix, as in RM training), one cut by max_new_tokens, a failed one (skipped), and a second
    response to the first prompt (the two share their prompt: computed once)."""
    out = []
    for prompt, response, eos in (("What is 1 plus 2?", "3", True), ("What is 4 plus 0?", "no idea 7", False),
                                  ("What is 2 plus 2?", "4", True), ("What is 1 plus 2?", "three", True)):
        p = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True)
        p_ids = tokenizer.encode(p, add_special_tokens=False)
        r_ids = tokenizer.encode(response, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
        ids = torch.tensor(p_ids + r_ids)
        mask = torch.tensor([0.0] * (len(p_ids) - 1) + [1.0] * len(r_ids))
        sample = {"input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask, "rewards": torch.zeros(len(ids) - 1)}
        sample["rewards"][-1] = 1.0  # the env's reward
        out.append(SimpleNamespace(samples=[sample], failed=False, reward=1.0, extra_info={},
                                   text=p + response + ("<|im_end|>\n" if eos else "")))
    out[2].failed = True
    return out


def _score(rank, world_size, rm_path, model_path):
    from transformers import AutoTokenizer

    from RL2.rollout.reward_model import RewardModel
    from RL2.utils.config import load_config

    torch.set_num_threads(1)
    cfg = load_config("ppo", [f"actor.model_name={model_path}", "data.train.path=x", "actor.rollout.env_path=x",
                              "actor.max_length_per_device=32"])  # several micro-batches over fsdp2
    import RL2.workers.worker as worker

    tok = AutoTokenizer.from_pretrained(model_path)
    rm = RewardModel(rm_path, cfg.actor, 0.5, tok, "cpu", seed=0)
    trajs = trajectories(tok)
    shared, share_prefixes = [], worker.share_prefixes

    def counted(samples, *a):  # prefix-only sequences added (`share_prompt`: auto, on for CPU)
        out = share_prefixes(samples, *a)
        shared.append(len(out[0]) - len(samples))
        return out
    worker.share_prefixes = counted
    rm([trajs[:2], trajs[2:]])
    return [(t.reward, t.samples[0]["rewards"].tolist(), t.extra_info, t.text) for t in trajs], shared


@pytest.mark.slow
def test_reward_model_scores_like_hf_and_adds_to_the_reward(assets, trained_rm):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    got = run_dist(_score, 2, trained_rm, assets["model"])
    assert got[0] == got[1]  # every rank holds the same rewards
    got, shared = got[0]
    assert shared == [1]  # the two responses to the first prompt computed it once
    hf = AutoModelForTokenClassification.from_pretrained(trained_rm).eval()
    tok = AutoTokenizer.from_pretrained(assets["model"])
    for reward, rewards, info, text in got[:2] + got[3:]:
        with torch.no_grad():
            want = hf(torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[0, -1, 0].item()
        assert info["reward_components"]["reward_model"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert info["reward_components"]["env"] == 1.0
        assert reward == pytest.approx(1.0 + 0.5 * want, rel=1e-5)
        assert rewards[-1] == pytest.approx(1.0 + 0.5 * want, rel=1e-5) and not any(rewards[:-1])
    failed = got[2]
    assert failed[0] == 1.0 and failed[2] == {}  # a failed trajectory is not scored


def test_a_causal_lm_is_refused_as_a_reward_model(assets, trained_rm, tmp_path):
    """A causal LM has no score head: loaded as a token classifier it would score with a random
    one (found by a hostile-input probe). RL2.trainer.rm's output and a sharded index pass."""
    import json

    from safetensors import safe_open

    from RL2.rollout.reward_model import check_reward_head, weight_names

    with pytest.raises(SystemExit, match="has no score head"):
        check_reward_head(assets["model"])
    check_reward_head(trained_rm)
    with safe_open(f"{trained_rm}/model.safetensors", "pt") as f:
        names = list(f.keys())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}))
    assert weight_names(str(tmp_path)) == set(names)
    check_reward_head(str(tmp_path))
    assert weight_names(str(tmp_path / "missing")) is None
