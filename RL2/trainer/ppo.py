"""PPO / GRPO / Dr. GRPO / REINFORCE(++) / RLOO with async multi-turn environments.

    torchrun --nproc_per_node=N -m RL2.trainer.ppo actor.model_name=... actor.rollout.env_path=...

One step: rollout -> reference log-probs -> values -> old log-probs -> advantages -> actor and
critic updates -> weight sync to the engine. The algorithm variant is configuration only
(`adv.estimator`, `kl.*`, `actor.avg_level`, ...; presets in RL2/config/ppo.yaml).
"""
import logging
import os
import time
from contextlib import contextmanager
from functools import partial

import torch

from RL2.algorithms.advantages import OUTCOME_ESTIMATORS
from RL2.algorithms.losses import AVG_LEVELS, KL_ESTIMATORS, POLICY_LOSSES, token_metrics
from RL2.algorithms.off_policy import CORRECTIONS, apply_correction
from RL2.algorithms.on_policy import check_engine_logps
from RL2.algorithms.ppo import actor_update, compute_advantages, critic_update, engine_kl
from RL2.data.formats import tokenize_prompt
from RL2.data.mixture import MixtureSampler, load_mixed_splits
from RL2.data.packing import token_capacity
from RL2.parallel.mesh import resolve_device
from RL2.rollout.engine import resolve_engine_kind
from RL2.rollout.env import EnvError, load_env
from RL2.rollout.producer import INFLIGHT_MODES, Producer, drop_stale
from RL2.rollout.remote import check_placement
from RL2.rollout.rollout import Rollout, check_lora_sync, sampling_params
from RL2.rollout.weight_sync import TRANSPORTS
from RL2.trainer.base import AdaptersOff, Trainer
from RL2.utils import checkpoint, onednn
from RL2.utils.config import count_problem
from RL2.utils.seeding import derive_seed
from RL2.workers.actor import Actor

logger = logging.getLogger("RL2")
BUFFER_FILE = "rollout_buffer.pt"  # a checkpoint's buffered rollout batches (max_staleness > 0)


@contextmanager
def timed(timings: dict, name: str):
    start = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - start


def check_config(cfg):
    """Cross-key checks that need no model, so a typo stops the run in seconds. Raises SystemExit
    with what to change."""
    problems = _algorithm_problems(cfg) + _rollout_problems(cfg.actor.rollout)
    problems += check_placement(cfg.actor.rollout, resolve_device(cfg.trainer.device)) + check_async_config(cfg)
    problems += check_lora_sync(cfg.actor.rollout, cfg.actor.lora.rank, resolve_device(cfg.trainer.device))
    r = cfg.actor.rollout
    # A rollout sequence must fit one micro-batch of every worker that reads it.
    workers = ["actor"] + (["critic"] if cfg.adv.estimator == "gae" else [])
    for w in workers:
        capacity = token_capacity(cfg[w])
        if r.max_length > capacity:
            problems.append(f"actor.rollout.max_length={r.max_length} exceeds {w}.max_length_per_device"
                            f"*sp_size*tp_size={capacity}: lower the first or raise the second")
    if problems:
        raise SystemExit("invalid PPO config:\n  " + "\n  ".join(problems))
    if cfg.adv.estimator in ("reinforce", "rloo") and r.responses_per_prompt == 1:
        logger.warning("responses_per_prompt=1 with a group baseline: every advantage is 0")


def _algorithm_problems(cfg) -> list[str]:
    a, problems = cfg.actor, []
    estimators = (*OUTCOME_ESTIMATORS, "gae")
    if cfg.adv.estimator not in estimators:
        problems.append(f"adv.estimator={cfg.adv.estimator!r}: use one of {estimators}")
    if cfg.kl.type not in ("reward", "loss"):
        problems.append(f"kl.type={cfg.kl.type!r}: use reward or loss")
    for key in ("reward_estimator", "loss_estimator"):
        if cfg.kl[key] not in KL_ESTIMATORS:
            problems.append(f"kl.{key}={cfg.kl[key]!r}: use one of {KL_ESTIMATORS}")
    if cfg.kl.coef < 0:
        problems.append(f"kl.coef={cfg.kl.coef} must be >= 0")
    for w in ("actor", "critic"):
        if cfg[w].avg_level not in AVG_LEVELS:
            problems.append(f"{w}.avg_level={cfg[w].avg_level!r}: use one of {AVG_LEVELS}")
        for key in ("update_per_rollout", "update_epochs"):
            if cfg[w][key] < 1:
                problems.append(f"{w}.{key}={cfg[w][key]} must be >= 1")
    if a.policy_loss not in POLICY_LOSSES:
        problems.append(f"actor.policy_loss={a.policy_loss!r}: use one of {POLICY_LOSSES}")
    if a.policy_loss == "cispo" and a.dual_clip is not None:
        problems.append("actor.dual_clip has no meaning for actor.policy_loss=cispo (its weight is already capped)")
    if a.strict_on_policy and (a.update_per_rollout > 1 or a.update_epochs > 1):
        problems.append("actor.strict_on_policy needs an on-policy config: actor.update_per_rollout=1 "
                        "and actor.update_epochs=1")
    if a.dual_clip is not None and a.dual_clip <= 1:
        problems.append(f"actor.dual_clip={a.dual_clip} must be > 1 (or null)")
    if a.tis_coef is not None and a.tis_coef <= 0:
        problems.append(f"actor.tis_coef={a.tis_coef} must be > 0 (or null)")
    if a.freeze_steps and cfg.adv.estimator != "gae":
        problems.append("actor.freeze_steps warms up the critic: it needs adv.estimator=gae")
    if cfg.adv.estimator == "rloo" and a.rollout.responses_per_prompt < 2:
        problems.append("adv.estimator=rloo needs actor.rollout.responses_per_prompt >= 2")
    return problems


def _rollout_problems(r) -> list[str]:
    problems, n = [], r.responses_per_prompt
    for key in ("prompts_per_rollout", "responses_per_prompt", "test_responses_per_prompt", "max_turns"):
        problems += count_problem(f"actor.rollout.{key}", r[key])
    for split in ("train", "test"):
        try:  # the engines' own check of the values, before any engine exists
            sampling_params(r[f"{split}_sampling_params"])
        except ValueError as e:
            problems.append(f"actor.rollout.{split}_sampling_params.{e}")
    if r.dynamic_filtering and n < 2:
        problems.append("actor.rollout.dynamic_filtering drops groups with equal rewards: "
                        "it needs actor.rollout.responses_per_prompt >= 2")
    if r.overlong_buffer and r.overlong_buffer >= r.train_sampling_params.max_new_tokens:
        problems.append(f"actor.rollout.overlong_buffer={r.overlong_buffer} must be smaller than "
                        f"train_sampling_params.max_new_tokens={r.train_sampling_params.max_new_tokens}")
    bad_k = [k for k in r.pass_k if not 1 <= k <= r.test_responses_per_prompt]
    if bad_k:
        problems.append(f"actor.rollout.pass_k={list(r.pass_k)}: every k must be in [1, "
                        f"test_responses_per_prompt={r.test_responses_per_prompt}]")
    if r.weight_sync not in TRANSPORTS:
        problems.append(f"actor.rollout.weight_sync={r.weight_sync!r}: use one of {TRANSPORTS}")
    if r.torch.get("cpu_matmul", "onednn") not in onednn.CHOICES:  # (workers check their own)
        problems.append(f"actor.rollout.torch.cpu_matmul={r.torch.cpu_matmul!r}: use one of {onednn.CHOICES}")
    if not isinstance(r.torch.get("small_gemm", True), bool):
        problems.append(f"actor.rollout.torch.small_gemm={r.torch.small_gemm!r}: use true or false")
    if r.tp_size != "auto" and (not isinstance(r.tp_size, int) or r.tp_size < 1):
        problems.append(f"actor.rollout.tp_size={r.tp_size!r}: use auto or a number of ranks >= 1")
    if r.bucket_mb <= 0:
        problems.append(f"actor.rollout.bucket_mb={r.bucket_mb} must be > 0")
    if r.env_workers < 0:
        problems.append(f"actor.rollout.env_workers={r.env_workers} must be >= 0")
    if not 0 <= r.max_failed_ratio <= 1:
        problems.append(f"actor.rollout.max_failed_ratio={r.max_failed_ratio} must be in [0, 1]")
    return problems


def check_async_config(cfg) -> list[str]:
    """Cross-key checks of the asynchronous rollout and the off-policy corrections."""
    a, r, problems = cfg.actor, cfg.actor.rollout, []
    if r.max_staleness < 0:
        problems.append(f"actor.rollout.max_staleness={r.max_staleness} must be >= 0 (0 = synchronous)")
    if r.inflight_update not in INFLIGHT_MODES:
        problems.append(f"actor.rollout.inflight_update={r.inflight_update!r}: use one of {INFLIGHT_MODES}")
    if r.max_staleness > 0:
        kind = resolve_engine_kind(r.engine, resolve_device(cfg.trainer.device))
        if kind != "torch" and r.placement == "colocated":
            # The producer thread drives the engine's event loop and loads weights mid-generation;
            # only the torch engine is built and tested for that (SGLang/vLLM bind their loop).
            problems.append(f"actor.rollout.max_staleness > 0 needs actor.rollout.engine=torch "
                            f"(engine={r.engine} resolves to {kind}: asynchronous rollout is "
                            "implemented for the embedded torch engine only)")
        if r.tp_size not in (1, "auto"):
            problems.append("actor.rollout.max_staleness > 0 needs actor.rollout.tp_size=1 or auto (one engine per rank)")
        if r.reward_model:
            problems.append("actor.rollout.max_staleness > 0 does not support actor.rollout.reward_model "
                            "(its forward is a collective on the trainer's process group)")
        if a.strict_on_policy:
            problems.append("actor.strict_on_policy contradicts actor.rollout.max_staleness > 0 (off-policy)")
    if a.is_correction is not None and a.is_correction not in CORRECTIONS:
        problems.append(f"actor.is_correction={a.is_correction!r}: use one of {CORRECTIONS} (or null)")
    if not 0 <= a.is_low <= 1 <= a.is_high:
        problems.append(f"actor.is_low={a.is_low}, actor.is_high={a.is_high}: need 0 <= is_low <= 1 <= is_high")
    return problems


class PPOTrainer(Trainer):
    def __init__(self, cfg):
        # Cheap checks first: a bad config or env script stops the run before any model loads.
        check_config(cfg)
        r = cfg.actor.rollout
        try:
            env = load_env(r.env_path, dict(r.env_args), r.env_timeout, r.env_workers)
        except EnvError as e:
            raise SystemExit(f"environment error: {e}") from None
        super().__init__(cfg)
        self.env, d = env, cfg.data.train
        tokenize = partial(tokenize_prompt, rollout_length=r.max_length, tokenizer=self.tokenizer,
                           prompt_key=d.prompt_key, messages_key=d.messages_key,
                           apply_chat_template=d.apply_chat_template, max_length=d.max_length,
                           prompt_required=not self.env.has_reset)
        try:  # a list of {path, weight} mixes datasets (RL2/data/mixture.py)
            mixed = load_mixed_splits(cfg.data, cfg.trainer.seed, partial(self._tokenize_all, tokenize=tokenize))
        except (ValueError, FileNotFoundError) as e:  # a bad entry, or a source's file empty, malformed, missing
            raise SystemExit(f"bad data config: {e}") from None
        splits = mixed[:2] if mixed else self.load_splits(tokenize)
        self.train_prompts, self.test_prompts = [self._index(p) for p in splits]
        self.sampler, self.n_steps = self.plan_steps(len(self.train_prompts), r.prompts_per_rollout)
        if mixed and mixed[2]:
            self.sampler = MixtureSampler(mixed[3], mixed[2], r.prompts_per_rollout, cfg.trainer.seed)
        seed = cfg.trainer.seed
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=seed)
        self.ref = None
        if cfg.kl.coef > 0:  # with LoRA: the actor with adapters off (RL2/trainer/base.py)
            self.ref = (AdaptersOff(self.actor) if self.actor.peft is not None
                        else Actor(cfg.actor, self.device, train=False, seed=seed))
        self.critic = None
        if cfg.adv.estimator == "gae":
            from RL2.workers.critic import Critic

            self.critic = Critic(cfg.critic, self.device, total_steps=self.n_steps, seed=seed)
        self.rollout = Rollout(r, self.tokenizer, self.env, cfg.actor.model_name, self.device, seed,
                               lora=cfg.actor.lora)
        if r.reward_model:
            from RL2.rollout.reward_model import RewardModel

            self.rollout.reward_model = RewardModel(r.reward_model, cfg.actor, r.reward_model_coef, self.tokenizer,
                                                    self.device, seed, chat=cfg.data.train.apply_chat_template)
        self.async_k, self.producer, self.buffered = r.max_staleness, None, {}
        self.maybe_resume()
        # the engine serves exactly the trainer's weights; asynchronous: a copy of its own
        sync = self.rollout.sync(self.actor.model, share=not self.async_k, version=self.step)
        logger.info(f"initial weight sync: {sync}")

    def model_paths(self) -> dict:
        paths = super().model_paths()
        if self.cfg.adv.estimator == "gae":
            paths["critic.model_name"] = self.cfg.critic.model_name
        paths["actor.rollout.reward_model"] = self.cfg.actor.rollout.reward_model
        return paths

    @staticmethod
    def _index(prompts: list[dict]) -> list[dict]:
        for i, p in enumerate(prompts):
            p["index"] = i  # identifies the prompt in seeds and uids
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
        further batches, drawn as a pure function of (seed, step, k) so resumed runs repeat them."""
        if k == 0:
            idx = self.sampler.batch(step)
        else:
            g = torch.Generator().manual_seed(derive_seed(self.cfg.trainer.seed, "refill", step, k))
            idx = torch.randperm(len(self.train_prompts), generator=g)[
                :self.cfg.actor.rollout.prompts_per_rollout].tolist()
        return [self.train_prompts[i] for i in idx]

    def dump_path(self, name: str) -> str | None:
        if not self.cfg.actor.rollout.dump_rollouts:
            return None
        return os.path.join(self.run_dir, "rollouts", f"{name}.jsonl")

    # ----- the algorithm -----
    def train_step(self, step: int) -> dict:
        timings = {}
        with timed(timings, "rollout"):
            groups, metrics = self.collect(step)
        return self.learn(step, groups, metrics, timings)

    def collect(self, step: int) -> tuple[list[list], dict]:
        """This step's groups and rollout metrics: generated now (max_staleness=0), or taken
        from the producer, without the groups too stale to train on."""
        if not self.async_k:
            groups, rollout_metrics = self.rollout.run(
                partial(self.prompts_for, step), step, dump_path=self.dump_path(f"step{step + 1}"))
            self.rollout.release()
            return groups, {f"rollout/{k}": v for k, v in rollout_metrics.items()}
        if self.producer is None:
            r = self.cfg.actor.rollout
            self.producer = Producer(self.rollout, self.prompts_for, self.async_k, r.inflight_update,
                                     version=step, n_steps=self.n_steps, buffered=self.buffered)
        batch = self.producer.get(step)
        self.rollout.check_failures(batch, self.dump_path(f"step{step + 1}"))
        groups, dropped = drop_stale(batch.kept, step, self.async_k)
        if dropped:
            logger.warning(f"step {step + 1}: {dropped} trajectories older than max_staleness="
                           f"{self.async_k} versions; their groups are left out")
        ages = [step - t.min_version for g in groups for t in g if t.min_version is not None]
        metrics = {f"rollout/{k}": v for k, v in batch.metrics.items()}
        metrics.update({"async/dropped_stale": float(dropped),
                        "async/staleness_mean": sum(ages) / max(1, len(ages)),
                        "async/staleness_max": float(max(ages, default=0))})
        return groups, metrics

    def learn(self, step: int, groups: list[list], metrics: dict, timings: dict) -> dict:
        """Log-probs, values, advantages, updates and the weight sync on this step's groups."""
        cfg = self.cfg
        # Flatten to sequences; owner[i] = index of the trajectory that sequence i belongs to.
        trajectories = [t for g in groups for t in g]
        metrics["rollout/train_tokens"] = float(sum(t.num_action_tokens for t in trajectories))
        samples, owner = [], []
        for t_index, traj in enumerate(trajectories):
            samples.extend(traj.samples)
            owner.extend([t_index] * len(traj.samples))
        if not any(s["action_mask"].sum() > 0 for s in samples):
            logger.warning(f"step {step + 1}: no trainable tokens (every group filtered, failed or stale)")
            with timed(timings, "sync"):
                metrics.update(self.sync_weights(step))
            return {**metrics, **timings}
        samples = self.score(step, samples, metrics, timings)
        with timed(timings, "advantages"):
            samples, adv_metrics = compute_advantages(samples, owner, len(trajectories), len(groups),
                                                      cfg.adv, cfg.kl)
        metrics.update(adv_metrics)
        with timed(timings, "update"):
            if self.critic is not None:
                critic_metrics = critic_update(self.critic, samples, cfg.critic,
                                               derive_seed(cfg.trainer.seed, "minibatch", step))
                metrics.update({f"critic/{k}": v for k, v in critic_metrics.items()})
            if step >= cfg.actor.freeze_steps:  # critic warm-up: the actor waits
                actor_metrics = actor_update(self.actor, samples, cfg.actor, cfg.kl,
                                             derive_seed(cfg.trainer.seed, "minibatch", step), step=step)
                metrics.update({f"actor/{k}": v for k, v in actor_metrics.items()})
        with timed(timings, "sync"):
            metrics.update(self.sync_weights(step))
        timings["time/step"] = sum(timings.values())
        tokens = {f"train/{k}": v for k, v in token_metrics(samples).items()}
        tokens["train/tokens_per_s"] = tokens["train/tokens"] / timings["time/step"]
        return {**metrics, **tokens, **timings}

    def score(self, step: int, samples: list[dict], metrics: dict, timings: dict) -> list[dict]:
        """Reference log-probs, values, old log-probs and off-policy weights of the samples."""
        cfg, a = self.cfg, self.cfg.actor
        temperature = cfg.actor.rollout.train_sampling_params.temperature or 1.0
        if self.ref is not None:
            with timed(timings, "ref_logps"):
                ref_logps = self.ref.compute_logps(samples, temperature)
            samples = [dict(s, ref_logps=lp) for s, lp in zip(samples, ref_logps)]
        if self.critic is not None:
            with timed(timings, "values"):
                values = self.critic.compute_values(samples)
            samples = [dict(s, values=v) for s, v in zip(samples, values)]
        kl_reward = cfg.kl.coef > 0 and cfg.kl.type == "reward"
        # Old log-probs are only needed when the policy moves before a sample is used (several
        # mini-batches), for IS corrections, stale samples, or a KL penalty in the reward; else
        # the ratio is exactly 1.
        if (a.update_per_rollout > 1 or a.update_epochs > 1 or a.tis_coef or kl_reward or a.strict_on_policy
                or a.is_correction or self.async_k):
            with timed(timings, "old_logps"):
                old = self.actor.compute_logps(samples, temperature)
            samples = [dict(s, old_logps=lp) for s, lp in zip(samples, old)]
            metrics["rollout/engine_kl"] = engine_kl(samples)
            if a.strict_on_policy:
                check_engine_logps(samples, step, a.on_policy_tol)
            if a.is_correction:
                samples, is_metrics = apply_correction(samples, a.is_correction, a.is_low, a.is_high)
                metrics.update(is_metrics)
        return samples

    def sync_weights(self, step: int) -> dict:
        """Trainer shards -> the engine (synchronous) or a snapshot published to the producer as
        version step + 1; its metrics (seconds, bytes) under sync/."""
        if self.async_k:
            start = time.perf_counter()
            weights = self.rollout.snapshot(self.actor.model)
            if self.producer is not None:
                self.producer.publish(step + 1, weights)
            return {"sync/seconds": time.perf_counter() - start}
        synced = self.rollout.sync(self.actor.model, version=step + 1)  # servers report step + 1
        return {f"sync/{k.removeprefix('sync_')}": v for k, v in synced.items()}

    # ----- asynchronous rollout: evaluation and checkpoints with the producer parked -----
    def save(self, step: int):
        if self.producer is None:
            return super().save(step)
        self.producer.quiesce()
        try:
            super().save(step)
        finally:
            self.producer.resume()

    def checkpoint_extras(self) -> dict:
        """The generated, untrained batches (every prompt buffered or in flight: in-flight
        batches are finished by `quiesce` first), so a resumed run trains each prompt once."""
        if self.producer is None:
            return {}
        return {BUFFER_FILE: {"batches": self.producer.buffered()}}

    def maybe_resume(self):
        super().maybe_resume()
        src = self.cfg.trainer.load_ckpt_from
        if src and self.async_k:
            path = os.path.join(checkpoint.resolve_ckpt(src, self.run_dir), BUFFER_FILE)
            if os.path.exists(path):
                self.buffered = torch.load(path, weights_only=False)["batches"]
                logger.info(f"resumed {len(self.buffered)} buffered rollout batches: steps "
                            f"{sorted(b + 1 for b in self.buffered)}")

    def evaluate(self) -> dict:
        if not self.test_prompts:
            return {}
        if self.producer is not None:  # the newest weights, the loop and the rollout group to us
            self.producer.quiesce()
            self.producer.load_newest()
            try:
                return self._evaluate()
            finally:
                self.producer.resume()
        return self._evaluate()

    def _evaluate(self) -> dict:
        _, metrics = self.rollout.run(lambda k: self.test_prompts, self.step, train=False,
                                      dump_path=self.dump_path(f"test_step{self.step}"))
        return {f"test/{k}": v for k, v in metrics.items()}

    def close(self):
        if self.producer is not None:
            self.producer.stop()
        self.rollout.shutdown()
        super().close()


def main():
    PPOTrainer.launch("ppo")


if __name__ == "__main__":
    main()
