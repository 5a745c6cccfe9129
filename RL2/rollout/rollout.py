"""Rollout placement and scheduling: one engine per rollout group, prompts split across groups,
trajectories run concurrently on one persistent event loop, then gathered on every rank; dynamic
filtering of uninformative groups with bounded refills; rollout JSONL dumps."""
import asyncio
import json
import logging
import os
from collections import defaultdict

import torch
import torch.distributed as dist

from RL2.rollout.engine import SamplingParams, derive_seed, make_engine
from RL2.rollout.trajectory import run_trajectory
from RL2.rollout.weight_sync import sync_weights

logger = logging.getLogger(__name__)


def sampling_params(cfg, seed=None) -> SamplingParams:
    p = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                       max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop),
                       stop_token_ids=list(cfg.stop_token_ids), seed=seed)
    p.validate()
    return p


class Rollout:
    """Owns the engine of this rank's rollout group (only the group leader holds one)."""

    def __init__(self, cfg, tokenizer, env, model_path: str, device: str, seed: int):
        self.cfg, self.tokenizer, self.env, self.seed = cfg, tokenizer, env, seed
        rank, world = dist.get_rank(), dist.get_world_size()
        if world % cfg.tp_size:
            raise ValueError(f"world size {world} is not divisible by actor.rollout.tp_size={cfg.tp_size}")
        self.n_groups = world // cfg.tp_size
        self.group = rank // cfg.tp_size
        self.is_leader = rank % cfg.tp_size == 0
        self.loop = asyncio.new_event_loop()  # one loop for the whole run (SGLang binds to it)
        self.engine = None
        if self.is_leader:
            kw = {}
            if cfg.engine in ("sglang", "auto") and device == "cuda":
                kw = dict(tp_size=cfg.tp_size, base_gpu_id=rank % max(1, torch.cuda.device_count()),
                          **dict(cfg.sglang))
            elif cfg.max_model_len:
                kw = dict(max_model_len=cfg.max_model_len)
            self.engine = make_engine(cfg.engine, model_path, tokenizer, **kw)
        # For an SGLang group the rest of the group only takes part in the weight gathers.

    def sync(self, model) -> dict:
        return sync_weights(model, self.engine, self.cfg.bucket_mb)

    def release(self):
        if self.engine is not None:
            self.engine.release_memory()

    def _generate(self, prompts: list[dict], params_cfg, n: int, step: int, tag: str) -> list:
        """Run n trajectories per prompt; this group runs its contiguous share, then all ranks
        receive every trajectory in (prompt, sample) order."""
        jobs = [(p, j) for p in range(len(prompts)) for j in range(n)]
        mine = jobs[self.group::self.n_groups]
        local = []
        if self.engine is not None and mine:
            async def run_all():
                tasks = []
                for p, j in mine:
                    uid = f"{tag}{step}-{prompts[p]['index']}-{j}"
                    # Seeded per request from (seed, split, step, prompt, sample): results do not
                    # depend on which rank or batch ran it, so resumed runs repeat exactly.
                    seed = derive_seed(self.seed, f"{tag}{step}-{prompts[p]['index']}-{j}") \
                        if params_cfg.temperature > 0 else None
                    tasks.append(run_trajectory(
                        self.engine, self.tokenizer, self.env, prompts[p],
                        sampling_params(params_cfg, seed), self.cfg.max_turns, uid,
                        max_length=self.cfg.max_length))
                return await asyncio.gather(*tasks)

            local = list(zip(mine, self.loop.run_until_complete(run_all())))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        by_job = {}
        for part in gathered:
            for job, traj in part or []:
                by_job[job] = traj
        return [[by_job[(p, j)] for j in range(n)] for p in range(len(prompts))]

    def run(self, prompt_source, step: int, train: bool = True) -> tuple[list[list], dict]:
        """Trajectories grouped per prompt, and rollout metrics. `prompt_source(k)` returns the
        k-th batch of prompts for this step (k > 0 only when refilling after filtering)."""
        cfg = self.cfg
        params = cfg.train_sampling_params if train else cfg.test_sampling_params
        n = cfg.responses_per_prompt if train else cfg.test_responses_per_prompt
        kept, seen, filtered, tries = [], [], 0, 0
        while True:
            groups = self._generate(prompt_source(tries), params, n, step, "train" if train else "test")
            seen.extend(groups)
            for g in groups:
                if train and cfg.dynamic_filtering and len({t.reward for t in g}) == 1:
                    filtered += 1
                else:
                    kept.append(g)
            tries += 1
            if not (train and cfg.dynamic_filtering) or len(kept) >= cfg.prompts_per_rollout \
                    or tries > cfg.max_refill_tries:
                break
        if train and cfg.dynamic_filtering:
            if len(kept) < cfg.prompts_per_rollout:
                logger.warning(f"dynamic filtering: only {len(kept)} informative groups after "
                               f"{tries} tries (wanted {cfg.prompts_per_rollout})")
            kept = kept[:cfg.prompts_per_rollout]
        flat = [t for g in seen for t in g]
        failed = sum(t.failed for t in flat)
        if flat and failed / len(flat) > cfg.max_failed_ratio:
            errors = "; ".join(t.error for t in flat if t.failed)[:2000]
            raise RuntimeError(f"{failed}/{len(flat)} trajectories failed (more than "
                               f"actor.rollout.max_failed_ratio={cfg.max_failed_ratio}): {errors}")
        return kept, self.metrics(seen, filtered, tries, n)

    @staticmethod
    def metrics(groups: list[list], filtered: int, tries: int, n: int) -> dict:
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([t.reward for t in flat], dtype=torch.float64)
        scores = torch.tensor([t.score for t in flat], dtype=torch.float64)
        lengths = torch.tensor([t.num_action_tokens for t in flat], dtype=torch.float64)
        out = {
            "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(flat) > 1 else 0.0,
            "score": scores.mean().item(), "score_std": scores.std().item() if len(flat) > 1 else 0.0,
            "response_length": lengths.mean().item(),
            "truncated_ratio": sum(t.truncated for t in flat) / len(flat),
            "turns": sum(t.num_turns for t in flat) / len(flat),
            "failed": float(sum(t.failed for t in flat)),
            "filtered_groups": float(filtered), "rollout_tries": float(tries),
        }
        # mean@n and pass@n per data source (score > 0 counts as a pass).
        by_source = defaultdict(list)
        for g in groups:
            by_source[g[0].extra_info.get("data_source", "all")].append(g)
        for src, gs in by_source.items():
            out[f"{src}/mean@{n}"] = sum(t.score for g in gs for t in g) / (len(gs) * n)
            out[f"{src}/pass@{n}"] = sum(any(t.score > 0 for t in g) for g in gs) / len(gs)
        return out

    def dump(self, groups: list[list], path: str):
        if dist.get_rank() != 0:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            for g in groups:
                for t in g:
                    f.write(json.dumps(t.to_json()) + "\n")

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()
        self.loop.close()
