"""PPO trainer pieces, in process: advantages over multi-turn trajectories (hand-computed),
overlong shaping, filtering / refill / failure budget of a rollout, config checks."""
import json
import math

import pytest
import torch

from RL2.rollout import rollout as rollout_mod
from RL2.rollout.rollout import Rollout, shape_overlong
from RL2.rollout.trajectory import Trajectory
from RL2.trainer.ppo import check_config
from RL2.algorithms.ppo import compute_advantages, mini_batches
from tests.run_utils import cfg_with, run_trainer, train_rows


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def sample(mask, rewards, values=None, **extra):
    s = {"action_mask": t(*mask), "rewards": t(*rewards), "input_ids": torch.zeros(len(mask), dtype=torch.long)}
    if values is not None:
        s["values"] = t(*values)
    return dict(s, **{k: t(*v) for k, v in extra.items()})


def multi_turn_batch():
    """Trajectory 0 = two sequences: A (prompt, turn 1, env tokens, turn 2 -- merged) and B (a new
    sequence after a non-extending state, turn 3); trajectory 1 = one sequence C. Values of
    non-action positions are 9 so that any leak into GAE shows."""
    a = sample([0, 0, 1, 1, 0, 0, 1], [0, 0, 0, 0.5, 0, 0, 0], [9, 9, 0.1, 0.2, 9, 9, 0.3])
    b = sample([0, 1, 1], [0, 0, 1.0], [9, 0.4, 0.5])
    c = sample([0, 1, 1, 1], [0, 0, 0, 0.5], [9, 0.6, 0.7, 0.8])
    return [a, b, c], [0, 0, 1]


def test_gae_chains_the_sequences_of_a_trajectory_and_skips_env_tokens():
    samples, owner = multi_turn_batch()
    cfg = cfg_with("adv.estimator=gae", "adv.gamma=0.9", "adv.lamda=0.8")
    out, metrics = compute_advantages(samples, owner, 2, 1, cfg.adv, cfg.kl)
    # Action chain of trajectory 0: r = [0, .5, 0, 0, 1], V = [.1, .2, .3, .4, .5], V_next ends at 0.
    # deltas = [.08, .57, .06, .05, .5]; A_k = delta_k + .72 * A_{k+1}:
    a0 = [0.67453568, 0.825744, 0.3552, 0.41, 0.5]
    expected_a = [0, 0, a0[0], a0[1], 0, 0, a0[2]]
    expected_b = [0, a0[3], a0[4]]
    # Trajectory 1: r = [0, 0, .5], V = [.6, .7, .8]: deltas = [.03, .02, -.3]
    a1 = [0.03 + 0.72 * (0.02 + 0.72 * -0.3), 0.02 + 0.72 * -0.3, -0.3]
    for o, want, s in zip(out, [expected_a, expected_b, [0] + a1], samples):
        assert torch.allclose(o["advantages"], t(*want), atol=1e-6), (o["advantages"], want)
        ret = torch.where(s["action_mask"].bool(), t(*want) + s["values"], 0.0)
        assert torch.allclose(o["returns"], ret, atol=1e-6)
    assert set(metrics) >= {"adv/mean", "adv/std", "adv/values", "adv/returns", "adv/explained_var"}


@pytest.mark.parametrize("estimator,norm_var,expected", [
    ("reinforce", False, [0.5, -0.5]),                      # Dr. GRPO: score - group mean
    ("reinforce", True, [0.5 / (0.5 ** 0.5 + 1e-6), -0.5 / (0.5 ** 0.5 + 1e-6)]),  # GRPO: / std
    ("rloo", False, [1.0, -1.0]),                           # score - mean of the others
])
def test_outcome_advantage_reaches_every_action_token_of_every_sequence(estimator, norm_var, expected):
    samples, owner = multi_turn_batch()  # trajectory scores 1.5 and 0.5, one group of two
    cfg = cfg_with(f"adv.estimator={estimator}", f"adv.norm_var={norm_var}")
    out, _ = compute_advantages(samples, owner, 2, 1, cfg.adv, cfg.kl)
    for o, s, own in zip(out, samples, owner):
        assert torch.allclose(o["advantages"], expected[own] * s["action_mask"], atol=1e-6)
        assert "returns" not in o


def test_kl_in_the_reward_lowers_the_trajectory_score():
    samples, owner = multi_turn_batch()
    # k1 per action token = old - ref = 1 on trajectory 0's 5 action tokens, 0 on trajectory 1's.
    samples = [dict(s, old_logps=torch.full_like(s["rewards"], -1.0),
                    ref_logps=torch.full_like(s["rewards"], -2.0 if o == 0 else -1.0))
               for s, o in zip(samples, owner)]
    cfg = cfg_with("kl.coef=0.1", "kl.type=reward", "kl.reward_estimator=k1")
    out, metrics = compute_advantages(samples, owner, 2, 1, cfg.adv, cfg.kl)
    # scores 1.5 - 0.5 = 1.0 and 0.5: mean 0.75
    assert torch.allclose(out[0]["advantages"], 0.25 * samples[0]["action_mask"], atol=1e-6)
    assert torch.allclose(out[2]["advantages"], -0.25 * samples[2]["action_mask"], atol=1e-6)
    assert math.isclose(metrics["adv/kl_reward"], 2.5, rel_tol=1e-6)  # 5 tokens / 2 trajectories


def test_global_norm_whitens_over_action_tokens():
    samples, owner = multi_turn_batch()
    cfg = cfg_with("adv.estimator=gae", "adv.global_norm=true")
    out, _ = compute_advantages(samples, owner, 2, 1, cfg.adv, cfg.kl)
    on = torch.cat([s["action_mask"] for s in samples]).bool()
    adv = torch.cat([o["advantages"] for o in out])
    assert abs(adv[on].mean().item()) < 1e-6 and math.isclose(adv[on].std().item(), 1.0, rel_tol=1e-5)
    assert (adv[~on] == 0).all()


def test_mini_batches_partition_the_batch_identically_for_a_seed():
    batches = mini_batches(list(range(10)), 3, seed=4)
    assert sorted(x for b in batches for x in b) == list(range(10)) and len(batches) == 3
    assert batches == mini_batches(list(range(10)), 3, seed=4)


def test_overlong_shaping_per_turn():
    traj = Trajectory(uid="u", reward=1.0)
    # turn 1: 5 action tokens, env tokens, turn 2: 3 action tokens; limit 6 with a buffer of 4
    # -> penalties start above 2 tokens: 0.5 * 3/4 and 0.5 * 1/4, on each turn's last token.
    traj.samples = [sample([0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], [0] * 11)]
    total = shape_overlong(traj, max_new_tokens=6, buffer=4, penalty=0.5)
    assert math.isclose(total, 0.5, rel_tol=1e-6) and math.isclose(traj.reward, 0.5, rel_tol=1e-6)
    expected = [0] * 11
    expected[5], expected[10] = -0.375, -0.125
    assert torch.allclose(traj.samples[0]["rewards"], t(*expected))


# ----- rollout scheduling, with a scripted _generate (no engine) -----
def fake_rollout(cfg, table, calls):
    """table[index] = list of (reward, error or None) per response."""
    r = Rollout.__new__(Rollout)
    r.cfg = cfg.actor.rollout

    def generate(prompts, params_cfg, n, tag):
        calls.append((tag, [p["index"] for p in prompts]))
        groups = []
        for p in prompts:
            g = []
            for j, (reward, error) in enumerate(table[p["index"]][:n]):
                traj = Trajectory(uid=f"{tag}-{p['index']}-{j}", reward=reward, score=reward,
                                  failed=error is not None, error=error, num_turns=1,
                                  extra_info={"data_source": "src"})
                traj.samples = [sample([0, 1], [0, reward])]
                g.append(traj)
            groups.append(g)
        return groups

    r._generate = generate
    return r


def test_dynamic_filtering_refills_and_failed_groups_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_mod.dist, "get_rank", lambda: 0)
    cfg = cfg_with("actor.rollout.prompts_per_rollout=2", "actor.rollout.responses_per_prompt=2",
                   "actor.rollout.dynamic_filtering=true", "actor.rollout.max_refill_tries=3")
    table = {0: [(1, None), (1, None)],          # all equal: filtered
             1: [(1, None), (0, None)],          # kept
             2: [(0, None), (1, "step (turn 0): ValueError: boom")],  # a failure: dropped
             3: [(0, None), (1, None)],          # kept (second batch)
             4: [(0, None), (0, None)]}
    batches = [[0, 1], [2, 3], [4, 1]]
    calls = []
    r = fake_rollout(cfg, table, calls)
    dump = tmp_path / "step1.jsonl"
    groups, m = r.run(lambda k: [{"index": i} for i in batches[k]], step=0, dump_path=str(dump))
    assert [tag for tag, _ in calls] == ["train0", "train0.1"]  # refill tags give new seeds
    assert [g[0].uid.split("-")[1] for g in groups] == ["1", "3"]
    assert (m["filtered_groups"], m["failed_groups"], m["rollout_tries"], m["failed"]) == (1, 1, 2, 1)
    assert m["src/mean@2"] == pytest.approx(5 / 8) and m["src/pass@2"] == 1.0
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [r["group_status"] for r in rows] == ["filtered"] * 2 + ["kept"] * 2 + ["failed"] * 2 + ["kept"] * 2
    assert rows[5]["error"] == "step (turn 0): ValueError: boom" and rows[5]["failed"]


def test_refills_are_bounded_and_failures_over_budget_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_mod.dist, "get_rank", lambda: 0)
    cfg = cfg_with("actor.rollout.prompts_per_rollout=1", "actor.rollout.responses_per_prompt=2",
                   "actor.rollout.dynamic_filtering=true", "actor.rollout.max_refill_tries=2")
    calls = []
    r = fake_rollout(cfg, {0: [(1, None), (1, None)]}, calls)
    groups, m = r.run(lambda k: [{"index": 0}], step=3)
    assert groups == [] and len(calls) == 3 and m["filtered_groups"] == 3

    cfg = cfg_with("actor.rollout.responses_per_prompt=2", "actor.rollout.max_failed_ratio=0.4")
    ok = {0: [(0, None), (0, "step (turn 0): EnvTimeout: hung")], 1: [(0, None), (1, None)]}
    groups, m = fake_rollout(cfg, ok, []).run(lambda k: [{"index": 0}, {"index": 1}], step=0)
    assert len(groups) == 1 and m["failed"] == 1  # 1/4 failed: within budget, its group dropped
    r = fake_rollout(cfg, {0: [(0, "step (turn 0): EnvTimeout: hung"), (0, "step: EnvError: bad dict")],
                           1: [(0, None), (1, None)]}, [])
    dump = tmp_path / "stop.jsonl"
    with pytest.raises(RuntimeError, match=r"2/4 trajectories failed.*max_failed_ratio=0.4(.|\n)*hung"):
        r.run(lambda k: [{"index": 0}, {"index": 1}], step=0, dump_path=str(dump))
    assert "bad dict" in dump.read_text()  # the dump is written before the run stops


@pytest.mark.parametrize("overrides,message", [
    (["adv.estimator=grpo"], "adv.estimator"),
    (["kl.type=both"], "kl.type"),
    (["kl.loss_estimator=k4"], "kl.loss_estimator"),
    (["actor.dual_clip=0.5"], "actor.dual_clip"),
    (["actor.freeze_steps=3"], "needs adv.estimator=gae"),
    (["adv.estimator=rloo", "actor.rollout.responses_per_prompt=1"], "rloo"),
    (["actor.rollout.dynamic_filtering=true", "actor.rollout.responses_per_prompt=1"], "dynamic_filtering"),
    (["actor.rollout.max_length=9000"], "actor.max_length_per_device"),
    (["adv.estimator=gae", "critic.max_length_per_device=100"], "critic.max_length_per_device"),
    (["actor.rollout.overlong_buffer=200"], "overlong_buffer"),
    (["actor.rollout.weight_sync=nccl"], "actor.rollout.weight_sync"),
    (["actor.rollout.bucket_mb=0"], "actor.rollout.bucket_mb"),
    (["actor.policy_loss=grpo"], "actor.policy_loss"),
    (["actor.policy_loss=cispo", "actor.dual_clip=3"], "actor.dual_clip"),
    (["actor.update_epochs=0"], "actor.update_epochs"),
    (["actor.rollout.pass_k=[1,4]", "actor.rollout.test_responses_per_prompt=2"], "actor.rollout.pass_k"),
    (["actor.strict_on_policy=true", "actor.update_epochs=2"], "strict_on_policy needs an on-policy"),
    (["actor.strict_on_policy=true", "actor.update_per_rollout=2"], "strict_on_policy needs an on-policy"),
    (["actor.rollout.max_staleness=1", "actor.rollout.engine=vllm"], "needs actor.rollout.engine=torch"),
    (["actor.rollout.torch.cpu_matmul=mkl"], "actor.rollout.torch.cpu_matmul='mkl'"),
    (["actor.rollout.torch.small_gemm=maybe"], "actor.rollout.torch.small_gemm='maybe'"),
    (["actor.rollout.tp_size=0"], "actor.rollout.tp_size=0"),
    (["actor.rollout.tp_size=all"], "actor.rollout.tp_size='all'"),
    (["actor.rollout.max_staleness=1", "actor.rollout.tp_size=2"], "tp_size=1 or auto"),
    (["actor.rollout.responses_per_prompt=0"], r"actor.rollout.responses_per_prompt=0 must be an integer >= 1"),
    (["actor.rollout.prompts_per_rollout=0"], r"actor.rollout.prompts_per_rollout=0 must be an integer >= 1"),
    (["actor.rollout.max_turns=0"], r"actor.rollout.max_turns=0 must be an integer >= 1"),
    (["actor.rollout.train_sampling_params.max_new_tokens=0"], r"train_sampling_params.max_new_tokens must be"),
    (["actor.rollout.test_sampling_params.temperature=-1"], r"test_sampling_params.temperature must be >= 0"),
    (["actor.rollout.train_sampling_params.top_p=0"], r"train_sampling_params.top_p must be in \(0, 1\]"),
    (["actor.rollout.test_sampling_params.top_p=1.5"], r"test_sampling_params.top_p must be in \(0, 1\]"),
    (["actor.rollout.train_sampling_params.top_k=-2"], r"train_sampling_params.top_k must be an int >= -1"),
])
def test_bad_configs_stop_with_the_key_to_change(overrides, message):
    with pytest.raises(SystemExit, match=message):
        check_config(cfg_with(*overrides))


THREE_TURN_ENV = '''
async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0)
    info = {**extra_info, "turn": turn + 1}
    if turn == 0:  # extends state + action: same sequence, env tokens masked
        return {"next_state": state + action + " env says hi", "reward": 0.25, "done": False, "extra_info": info}
    if turn == 1:  # does not extend: a new sequence of the same trajectory
        return {"next_state": "a brand new state", "reward": 0.5, "done": False, "extra_info": info}
    return {"next_state": None, "reward": 1.0, "done": True}
'''


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of the runs of 1s."""
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_multi_turn_samples_from_a_real_engine_mask_env_tokens(assets, tmp_path):
    import asyncio

    from RL2.data.formats import tokenize_prompt
    from RL2.rollout.engine import SamplingParams
    from RL2.rollout.env import load_env
    from RL2.rollout.torch_engine import TorchEngine
    from RL2.rollout.trajectory import run_trajectory

    (tmp_path / "env.py").write_text(THREE_TURN_ENV)
    tok, env = assets["tokenizer"], load_env(str(tmp_path / "env.py"))
    engine = TorchEngine(assets["model"], tok)
    prompt = tokenize_prompt({"prompt": "What is 1 plus 2?"}, tok)
    traj = asyncio.run(run_trajectory(engine, tok, env, prompt, SamplingParams(max_new_tokens=3, seed=1),
                                      max_turns=3, uid="u"))
    engine.shutdown()
    first, second = traj.samples
    actions = [turn["action"] for turn in traj.turns]
    # Sequence 1: prompt, action 1, env text, action 2; sequence 2: new state, action 3.
    (a1, e1), (a2, e2) = runs(first["action_mask"])
    assert a1 == len(prompt["prompt_ids"]) - 1 and e2 == len(first["labels"])
    assert tok.decode(first["labels"][a1:e1]) == actions[0] and tok.decode(first["labels"][a2:e2]) == actions[1]
    assert first["labels"][e1:a2].tolist() == tok.encode(" env says hi", add_special_tokens=False)
    [(a3, e3)] = runs(second["action_mask"])
    assert second["input_ids"][:a3 + 1].tolist() == tok.encode("a brand new state", add_special_tokens=False)
    assert tok.decode(second["labels"][a3:e3]) == actions[2] and e3 == len(second["labels"])
    assert first["rewards"][e1 - 1] == 0.25 and first["rewards"][e2 - 1] == 0.5 and second["rewards"][-1] == 1.0
    assert first["rewards"].sum() == 0.75 and traj.reward == 1.75

    # GAE over the trajectory: non-zero advantages exactly on the action tokens.
    g = torch.Generator().manual_seed(0)
    samples = [dict(s, values=torch.rand(len(s["labels"]), generator=g) + 2) for s in traj.samples]
    cfg = cfg_with("adv.estimator=gae", "adv.gamma=0.9", "adv.lamda=0.9")
    out, _ = compute_advantages(samples, [0, 0], 1, 1, cfg.adv, cfg.kl)
    for o in out:
        assert ((o["advantages"] != 0) == o["action_mask"].bool()).all()
        assert ((o["returns"] != 0) == o["action_mask"].bool()).all()


THREADS_ENV = '''
import torch


async def step(state, action, extra_info):
    # the env's step runs on the rollout's loop, in the process of the engine that generated;
    # the length term gives the groups advantages, so step 2 samples from updated weights
    return {"next_state": None, "reward": 100.0 * torch.get_num_threads() + len(action), "done": True}
'''


def test_rollout_tp_size_auto_is_one_torch_engine_per_host_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(rollout_mod.dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 hosts x 2 ranks
    r = cfg_with().actor.rollout
    assert r.tp_size == "auto" and rollout_mod.group_size(r, "torch", "cpu") == 2
    assert rollout_mod.group_size(r, "torch", "cuda") == 1  # GPUs: an engine per rank
    assert rollout_mod.group_size(r, "vllm", "cpu") == 1 and rollout_mod.group_size(r, "sglang", "cuda") == 1
    for key in ("actor.rollout.max_staleness=1", "actor.rollout.placement=disaggregated"):
        assert rollout_mod.group_size(cfg_with(key).actor.rollout, "torch", "cpu") == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # hosts of unequal sizes: no host-sized groups
    assert rollout_mod.group_size(r, "torch", "cpu") == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not launched by torchrun
    assert rollout_mod.group_size(r, "torch", "cpu") == 1


@pytest.mark.slow
def test_cpu_rollout_group_leader_decodes_with_the_groups_threads(assets, tmp_path):
    # 2 ranks x 1 thread: with actor.rollout.tp_size=2 (and auto, the default, on one host) one
    # torch engine serves both ranks and its leader generates with both ranks' threads; the
    # samples are those of one engine per rank
    (tmp_path / "env.py").write_text(THREADS_ENV)
    args = [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={tmp_path / 'env.py'}", "actor.rollout.prompts_per_rollout=4",
            "actor.rollout.responses_per_prompt=2", "actor.rollout.train_sampling_params.max_new_tokens=6",
            "trainer.total_steps=2", "actor.lr=1e-2",
            # every step's engine log-probs must equal the trainer's: step 2 samples from the
            # weights of update 1, synced to the group's engine
            "actor.strict_on_policy=true"]
    actions = {}
    for tp, threads in ((1, 1), (2, 2), ("auto", 2)):
        run_trainer("ppo", 2, args + [f"actor.rollout.tp_size={tp}"], tmp_path / f"tp{tp}")
        assert train_rows(tmp_path / f"tp{tp}", "actor/grad_norm")[0] > 0  # weights moved
        for step in (1, 2):
            rows = [json.loads(line) for line in (tmp_path / f"tp{tp}" / "run" / "rollouts" /
                                                  f"step{step}.jsonl").read_text().splitlines()]
            assert len(rows) == 8 and {r["reward"] // 100 for r in rows} == {threads}
            actions[tp, step] = [[turn["action"] for turn in r["turns"]] for r in rows]
    for step in (1, 2):
        assert actions[1, step] == actions[2, step] == actions["auto", step]


def test_a_prompt_with_no_room_to_generate_stops_the_run_at_start_up():
    """actor.rollout.max_length below a prompt's length truncated every trajectory of the row at
    once: a run of such rows exited 0 having trained on nothing (found by a hostile-input probe).
    Now the row is named while the data loads (skip_bad_rows skips it: a DataError)."""
    from RL2.data.formats import DataError, tokenize_prompt
    from RL2.tools.make_assets import build_tokenizer

    tok = build_tokenizer()
    row = {"prompt": "What is 3 plus 4?"}
    n = len(tokenize_prompt(row, tok)["prompt_ids"])
    assert tokenize_prompt(row, tok, rollout_length=n + 1)["prompt_ids"]  # one token of room left
    with pytest.raises(DataError, match=rf"train.jsonl row 3: the prompt has {n} tokens, leaving no "
                                        rf"room to generate in actor.rollout.max_length={n}"):
        tokenize_prompt(row, tok, rollout_length=n, row_index=3, source="train.jsonl")
