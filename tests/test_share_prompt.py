"""Shared prompts in a PPO update (`actor.share_prompt`): samples of a group that repeat its
prompt are packed as tails continuing the first (`packing.share_prefixes`). The update and the
log-probs read out after it equal those of the same update with share_prompt=false, and the
shared update is the same on 1 and 2 ranks (FSDP2, TP2).

Not to float64 rounding against share_prompt=false: HF's RMSNorm computes in float32 even in a
float64 model (`hidden_states.to(torch.float32)`), and a shared prompt's gradient is summed
before it rather than after it (one copy instead of a group's), which moves sums by ~1e-8; a
wrong mask or position would move them by > 1e-3. Parallel == serial, both shared, stays tight."""
import math

import pytest
import torch

from tests.dist_utils import run_dist
from tests.run_utils import fixed_batch

BASE = ["data.train.path=unused", "actor.rollout.env_path=unused", "actor.lr=1e-3",
        "actor.clip=0.2", "actor.tis_coef=2.0", "actor.entropy_coef=0.01", "kl.coef=0.1",
        "kl.type=loss", "kl.loss_estimator=k3", "actor.update_per_rollout=2",
        "actor.max_grad_norm=null", "actor.dtype=float64"]
LAYOUTS = {1: {"serial": []}, 2: {"fsdp2": ["actor.max_length_per_device=160"],
                                  "tp2": ["actor.tp_size=2", "actor.max_length_per_device=160"]}}


def grouped_batch(vocab: int, groups: int = 4, size: int = 3, seed: int = 0) -> list[dict]:
    """`groups` prompts (6, 8, 10, ... tokens) with `size` responses each (some with environment
    tokens inside), and per-token advantages / old / ref / engine log-probs around the tiny
    model's scale as in run_utils.fixed_batch; prompt positions hold each sample's own values
    (nothing reads them)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(groups):
        prompt = torch.randint(0, vocab, (6 + 2 * k,), generator=g)
        for i in range(size):
            n = int(torch.randint(6, 20, (1,), generator=g))
            ids = torch.cat([prompt, torch.randint(0, vocab, (n,), generator=g)])
            mask = torch.zeros(len(ids) - 1)
            mask[len(prompt) - 1:] = 1.0  # from the last prompt token: its label is the response's first
            if i == 1:
                mask[len(prompt) + 2:len(prompt) + 4] = 0.0  # environment tokens
            noise = lambda scale: scale * torch.randn(len(mask), generator=g)  # noqa: E731
            old = -math.log(vocab) + noise(0.3)
            samples.append({"input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask,
                            "advantages": noise(1.0) * mask, "old_logps": old,
                            "ref_logps": old + noise(0.2), "engine_logps": old + noise(0.5)})
    return samples


def _updates(rank, world_size, model_path):
    from RL2.algorithms.ppo import actor_update
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor

    torch.set_num_threads(1)
    results = {}
    for name, extra in LAYOUTS[world_size].items():
        for share in ("true", "false"):
            cfg = load_config("ppo", BASE + [f"actor.model_name={model_path}", f"actor.share_prompt={share}"] + extra)
            actor = Actor(cfg.actor, "cpu", total_steps=4, seed=0)
            samples = grouped_batch(actor.config.vocab_size)
            shared = [p for mb in actor.plan(samples) for p in mb.prefix_lens if p]
            assert bool(shared) == (share == "true") and (world_size > 1 or len(shared) in (0, 12)), shared
            out = actor_update(actor, samples, cfg.actor, cfg.kl, seed=1)
            logps = actor.compute_logps(samples)
            assert [len(lp) for lp in logps] == [len(s["input_ids"]) for s in samples]
            out["after/logps"] = sum((lp.double() * s["action_mask"]).sum().item() for lp, s in zip(logps, samples))
            results[(name, share)] = out
            del actor
    return results


@pytest.fixture(scope="module")
def launches(assets):
    return {w: run_dist(_updates, w, assets["model"], timeout=600)[0] for w in (1, 2)}


def test_groups_share_their_prompt():
    from RL2.data.packing import share_prefixes

    samples = grouped_batch(96)
    shared, groups, dropped = share_prefixes(samples, 4096)
    # one prefix sequence per group (appended, index >= 12), then its members, all tails
    assert len(shared) == 16 and sorted(g[0] for g in groups) == [12, 13, 14, 15]
    assert sorted(sorted(g[1:]) for g in groups) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    # each keeps its last prompt token (its label is its own first response token)
    assert dropped == [5 + 2 * (i // 3) for i in range(12)]
    for g in groups:
        p = dropped[g[1]]
        assert torch.equal(shared[g[0]]["input_ids"], samples[g[1]]["input_ids"][:p])
        assert shared[g[0]]["action_mask"].sum() == 0
    for s, t, d in zip(samples, shared, dropped):
        assert torch.equal(t["input_ids"], s["input_ids"][d:]) and t["position_ids"].tolist() == list(range(d, len(s["input_ids"])))
    # the same groups and tails whatever the order of the samples (the old log-probs pass and a
    # shuffled mini-batch must compute every sample the same way)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    again, groups2, dropped2 = share_prefixes([samples[i] for i in perm], 4096)
    assert [dropped2[perm.index(i)] for i in range(12)] == dropped
    for j, i in enumerate(perm):
        assert torch.equal(again[j]["input_ids"], shared[i]["input_ids"])
    # a group holds at most `capacity` tokens: any two of three fit here, not all three
    lengths = [len(s["input_ids"]) for s in samples[:3]]
    _, groups, dropped = share_prefixes(samples[:3], sum(lengths) - 11)
    assert len(groups) == 1 and len(groups[0]) == 3 and sorted(dropped) == [0, 5, 5]
    # fewer than MIN_SHARED_TOKENS in common: no group
    short = [dict(s) for s in samples[:2]]
    short[1]["input_ids"] = torch.cat([short[0]["input_ids"][:3], short[1]["input_ids"][3:] + 1])
    assert share_prefixes(short, 4096)[1] == []


def headed_batch(prompts: int, responses: int, header: int = 20, body: int = 30, response: int = 40):
    """Chat-like samples: every prompt starts with the same `header` tokens (a template's system
    turn), then its own `body`; `responses` samples per prompt, shuffled as a mini-batch is."""
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, 96, (header,), generator=g)
    samples = []
    for _ in range(prompts):
        prompt = torch.cat([head, torch.randint(0, 96, (body,), generator=g)])
        for _ in range(responses):
            ids = torch.cat([prompt, torch.randint(0, 96, (response + 1,), generator=g)])
            mask = torch.zeros(len(ids) - 1)
            mask[len(prompt) - 1:] = 1.0
            samples.append({"input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask})
    order = torch.randperm(len(samples), generator=g).tolist()
    return [samples[i] for i in order], order


def test_prompts_behind_a_common_header_share_their_own_prompt():
    """Every prompt begins with the same header: each group still shares its whole prompt (not
    only the header with the first group), and with dp ranks the groups stay small enough to
    balance (one group of the whole batch would put every token on one rank)."""
    from RL2.data.packing import plan_micro_batches, share_prefixes

    samples, order = headed_batch(4, 4)
    shared, groups, dropped = share_prefixes(samples, 4096)
    prompt_of = [o // 4 for o in order]
    assert sorted(sorted(prompt_of[i] for i in g[1:]) for g in groups) == [[p] * 4 for p in range(4)]
    assert dropped == [49] * 16  # the whole 50-token prompt but its last token

    samples, _ = headed_batch(8, 4)
    shared, groups, _ = share_prefixes(samples, 4096, dp_size=4)
    lengths = [len(s["input_ids"]) for s in shared]
    plan = plan_micro_batches(lengths, 4, 4096, groups=groups)
    per_rank = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert len(groups) == 8 and max(per_rank) <= 1.1 * sum(lengths) / 4, per_rank


def _close(a, b, rtol):
    return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-2)


def test_shared_update_equals_unshared(launches):
    for w, layouts in LAYOUTS.items():
        for name in layouts:
            on, off = launches[w][(name, "true")], launches[w][(name, "false")]
            assert sorted(on) == sorted(off)
            for key in on:
                assert _close(on[key], off[key], 1e-7), f"{name} {key}: shared {on[key]} vs {off[key]}"
    assert launches[1][("serial", "true")]["grad_norm"] > 0


def test_shared_update_parallel_equals_serial(launches):
    ref = launches[1][("serial", "true")]
    for name in LAYOUTS[2]:
        got = launches[2][(name, "true")]
        for key in ref:
            assert _close(got[key], ref[key], 1e-10), f"{name} {key}: {got[key]} vs serial {ref[key]}"


def test_a_ppo_step_with_shared_prompts_equals_one_without(assets, tmp_path):
    """The trainer's whole step on one rollout: reference, critic values, old log-probs (with
    shared prompts: computed on tails, re-padded), a k1 KL in the rewards, GAE, two
    mini-batches. The first step's rollout is the same either way (same engine weights and
    seed), so its update metrics must agree (float64; see the module docstring for 1e-7)."""
    from tests.run_utils import ANSWER_MATCH, read_metrics, run_trainer

    args = [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={ANSWER_MATCH}", "actor.rollout.prompts_per_rollout=4",
            "actor.rollout.responses_per_prompt=4", "actor.rollout.train_sampling_params.max_new_tokens=6",
            "trainer.total_steps=1", "actor.lr=1e-2", "critic.lr=1e-2", "adv.estimator=gae",
            "kl.coef=0.1", "kl.type=reward", "actor.update_per_rollout=2", "actor.dtype=float64",
            "critic.dtype=float64", "actor.rollout.torch.dtype=float64"]
    rows = {}
    for share in ("true", "false"):
        run_trainer("ppo", 1, args + [f"actor.share_prompt={share}"], tmp_path / share)
        rows[share] = next(r for r in read_metrics(tmp_path / share) if "actor/loss" in r)
    on, off = rows["true"], rows["false"]
    keys = [k for k in on if k.split("/")[0] in ("actor", "critic", "adv", "rollout") and isinstance(on[k], float)]
    assert {"actor/loss", "actor/grad_norm", "critic/value_loss", "adv/kl_reward", "rollout/engine_kl"} <= set(keys)
    for k in keys:
        assert _close(on[k], off[k], 1e-7), f"{k}: shared {on[k]} vs {off[k]}"


def test_strict_on_policy_holds_with_shared_prompts(assets, tmp_path):
    """One-token responses, 8 per prompt: many samples are exact copies. The old log-probs (all
    samples in rollout order) and the first update (a shuffled mini-batch) must compute every
    sample the same way, or `strict_on_policy` sees a ratio != 1 (it did, 4.8e-6, when a
    group's first sample was computed whole and the others as its tails: copies swapped roles)."""
    from tests.run_utils import FIRST_WORD_ENV, run_trainer
    from tests.vllm.conftest import tiny_vllm_model  # wide weights: distinct, peaked log-probs

    (tmp_path / "env.py").write_text(FIRST_WORD_ENV)
    model = tiny_vllm_model(assets["tokenizer"], str(tmp_path / "model"))
    run_trainer("ppo", 1, [
        f"actor.model_name={model}", f"data.train.path={assets['data']}/ppo_train.jsonl",
        f"actor.rollout.env_path={tmp_path / 'env.py'}", "actor.lr=1e-3", "actor.rollout.max_length=128",
        "actor.rollout.prompts_per_rollout=16", "actor.rollout.responses_per_prompt=8",
        "actor.rollout.train_sampling_params.max_new_tokens=1", "trainer.total_steps=3",
        "actor.strict_on_policy=true", "actor.share_prompt=true"], tmp_path / "run")
