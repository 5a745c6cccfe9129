"""PPO end to end on CPU under torchrun: SFT warm start on answers with a systematic mistake, then
RL raises the reward (single-turn GRPO, single-turn PPO with a critic, a two-question multi-turn
chat, the GSPO and CISPO presets, a composed reward); resume after a crash repeats the straight run."""
import json
import math
import statistics
from pathlib import Path

import pytest

from tests.run_utils import ANSWER_MATCH, biased_warm_start, read_metrics, run_trainer, train_rows

pytestmark = pytest.mark.slow

# The two-question chat: the second question is appended as a new user turn, so the state always
# extends state + action and the rollout keeps ONE sequence whose question tokens are masked out.
TWO_QUESTIONS_ENV = '''
import re


async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0)
    numbers = re.findall(r"-?\\d+", action)
    reward = 0.5 if numbers and int(numbers[-1]) == int(extra_info["answers"][turn]) else 0.0
    if turn + 1 == len(extra_info["answers"]):
        return {"next_state": None, "reward": reward, "done": True}
    question = extra_info["questions"][turn + 1]
    suffix = "\\n<|im_start|>user\\n" + question + "<|im_end|>\\n<|im_start|>assistant\\n"
    return {"next_state": state + action + suffix, "reward": reward, "done": False,
            "extra_info": {**extra_info, "turn": turn + 1}}
'''

# What makes the reward rise reliably on CPU with the tiny model (about 1 s per step).
RL_ARGS = ["actor.lr=2e-3", "actor.rollout.prompts_per_rollout=16", "actor.rollout.responses_per_prompt=8",
           "actor.rollout.train_sampling_params.max_new_tokens=4",
           "actor.rollout.test_sampling_params.max_new_tokens=4", "trainer.total_steps=30"]


@pytest.fixture(scope="module")
def warm_start(assets, tmp_path_factory):
    """A hidden-64 model, SFT'd (256 steps) on answers with a systematic mistake (a+b+1 is more
    frequent than a+b, as in the quick-start): sampling is right ~30% of the time and RL must move
    the mode. (The noisy set, right half the time, gave a warm start at reward ~0.08 with the
    Qwen2-pipeline tokenizer, from which the presets barely rose.)"""
    return biased_warm_start(tmp_path_factory.mktemp("ppo_warm"), assets["tokenizer"], hidden=64, layers=2)


def rl_args(warm, *extra):
    return [f"actor.model_name={warm['model']}", f"data.train.path={warm['data'] / 'ppo_train.jsonl'}",
            f"actor.rollout.env_path={ANSWER_MATCH}", *RL_ARGS, *extra]


def assert_rises(rewards, by=0.15):
    """The median reward of the last 5 steps exceeds that of the first 5 by `by`. Medians, so
    that no single step's draw decides: with means, a GRPO run whose reward rose from 0.16-0.23
    to 0.38-0.40 failed on its last step's 0.23 (first 5 0.192, last 5 0.339), after a change
    of ~1e-7 in the lm_head's gradient sums moved the whole trajectory."""
    first, last = statistics.median(rewards[:5]), statistics.median(rewards[-5:])
    assert last > first + by, (f"reward did not rise: median of the first 5 steps {first:.3f}, "
                               f"of the last 5 {last:.3f}: {rewards}")


def test_grpo_raises_the_reward(warm_start, tmp_path):
    run_trainer("ppo", 2, rl_args(warm_start, f"data.test.path={warm_start['data'] / 'ppo_test.jsonl'}",
                                  "trainer.test_freq=15"), tmp_path)
    assert_rises(train_rows(tmp_path, "rollout/reward"))
    rows = read_metrics(tmp_path)
    assert all(r["rollout/failed"] == 0 and r["rollout/arith/pass@8"] > 0 for r in rows if "rollout/failed" in r)
    assert [r["step"] for r in rows if "test/arith/mean@1" in r] == [0, 15, 30]  # test_at_start
    dumped = (tmp_path / "run" / "rollouts" / "step30.jsonl").read_text().splitlines()
    assert len(dumped) == 16 * 8 and {"prompt", "turns", "reward", "error"} <= set(json.loads(dumped[0]))


def test_ppo_with_a_critic_raises_the_reward(warm_start, tmp_path):
    # OpenAI-style PPO: GAE with a critic (warmed up for 2 steps), k1 KL in the reward, 2 mini-batches
    run_trainer("ppo", 2, rl_args(warm_start, "adv.estimator=gae", "kl.coef=0.01", "kl.type=reward",
                                  "kl.reward_estimator=k1", "critic.lr=3e-3", "actor.freeze_steps=2",
                                  "actor.update_per_rollout=2", "adv.global_norm=true"), tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "rollout/reward" in r]
    assert_rises([r["rollout/reward"] for r in rows])
    assert "actor/loss" not in rows[0] and "actor/loss" in rows[2]  # critic warm-up
    assert rows[2]["critic/lr"] == 3e-3 and rows[2]["actor/lr"] == 2e-3  # each its own lr
    # The fresh value head learns: its loss (0.5 * MSE) relative to the returns' variance falls.
    # Raw value losses also follow that variance, p(1-p) for a 0/1 reward, which grows as the
    # reward rises from ~0.2 towards 0.5 (a run with a better critic failed the raw comparison).
    rel = [r["critic/value_loss"] / r["rollout/reward_std"] ** 2 for r in rows]
    assert sum(rel[-5:]) / 5 < rel[0], rel


def write_two_question_data(warm, tmp_path):
    rows = [json.loads(line) for line in open(warm["data"] / "ppo_train.jsonl")]
    with open(tmp_path / "two_questions.jsonl", "w") as f:
        for a, b in zip(rows[0::2], rows[1::2]):
            f.write(json.dumps({"prompt": a["prompt"], "data_source": "two_questions", "extra_info": {
                "questions": [a["prompt"], b["prompt"]],
                "answers": [a["extra_info"]["answer"], b["extra_info"]["answer"]]}}) + "\n")
    env = tmp_path / "two_questions_env.py"
    env.write_text(TWO_QUESTIONS_ENV)
    return str(tmp_path / "two_questions.jsonl"), str(env)


def test_multi_turn_chat_raises_the_reward(warm_start, tmp_path):
    data, env = write_two_question_data(warm_start, tmp_path)
    run_trainer("ppo", 2, [f"actor.model_name={warm_start['model']}", f"data.train.path={data}",
                           f"actor.rollout.env_path={env}", *RL_ARGS, "actor.rollout.max_turns=2",
                           # 2e-3 dips at the start here (measured 0.10 vs 0.15 rise). 40 steps: in
                           # 30 the rise was 0.15 once, then 0.082 after fix 51's rounding (x / (1 /
                           # c) for x * c in the clip) moved the trajectory; 40 steps: +0.22, and
                           # +0.26 with the old rounding
                           "actor.lr=1e-3", "trainer.total_steps=40"],
                tmp_path / "out")
    assert_rises(train_rows(tmp_path / "out", "rollout/reward"), by=0.1)
    assert all(t == 2 for t in train_rows(tmp_path / "out", "rollout/turns"))
    traj = json.loads((tmp_path / "out" / "run" / "rollouts" / "step1.jsonl").read_text().splitlines()[0])
    assert traj["num_sequences"] == 1 and [t["new_sequence"] for t in traj["turns"][:1]] == [False]
    assert traj["turns"][0]["env_text"].startswith("\n<|im_start|>user\nWhat is")


def test_resume_after_crash_repeats_the_straight_run(assets, tmp_path):
    # PPO with everything that carries state: critic, reference model, 2 mini-batches, TIS.
    args = [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={ANSWER_MATCH}",
            "actor.lr=1e-3", "critic.lr=1e-3", "adv.estimator=gae", "kl.coef=0.05",
            "actor.update_per_rollout=2", "actor.tis_coef=2.0", "actor.rollout.prompts_per_rollout=8",
            "actor.rollout.train_sampling_params.max_new_tokens=6", "actor.scheduler=cosine",
            "trainer.total_steps=4"]
    straight = tmp_path / "straight"
    run_trainer("ppo", 2, args, straight)
    resumed = tmp_path / "resumed"
    # Killed after step 3, checkpoint at step 2: step 3 is replayed after the resume.
    proc = run_trainer("ppo", 2, args + ["trainer.save_freq=2"], resumed,
                       crash_after_log_step=3, check=False)
    assert proc.returncode != 0 and (resumed / "run" / "latest").read_text() == "step2"
    assert (resumed / "run" / "rollouts" / "step3.jsonl").exists()
    run_trainer("ppo", 2, args + ["trainer.load_ckpt_from=latest"], resumed)
    want = {r["step"]: r for r in read_metrics(straight) if "rollout/reward" in r}
    got = {r["step"]: r for r in read_metrics(resumed) if "rollout/reward" in r}
    # every step once in the metrics and the dumps (the crashed run's step 3 was dropped)
    assert [r["step"] for r in read_metrics(resumed) if "rollout/reward" in r] == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("rollout/reward", "rollout/response_length", "adv/mean", "actor/loss",
                    "actor/grad_norm", "actor/lr", "critic/value_loss", "critic/grad_norm"):
            assert math.isclose(got[step][key], want[step][key], rel_tol=1e-6, abs_tol=1e-9), (step, key)
    for name in ("step3.jsonl", "step4.jsonl"):
        assert (resumed / "run" / "rollouts" / name).read_text() == \
            (straight / "run" / "rollouts" / name).read_text()


RESET_ENV = '''
async def reset(extra_info):
    return "<|im_start|>user\\nWhat is " + extra_info["question"] + "?<|im_end|>\\n<|im_start|>assistant\\n"


async def step(state, action, extra_info):
    return {"next_state": None, "reward": float(extra_info["answer"] in action), "done": True}
'''


def test_rows_without_prompts_start_from_the_env_reset(assets, tmp_path):
    (tmp_path / "env.py").write_text(RESET_ENV)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for a in range(4):
            f.write(json.dumps({"extra_info": {"question": f"{a} plus 1", "answer": str(a + 1)}}) + "\n")
    run_trainer("ppo", 1, [f"actor.model_name={assets['model']}", f"data.train.path={tmp_path / 'rows.jsonl'}",
                           f"actor.rollout.env_path={tmp_path / 'env.py'}", "actor.rollout.prompts_per_rollout=4",
                           "actor.rollout.train_sampling_params.max_new_tokens=4", "trainer.total_steps=1"],
                tmp_path / "out")
    dump = tmp_path / "out" / "run" / "rollouts" / "step1.jsonl"
    trajs = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(trajs) == 16 and not any(t["failed"] for t in trajs)
    assert {t["prompt"] for t in trajs} == {f"<|im_start|>user\nWhat is {a} plus 1?<|im_end|>\n<|im_start|>assistant\n"
                                           for a in range(4)}
    # README's token metrics: train/tokens = every input token of the step's sequences (prompt,
    # counted with the tokenizer, + action, all but the last), train/loss_tokens = the action
    # tokens: the generated ones, max_new_tokens=4 exactly when generation was cut by length.
    (r,) = [r for r in read_metrics(tmp_path / "out") if "train/tokens" in r]
    actions = [t["num_action_tokens"] for t in trajs]
    for t, n in zip(trajs, actions):
        assert n == 4 if t["turns"][0]["finish_reason"] == "length" else 1 <= n <= 4, (t["turns"], n)
    assert r["train/loss_tokens"] == sum(actions) == r["rollout/train_tokens"]
    tok = assets["tokenizer"]
    assert r["train/tokens"] == sum(len(tok.encode(t["prompt"], add_special_tokens=False)) + n - 1
                                    for t, n in zip(trajs, actions))
    assert math.isclose(r["train/tokens_per_s"], r["train/tokens"] / r["time/step"], rel_tol=1e-12)


# ----- algorithm presets (README table): each must raise the reward -----
PRESETS = {
    "gspo": ["actor.policy_loss=gspo", "actor.avg_level=sequence", "actor.clip=3e-4", "actor.clip_high=4e-4",
             "adv.norm_var=true", "actor.update_per_rollout=2"],
    # README's preset. With 2 epochs as well (K epochs: test_ppo_parallel) lr 2e-3 overshot on
    # AMD's oneDNN numerics: first and last 10 steps' reward 0.261 / 0.264 (D's passed by chance)
    # lr 1e-3: at 2e-3 a run rose to 0.55 and collapsed (last 5 steps 0.24, first 5 0.26) after
    # fix 51's rounding moved its trajectory; at 1e-3 +0.30, and +0.27 with the old rounding
    "cispo": ["actor.policy_loss=cispo", "actor.clip=1.0", "actor.clip_high=0.28",
              "actor.update_per_rollout=2", "actor.lr=1e-3"],
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_raises_the_reward(warm_start, tmp_path, preset):
    run_trainer("ppo", 2, rl_args(warm_start, *PRESETS[preset]), tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "rollout/reward" in r]
    assert_rises([r["rollout/reward"] for r in rows])
    # off-policy mini-batches after the first step: the clip is active
    assert max(r["actor/clip_ratio"] for r in rows) > 0


def test_strict_on_policy_passes_a_sound_run(warm_start, tmp_path):
    run_trainer("ppo", 2, rl_args(warm_start, "actor.strict_on_policy=true", "trainer.total_steps=3"), tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "rollout/engine_kl" in r]
    assert len(rows) == 3 and all(abs(r["rollout/engine_kl"]) < 1e-4 for r in rows)


# Breaks the weight sync after the start-up one, as a bug would: the engine drops every later
# update (the stream is still drained: its gathers are collectives) and keeps the old policy.
STALE_SYNC = '''
from RL2.rollout import torch_engine
_update = torch_engine.TorchEngine.update_weights
def update_weights(self, named_tensors):
    if getattr(self, "_updated_once", False):
        for _ in named_tensors:
            pass
        return
    self._updated_once = True
    return _update(self, named_tensors)
torch_engine.TorchEngine.update_weights = update_weights
'''


def test_strict_on_policy_stops_a_run_whose_engine_is_stale(warm_start, tmp_path):
    import os

    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(STALE_SYNC)
    path = os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")])
    proc = run_trainer("ppo", 2, rl_args(warm_start, "actor.strict_on_policy=true", "trainer.total_steps=3",
                                         "actor.rollout.weight_sync=gather"),  # copies: update_weights
                       tmp_path / "out", extra_env={"PYTHONPATH": path}, check=False)
    assert proc.returncode != 0
    assert "strict on-policy check failed at step 2: engine and trainer log-probs differ by" in proc.stderr, \
        proc.stderr[-4000:]


# The env gives no reward; its score (a metric only) says whether the answer is right.
SCORE_ONLY_ENV = '''
import re


async def step(state, action, extra_info):
    numbers = re.findall(r"-?\\d+", action)
    right = float(bool(numbers) and int(numbers[-1]) == int(extra_info["answer"]))
    return {"next_state": None, "reward": 0.0, "score": right, "done": True}
'''


def test_reward_model_trained_by_rl2_is_the_reward_and_rises(warm_start, tmp_path):
    import random

    # 1. RL2.trainer.rm learns to prefer right answers (in the policy's format) over every wrong
    # digit (rejected answers only near the right one left the far ones unranked, and PPO found
    # them) and over the right digit followed by more tokens (no "longer is better")
    rng = random.Random(0)
    for split in ("train", "test"):
        with open(tmp_path / f"pref_{split}.jsonl", "w") as f:
            for line in open(warm_start["data"] / f"ppo_{split}.jsonl"):
                row = json.loads(line)
                a = int(row["extra_info"]["answer"])
                wrong = str(rng.choice([b for b in range(10) if b != a]))
                if rng.random() < 0.4:
                    wrong = f"{a} {wrong}" if rng.random() < 0.5 else f"{a}{rng.randint(0, 9)}"
                f.write(json.dumps({"prompt": row["prompt"], "chosen": str(a), "rejected": wrong}) + "\n")
    run_trainer("rm", 2, [f"actor.model_name={warm_start['model']}", f"data.train.path={tmp_path / 'pref_train.jsonl'}",
                          f"data.test.path={tmp_path / 'pref_test.jsonl'}", "data.train.batch_size=32",
                          "actor.lr=3e-3", "trainer.n_epochs=2", "trainer.test_freq=64"], tmp_path / "rm")
    acc = train_rows(tmp_path / "rm", "test/accuracy")
    assert acc[-1] > 0.8, acc
    # 2. PPO whose only reward is that model's score, on one batch of 16 prompts, so that every
    # step scores the same prompts. The RM's score moves by ~1 between prompts: over fresh
    # prompts each step the mean reward jumped 1.4-3.5 with the draw and hid the trend (an Intel
    # Xeon run rose 2.65 -> 2.78 by medians of 5 steps where AMD ones passed); on one batch it
    # rose 1.88 -> 2.84 almost step by step.
    (tmp_path / "env.py").write_text(SCORE_ONLY_ENV)
    prompts = open(warm_start["data"] / "ppo_train.jsonl").readlines()[:16]
    (tmp_path / "prompts.jsonl").write_text("".join(prompts))
    run_trainer("ppo", 2, [f"actor.model_name={warm_start['model']}",
                           f"data.train.path={tmp_path / 'prompts.jsonl'}",
                           f"actor.rollout.env_path={tmp_path / 'env.py'}", *RL_ARGS,
                           f"actor.rollout.reward_model={tmp_path / 'rm' / 'run' / 'final'}"], tmp_path / "ppo")
    rows = [r for r in read_metrics(tmp_path / "ppo") if "rollout/reward" in r]
    assert all(r["rollout/reward/env"] == 0 for r in rows)
    assert all(math.isclose(r["rollout/reward"], r["rollout/reward/reward_model"], rel_tol=1e-6) for r in rows)
    assert_rises([r["rollout/reward"] for r in rows], by=0.3)  # PPO maximises the RM's score
    # Not asserted: the true answer-match score. This 2-layer RM (held-out pair accuracy > 0.8)
    # does not really know arithmetic, and the policy learns to please it without answering
    # better (reward hacking, as with any RM scored far from its training pairs).


def test_composed_reward_from_config_raises_the_reward_and_logs_components(warm_start, tmp_path):
    env = str(Path(__file__).resolve().parents[1] / "envs" / "composed_reward.py")
    run_trainer("ppo", 2, [f"actor.model_name={warm_start['model']}",
                           f"data.train.path={warm_start['data'] / 'ppo_train.jsonl'}", f"actor.rollout.env_path={env}",
                           *RL_ARGS, "+actor.rollout.env_args.rewards={answer_match: 1.0, length_penalty: 0.5}",
                           "+actor.rollout.env_args.length_limit=20"], tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "rollout/reward" in r]
    for r in rows:  # reward = 1.0 * answer_match + 0.5 * length_penalty, each component logged
        want = r["rollout/reward/answer_match"] + 0.5 * r["rollout/reward/length_penalty"]
        assert math.isclose(r["rollout/reward"], want, rel_tol=1e-9, abs_tol=1e-12)
        assert r["rollout/score"] == r["rollout/reward/answer_match"] and r["rollout/reward/length_penalty"] < 0
    assert_rises([r["rollout/reward"] for r in rows])
