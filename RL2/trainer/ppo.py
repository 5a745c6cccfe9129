"""PPO / GRPO / REINFORCE with async multi-turn environments.

    torchrun --nproc_per_node=N -m RL2.trainer.ppo actor.model_name=... data.train.path=... \
        actor.rollout.env_path=envs/countdown.py

One step: rollout -> reference log-probs -> values -> old log-probs -> advantages -> actor and
critic updates -> weight sync to the engine.
"""
import os
import time
from contextlib import contextmanager
from functools import partial

import torch

from RL2.algorithms.advantages import apply_kl_to_rewards, compute_gae, outcome_advantages
from RL2.data.formats import tokenize_prompt
from RL2.rollout.env import load_env
from RL2.rollout.rollout import Rollout
from RL2.trainer.base import Trainer
from RL2.utils.config import load_config
from RL2.workers.actor import Actor
from RL2.workers.ppo_update import actor_update, critic_update


@contextmanager
def timed(timings: dict, name: str):
    start = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - start


class PPOTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        r, d = cfg.actor.rollout, cfg.data.train
        # Cheap checks first: a broken env script or data file stops the run before any model loads.
        self.env = load_env(r.env_path, dict(r.env_args), r.env_timeout)
        tokenize = partial(tokenize_prompt, tokenizer=self.tokenizer, prompt_key=d.prompt_key,
                           messages_key=d.messages_key, apply_chat_template=d.apply_chat_template,
                           max_length=d.max_length, prompt_required=self.env.has_reset)
        self.train_prompts, self.test_prompts = [self._index(p) for p in self.load_splits(tokenize)]
        self.n_steps = self.total_steps(len(self.train_prompts), r.prompts_per_rollout)
        seed = cfg.trainer.seed
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=seed)
        self.ref = Actor(cfg.actor, self.device, train=False, seed=seed) if cfg.kl.coef > 0 else None
        self.critic = None
        if cfg.adv.estimator == "gae":
            from RL2.workers.critic import Critic

            self.critic = Critic(cfg.critic, self.device, value_head=True,
                                 total_steps=self.n_steps, seed=seed)
        self.rollout = Rollout(r, self.tokenizer, self.env, cfg.actor.model_name, self.device, seed)
        self.maybe_resume()
        self.rollout.sync(self.actor.model)  # the engine serves exactly the trainer's weights

    @staticmethod
    def _index(prompts: list[dict]) -> list[dict]:
        for i, p in enumerate(prompts):
            p["index"] = i
            if p.get("data_source") is not None:
                p["extra_info"].setdefault("data_source", p["data_source"])
        return prompts

    def trained_workers(self):
        workers = {"actor": self.actor}
        if self.critic is not None:
            workers["critic"] = self.critic
        return workers

    def prompts_for(self, step: int, k: int) -> list[dict]:
        """Prompts of a step: the sampler's batch, then (k > 0, refills after dynamic filtering)
        further prompts drawn deterministically from (seed, step, k)."""
        if k == 0:
            idx = self.sampler.batch(step)
        else:
            g = torch.Generator().manual_seed(self.cfg.trainer.seed * 7919 + step * 131 + k)
            idx = torch.randperm(len(self.train_prompts), generator=g)[
                :self.cfg.actor.rollout.prompts_per_rollout].tolist()
        return [self.train_prompts[i] for i in idx]

    # ----- the algorithm -----
    def train_step(self, step: int) -> dict:
        cfg, timings = self.cfg, {}
        temperature = cfg.actor.rollout.train_sampling_params.temperature or 1.0
        with timed(timings, "rollout"):
            groups, rollout_metrics = self.rollout.run(partial(self.prompts_for, step), step)
            self.rollout.release()
        if cfg.actor.rollout.dump_rollouts:
            self.rollout.dump(groups, os.path.join(self.run_dir, "rollouts", f"step{step + 1}.jsonl"))
        samples, owner = [], []
        for t_index, traj in enumerate(t for g in groups for t in g):
            samples.extend(traj.samples)
            owner.extend([t_index] * len(traj.samples))
        metrics = {f"rollout/{k}": v for k, v in rollout_metrics.items()}
        if not any(s["action_mask"].sum() > 0 for s in samples):
            with timed(timings, "sync"):
                self.rollout.sync(self.actor.model)
            return {**metrics, **timings}

        if self.ref is not None:
            with timed(timings, "ref_logps"):
                ref_logps = self.ref.compute_logps(samples, temperature)
            samples = [dict(s, ref_logps=lp) for s, lp in zip(samples, ref_logps)]
        if self.critic is not None:
            with timed(timings, "values"):
                values = self.critic.compute_values(samples)
            samples = [dict(s, values=v) for s, v in zip(samples, values)]
        kl_reward = cfg.kl.coef > 0 and cfg.kl.type == "reward"
        if cfg.actor.update_per_rollout > 1 or cfg.actor.tis_coef or kl_reward:
            with timed(timings, "old_logps"):
                old = self.actor.compute_logps(samples, temperature)
            samples = [dict(s, old_logps=lp) for s, lp in zip(samples, old)]
            metrics["rollout/engine_kl"] = engine_kl(samples)
        with timed(timings, "advantages"):
            samples, adv_metrics = self.advantages(samples, owner, len(groups), kl_reward)
        metrics.update(adv_metrics)

        with timed(timings, "update"):
            if self.critic is not None:
                metrics.update({f"critic/{k}": v for k, v in
                                critic_update(self.critic, samples, cfg.critic, cfg.trainer.seed + step).items()})
            if step >= cfg.actor.freeze_steps:
                metrics.update({f"actor/{k}": v for k, v in
                                actor_update(self.actor, samples, cfg.actor, cfg.kl, cfg.trainer.seed + step).items()})
        with timed(timings, "sync"):
            self.rollout.sync(self.actor.model)
        timings["time/step"] = sum(timings.values())
        return {**metrics, **timings}

    def advantages(self, samples, owner, n_prompts, kl_reward) -> tuple[list[dict], dict]:
        cfg = self.cfg
        rewards = [s["rewards"] for s in samples]
        if kl_reward:
            rewards = [apply_kl_to_rewards(r, s["old_logps"], s["ref_logps"], s["action_mask"],
                                           cfg.kl.coef, cfg.kl.reward_estimator)
                       for r, s in zip(rewards, samples)]
        if cfg.adv.estimator == "gae":
            out = []
            for s, r in zip(samples, rewards):
                adv, ret = compute_gae(r, s["values"], s["action_mask"], cfg.adv.gamma, cfg.adv.lamda)
                out.append(dict(s, advantages=adv, returns=ret))
        else:
            n_traj = max(owner) + 1
            scores = torch.zeros(n_traj, dtype=torch.float64)
            for o, r in zip(owner, rewards):
                scores[o] += r.double().sum()
            per_traj = outcome_advantages(scores.view(n_prompts, -1), cfg.adv.estimator,
                                          norm_var=cfg.adv.norm_var).flatten()
            out = [dict(s, advantages=per_traj[o].item() * s["action_mask"].float())
                   for s, o in zip(samples, owner)]
        masks = torch.cat([s["action_mask"] for s in out]).bool()
        adv = torch.cat([s["advantages"] for s in out])[masks]
        return out, {"adv/mean": adv.mean().item(), "adv/std": adv.std().item() if adv.numel() > 1 else 0.0}

    def evaluate(self) -> dict:
        if not self.test_prompts:
            return {}
        _, metrics = self.rollout.run(lambda k: self.test_prompts, self.step, train=False)
        return {f"test/{k}": v for k, v in metrics.items()}

    def close(self):
        self.rollout.shutdown()
        super().close()


def engine_kl(samples) -> float:
    """Mean (trainer - engine) log-prob gap on action tokens: how far the engine's sampling
    distribution is from the trainer's (numerics, stale weights)."""
    num = sum(((s["old_logps"] - s["engine_logps"]) * s["action_mask"]).sum().item() for s in samples)
    den = sum(s["action_mask"].sum().item() for s in samples)
    return num / max(den, 1.0)


def main():
    trainer = PPOTrainer(load_config("ppo"))
    trainer.fit(trainer.n_steps)
    trainer.close()


if __name__ == "__main__":
    main()
