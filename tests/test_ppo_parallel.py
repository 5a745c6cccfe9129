"""Parallel == serial for a PPO update (actor + critic) on a FIXED rollout batch.

One 1-process launch is the reference; a 2-process launch runs FSDP2 and SP2, a 4-process launch
(slow) runs DDP2 x FSDP2, DP2 x SP2 and TP2 x DP2, each on fresh workers. Every layout must reproduce
the reference's loss, clip/entropy/KL metrics and grad norms, and the log-probs / values of the
updated models (which depend on every parameter after two optimizer steps), in float64 (rtol
1e-10) and float32 (rtol 1e-5).
All loss terms are switched on: clip-higher, dual clip, TIS, k3 KL loss, entropy bonus, value
clipping, two mini-batches, token- and sequence-level averaging.
GSPO (sequence ratio: its per-sequence sums cross sp ranks) and CISPO (with two epochs) run the
actor update only, in float64, on every layout of the same launches.
"""
import math

import pytest
import torch

from tests.dist_utils import run_dist
from tests.run_utils import LAYOUTS, fixed_batch, layout

BASE = [
    "data.train.path=unused", "actor.rollout.env_path=unused", "actor.lr=1e-3", "critic.lr=1e-3",
    "actor.clip=0.2", "actor.clip_high=0.28", "actor.dual_clip=1.5", "actor.tis_coef=2.0",
    "actor.entropy_coef=0.01", "kl.coef=0.1", "kl.type=loss", "kl.loss_estimator=k3",
    "actor.update_per_rollout=2", "critic.clip=0.05", "actor.max_grad_norm=null",
    "critic.max_grad_norm=null",
]
# The layouts (tests/run_utils.LAYOUTS) and each one's per-device token budget (None: the default,
# one micro-batch per step for the serial reference).
BUDGETS = {"serial": None, "fsdp2": 64, "sp2": 40, "ddp2xfsdp2": 64, "dp2xsp2": 40, "tp2xfsdp2": 48}


def names(world_size: int) -> list[str]:
    return [name for name in BUDGETS if LAYOUTS[name][0] == world_size]


DTYPES = {"float64": 1e-10, "float32": 1e-5}
VARIANTS = {  # on top of BASE; clips chosen so that some sequences / weights are clipped, some not
    "gspo": ["actor.policy_loss=gspo", "actor.clip=0.05", "actor.clip_high=0.05", "actor.avg_level=sequence"],
    "cispo": ["actor.policy_loss=cispo", "actor.clip=1.0", "actor.clip_high=0.1", "actor.dual_clip=null",
              "actor.update_epochs=2", "actor.avg_level=token"],
}
# Both loss normalisations, without doubling the launches: float64 runs the actor at sequence
# level (DeepSeek GRPO) and the critic at token level, float32 the other way round.
AVG_LEVELS = {"float64": ["actor.avg_level=sequence", "critic.avg_level=token"],
              "float32": ["actor.avg_level=token", "critic.avg_level=sequence"]}


def _update_every_layout(rank, world_size, model_path):
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor
    from RL2.workers.critic import Critic
    from RL2.algorithms.ppo import actor_update, critic_update

    torch.set_num_threads(1)
    results = {}
    for name in names(world_size):
        for dtype in DTYPES:
            overrides = [o for w in ("actor", "critic")
                         for o in layout(name, BUDGETS[name], w)[1] + [f"{w}.dtype={dtype}"]]
            cfg = load_config("ppo", BASE + [f"actor.model_name={model_path}"] + overrides + AVG_LEVELS[dtype])
            actor = Actor(cfg.actor, "cpu", total_steps=4, seed=0)
            critic = Critic(cfg.critic, "cpu", total_steps=4, seed=0)
            samples = fixed_batch(actor.config.vocab_size)
            out = {f"actor/{k}": v for k, v in actor_update(actor, samples, cfg.actor, cfg.kl, seed=1).items()}
            out.update({f"critic/{k}": v for k, v in critic_update(critic, samples, cfg.critic, seed=1).items()})
            # The updated models, read out on the whole batch.
            logps = actor.compute_logps(samples)
            values = critic.compute_values(samples)
            out["after/logps"] = sum((lp.double() * s["action_mask"]).sum().item() for lp, s in zip(logps, samples))
            out["after/values"] = sum((v.double() * s["action_mask"]).sum().item() for v, s in zip(values, samples))
            results[(name, dtype)] = out
            del actor, critic
        for variant, extra in VARIANTS.items():
            overrides = layout(name, BUDGETS[name])[1] + ["actor.dtype=float64"]
            cfg = load_config("ppo", BASE + [f"actor.model_name={model_path}"] + overrides + extra)
            actor = Actor(cfg.actor, "cpu", total_steps=4, seed=0)
            samples = fixed_batch(actor.config.vocab_size)
            out = {f"actor/{k}": v for k, v in actor_update(actor, samples, cfg.actor, cfg.kl, seed=1).items()}
            logps = actor.compute_logps(samples)
            out["after/logps"] = sum((lp.double() * s["action_mask"]).sum().item() for lp, s in zip(logps, samples))
            results[(name, variant)] = out
            del actor
    return results


@pytest.fixture(scope="module")
def launches(assets):
    """launches[world_size]: rank 0's results, one launch per world size, on first use."""
    class Lazy(dict):
        def __missing__(self, w):
            self[w] = run_dist(_update_every_layout, w, assets["model"], timeout=900)[0]
            return self[w]
    return Lazy()


def test_the_update_exercises_every_loss_term(launches):
    for dtype in DTYPES:
        ref = launches[1][("serial", dtype)]
        assert ref["actor/clip_ratio"] > 0.02 and ref["actor/dual_clip_ratio"] > 0
        assert ref["critic/value_clip_ratio"] > 0.02 and ref["actor/kl_loss"] > 0
        assert ref["actor/entropy"] > 0 and ref["actor/grad_norm"] > 0


def test_gspo_and_cispo_updates_clip_some_tokens_not_all(launches):
    for variant in VARIANTS:
        ref = launches[1][("serial", variant)]
        assert 0.05 < ref["actor/clip_ratio"] < 0.95 and ref["actor/grad_norm"] > 0, (variant, ref)


@pytest.mark.parametrize("world_size,name", [(2, n) for n in names(2)] + [
    pytest.param(4, n, marks=pytest.mark.slow) for n in names(4)])
@pytest.mark.parametrize("dtype", list(DTYPES) + list(VARIANTS))
def test_parallel_update_equals_serial(launches, world_size, name, dtype):
    ref, got = launches[1][("serial", dtype)], launches[world_size][(name, dtype)]
    assert sorted(got) == sorted(ref)
    for key in ref:
        if key.endswith("lr"):
            continue
        rtol = DTYPES.get(dtype, DTYPES["float64"])
        # abs_tol guards metrics that are sums of terms of both signs (losses near 0)
        assert math.isclose(got[key], ref[key], rel_tol=rtol, abs_tol=rtol * 1e-2), \
            f"{name} {dtype} {key}: {got[key]} vs serial {ref[key]}"
