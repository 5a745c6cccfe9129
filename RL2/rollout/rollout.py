"""Rollout placement and scheduling: one engine per rollout group, prompts split across groups,
trajectories run concurrently on one persistent event loop, then gathered on every rank; optional
overlong-response shaping (DAPO); groups with a failed trajectory are dropped, uninformative ones
(all rewards equal) filtered, with bounded refills; rollout JSONL dumps; the failure budget."""
import asyncio
import json
import logging
import os
import urllib.parse
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from RL2.algorithms.metrics import pass_at_k
from RL2.parallel.collectives import gather_objects
from RL2.rollout.engine import SamplingParams, close_loop, make_engine, resolve_engine_kind
from RL2.utils.seeding import derive_seed
from RL2.rollout.trajectory import Requeue, run_trajectory
from RL2.rollout.weight_sync import WeightSync

logger = logging.getLogger(__name__)

ROLLOUT_TIMEOUT = timedelta(hours=6)  # a long multi-turn rollout is not a hang


def engine_kwargs(kind: str, cfg, seed: int = 0) -> dict:
    """Constructor arguments of the backend `kind` (already resolved from "auto")."""
    if kind == "sglang":
        # the group's engine spans tp_size GPUs from its leader's own (set by the worker)
        base = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return dict(tp_size=cfg.tp_size, base_gpu_id=base,
                    bucket_bytes=int(cfg.bucket_mb * 2**20), **dict(cfg.sglang))
    if kind == "vllm":
        kw = dict(max_model_len=cfg.max_model_len or cfg.max_length, bucket_mb=cfg.bucket_mb,
                  seed=seed, **dict(cfg.vllm))
        if torch.cuda.is_available() and not kw.get("server_url"):
            # CUDA (NOT RUN): the group's engine is tensor parallel over the group's own GPUs;
            # on CPU the group shares one single-worker engine
            base = torch.cuda.current_device()
            kw.update(tp_size=cfg.tp_size, device_ids=list(range(base, base + cfg.tp_size)))
        return kw
    kw = dict(cfg.get("torch") or {})
    if cfg.max_model_len:
        kw["max_model_len"] = cfg.max_model_len
    return kw


def group_size(cfg, kind: str, device: str) -> int:
    """What `actor.rollout.tp_size=auto` means: on the CPU, the ranks of a host (torchrun's
    LOCAL_WORLD_SIZE) share one torch engine when rollout is synchronous and colocated. A decode
    step reads every weight once for all its rows, so one engine with every row reads the model
    once per token where an engine per rank reads it once per rank; the leader decodes with the
    group's threads (the others wait on gloo). 2 x 1 GRPO generation: 1.2-1.4x (benchmarks/
    README.md, fixes 21 and 24). Otherwise one rank per engine (SGLang and vLLM on CUDA: no
    tensor parallelism unless asked; asynchronous rollout needs an engine per rank)."""
    if (kind != "torch" or device != "cpu" or cfg.get("placement", "colocated") != "colocated"
            or cfg.get("max_staleness", 0) > 0):
        return 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return local if local >= 1 and dist.get_world_size() % local == 0 else 1


LORA_SYNC = ("auto", "merged", "adapter")
ADAPTER_ENGINES = ("vllm", "sglang")  # engines that load LoRA adapters


def one_vllm_server(cfg, kind: str) -> bool:
    """Whether the rollouts go to one running `vllm serve` (`actor.rollout.vllm.server_url`)."""
    return kind == "vllm" and bool((cfg.get("vllm") or {}).get("server_url"))


def lora_sync_mode(cfg, kind: str) -> str:
    """`actor.rollout.lora_sync` (cfg) resolved for the backend `kind`: adapter (the engine loads
    the LoRA adapter; auto picks it for in-process vLLM and SGLang engines) or merged (full
    weights W + scale * B @ A). Servers (`vllm.server_url`, disaggregated) take adapters only
    when asked: they need LoRA flags at start-up, and an RL2 torch-engine server cannot."""
    mode = cfg.get("lora_sync", "auto")
    if mode != "auto":
        return mode
    in_process = cfg.get("placement", "colocated") == "colocated" and not one_vllm_server(cfg, kind)
    return "adapter" if kind in ADAPTER_ENGINES and in_process else "merged"


def check_lora_sync(cfg, lora_rank: int, device: str) -> list[str]:
    """Problems of `actor.rollout.lora_sync` (cfg) for an actor with LoRA rank `lora_rank`."""
    if cfg.lora_sync not in LORA_SYNC:
        return [f"actor.rollout.lora_sync={cfg.lora_sync!r}: use one of {LORA_SYNC}"]
    if lora_rank <= 0 or cfg.lora_sync != "adapter":
        return []
    if cfg.placement == "disaggregated":
        from RL2.rollout.remote import normalize

        hosts = {urllib.parse.urlsplit(normalize(str(a))).hostname for a in cfg.servers}
        if cfg.get("lora_dir") is None and hosts - {"127.0.0.1", "localhost", "::1"}:
            return ["actor.rollout.lora_sync=adapter with servers on other hosts needs "
                    "actor.rollout.lora_dir: a path the servers read at the same place (shared filesystem)"]
        return []
    kind = resolve_engine_kind(cfg.engine, device)
    if kind in ADAPTER_ENGINES:
        return []
    return [f"actor.rollout.lora_sync=adapter needs an engine that loads LoRA adapters (vLLM, SGLang): "
            f"engine={cfg.engine} resolves to {kind}, which takes merged weights (use merged or auto)"]


def sampling_params(cfg, seed=None) -> SamplingParams:
    p = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                       max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop),
                       stop_token_ids=list(cfg.stop_token_ids), seed=seed)
    p.validate()
    return p


@dataclass
class RolloutBatch:
    """The rollout of one step: every group generated (`seen`, with its status kept | filtered |
    failed), the groups to train on (`kept`) and rollout metrics."""
    step: int
    seen: list = field(default_factory=list)
    status: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


class Rollout:
    """Owns the engine of this rank's rollout group (only the group leader holds one)."""

    reward_model = None  # optional scorer of train trajectories, set by the trainer (rollout/reward_model.py)
    # Asynchronous rollout (RL2/rollout/producer.py): clock() = the engine's weight version, and
    # what a generation cut by new weights does ("continue" | "restart"); None = synchronous.
    clock = None
    on_abort = None
    requeued = 0

    def __init__(self, cfg, tokenizer, env, model_path: str, device: str, seed: int, lora=None):
        """`lora`: the actor's `lora` config (None or rank 0 = off); with adapter sync the engine
        is built to load adapters of that rank and targets."""
        self.cfg, self.tokenizer, self.env, self.seed = cfg, tokenizer, env, seed
        rank, world = dist.get_rank(), dist.get_world_size()
        self.kind = resolve_engine_kind(cfg.engine, device)
        if cfg.tp_size == "auto":
            cfg.tp_size = group_size(cfg, self.kind, device)
            if rank == 0:
                logger.info(f"actor.rollout.tp_size=auto: {cfg.tp_size} rank(s) per {self.kind} engine")
        if world % cfg.tp_size:
            raise ValueError(f"world size {world} is not divisible by actor.rollout.tp_size={cfg.tp_size}")
        self.n_groups = world // cfg.tp_size
        self.group = rank // cfg.tp_size
        self.is_leader = rank % cfg.tp_size == 0
        # disaggregated: engine servers elsewhere; rank 0 is their one client (rollout/remote.py).
        # So for one `vllm serve` (vllm.server_url): a client per rank would each run its own
        # weight updates on it (vLLM 0.32's worker refuses a second start_weight_update while
        # one is active, and a second transfer group replaces the first)
        self.disaggregated = cfg.get("placement", "colocated") == "disaggregated"
        if self.disaggregated or one_vllm_server(cfg, self.kind):
            self.n_groups, self.group, self.is_leader = 1, 0, rank == 0
        self.loop = asyncio.new_event_loop()  # one loop for the whole run (SGLang binds to it)
        # Ranks without an engine wait here for the leaders' rollouts, which can take longer than
        # NCCL's watchdog allows, and must not spin NCCL kernels beside SGLang: wait on gloo.
        self.cpu_group = dist.new_group(backend="gloo", timeout=ROLLOUT_TIMEOUT)
        # CPU torch engine of a group of several ranks: the others wait (on gloo, not spinning)
        # while the leader generates, so it decodes with their cores too (benchmarks/README.md,
        # fix 21); 1 = the leader's own thread count
        self.borrow_threads = (cfg.tp_size if self.kind == "torch" and device == "cpu"
                               and not self.disaggregated else 1)
        self.engine = None
        self.peer = None  # SGLang: this rank's part in the weight updates of its group's engine
        self._weight_sync = None  # built on the first sync (a collective over the model's ranks)
        kw = engine_kwargs(self.kind, cfg, seed)
        # the torch engine in another dtype than the trainer's fp32 master weights: the sync casts
        # (shared-memory buckets are written cast, so engines still share them)
        engine_dtype = kw.get("dtype", "float32") if self.kind == "torch" and not self.disaggregated else "float32"
        self.sync_dtype = None if engine_dtype == "float32" else getattr(torch, engine_dtype)
        lora_rank = lora.rank if lora is not None else 0
        self.adapter_sync = lora_rank > 0 and lora_sync_mode(cfg, self.kind) == "adapter"
        if self.adapter_sync and not self.disaggregated:
            kw.update(lora_rank=lora_rank, lora_dir=cfg.get("lora_dir"))
            if self.kind == "sglang":
                kw["lora_target_modules"] = list(lora.target_modules)
        if self.kind == "sglang" and not self.disaggregated:
            kw.update(self._sglang_group(model_path, kw))
        if self.is_leader and self.disaggregated:
            from RL2.rollout.remote import make_pool
            self.engine = make_pool(cfg, tokenizer, device, lora if self.adapter_sync else None)
        elif self.is_leader:
            self.engine = make_engine(self.kind, model_path, tokenizer, **kw)
            if getattr(self.engine, "loop", None) is not None:
                # SGLang/vLLM run on the loop they were created with: trajectories use that one.
                self.loop.close()
                self.loop = self.engine.loop
            env.start()  # env worker processes for sync hooks (only leaders run trajectories)
        # For an SGLang group the rest of the group only takes part in the weight updates.

    def _sglang_group(self, model_path: str, kw: dict) -> dict:
        """One gloo group per rollout tp group (created on every rank: new_group is collective);
        the non-leaders get an `SGLangPeer`."""
        from RL2.rollout.sglang_engine import SGLangPeer, engine_dtype

        tp, mine = self.cfg.tp_size, None
        for g in range(self.n_groups):
            ranks = list(range(g * tp, (g + 1) * tp))
            group = dist.new_group(ranks, backend="gloo", timeout=ROLLOUT_TIMEOUT) if tp > 1 else None
            if g == self.group:
                mine = group
        if not self.is_leader:
            dtype = engine_dtype(model_path, kw.get("dtype", "auto"))
            self.peer = SGLangPeer(mine, kw["bucket_bytes"], dtype)
        return {"group": mine}

    def sync(self, model, share: bool = True, version: int | None = None) -> dict:
        """Bring the engine to the model's weights (a collective over the model's ranks).
        share=False: the engine keeps its own copy (asynchronous rollout: it generates while the
        optimizer rewrites the trainer's tensors). `version`: the label engine servers report
        after this sync (disaggregated)."""
        if version is not None and hasattr(self.engine, "next_version"):
            self.engine.next_version = str(version)
        return self._sync_for(model, share)(self.engine or self.peer)

    def _sync_for(self, model, share: bool = True) -> WeightSync:
        ws = self._weight_sync
        if ws is None or ws.model is not model or ws.requested_share != share:
            self._weight_sync = ws = WeightSync(model, self.cfg.weight_sync, self.cfg.bucket_mb, share=share,
                                                dtype=self.sync_dtype, adapter_only=self.adapter_sync)
        return ws

    def load(self, weights: list) -> None:
        """Load a `snapshot` into this rank's engine (asynchronous rollout's producer)."""
        self._weight_sync.load(self.engine, weights)

    def snapshot(self, model) -> list | None:
        """A private copy of the model's full weights, (HF name, tensor) pairs, for this rank's
        engine to load later (None on ranks without one). A collective over the model's ranks,
        called on the trainer's thread."""
        stream = self._sync_for(model, share=False).stream()
        if self.engine is None:
            for _ in stream:  # a collective: this rank takes part but keeps no copy
                pass
            return None
        return [(name, t.clone()) for name, t in stream]

    def release(self):
        if self.engine is not None:
            self.engine.release_memory()

    def _trajectory_jobs(self, prompts: list[dict], params_cfg, n: int, tag: str, mine: list):
        """One coroutine per (prompt, sample) job of this group; with `on_abort == "restart"` a
        trajectory cut by new weights runs again from the start (counted in `self.requeued`)."""
        async def one(p: int, j: int):
            uid = f"{tag}-{prompts[p]['index']}-{j}"
            # Seeded per request from (seed, tag = split/step/refill, prompt, sample): results
            # do not depend on which rank or batch ran it, so resumed runs repeat.
            seed = derive_seed(self.seed, uid) if params_cfg.temperature > 0 else None
            while True:
                try:
                    return await run_trajectory(
                        self.engine, self.tokenizer, self.env, prompts[p], sampling_params(params_cfg, seed),
                        self.cfg.max_turns, uid, max_length=self.cfg.max_length, clock=self.clock,
                        on_abort=self.on_abort)
                except Requeue:
                    self.requeued += 1

        return [one(p, j) for p, j in mine]

    def _generate(self, prompts: list[dict], params_cfg, n: int, tag: str) -> list:
        """Run n trajectories per prompt; this group runs its share of the jobs, then all ranks
        receive every trajectory in (prompt, sample) order."""
        jobs = [(p, j) for p in range(len(prompts)) for j in range(n)]
        mine = jobs[self.group::self.n_groups]
        local = []
        if self.engine is not None and mine:
            async def run_all():
                return await asyncio.gather(*self._trajectory_jobs(prompts, params_cfg, n, tag, mine))

            own = torch.get_num_threads()
            torch.set_num_threads(own * self.borrow_threads)
            try:
                local = list(zip(mine, self.loop.run_until_complete(run_all())))
            finally:
                torch.set_num_threads(own)
        by_job = {}
        for part in gather_objects(local, self.cpu_group):
            for job, traj in part or []:
                by_job[job] = traj
        return [[by_job[(p, j)] for j in range(n)] for p in range(len(prompts))]

    def _status(self, group: list, train: bool) -> str:
        if train and any(t.failed for t in group):
            return "failed"
        if train and self.cfg.dynamic_filtering and len({t.reward for t in group}) == 1:
            return "filtered"
        return "kept"

    def run_batch(self, prompt_source, step: int, train: bool = True) -> RolloutBatch:
        """The groups of one step (with refills after dynamic filtering), their statuses and
        metrics; no dump, no failure check (see `run`)."""
        cfg = self.cfg
        params = cfg.train_sampling_params if train else cfg.test_sampling_params
        n = cfg.responses_per_prompt if train else cfg.test_responses_per_prompt
        filtering = train and cfg.dynamic_filtering
        batch, tries, requeued = RolloutBatch(step), 0, self.requeued
        while True:
            tag = f"{'train' if train else 'test'}{step}" + (f".{tries}" if tries else "")
            groups = self._generate(prompt_source(tries), params, n, tag)
            if train and self.reward_model is not None:  # a collective: every rank has all groups
                self.reward_model(groups)
            if train and cfg.overlong_buffer:
                for t in (t for g in groups for t in g):
                    shape_overlong(t, params.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            batch.seen.extend(groups)
            batch.status.extend(self._status(g, train) for g in groups)
            tries += 1
            kept = batch.status.count("kept")
            if not filtering or kept >= cfg.prompts_per_rollout or tries > cfg.max_refill_tries:
                break
        batch.kept = [g for g, st in zip(batch.seen, batch.status) if st == "kept"]
        if filtering:
            if len(batch.kept) < cfg.prompts_per_rollout:
                logger.warning(f"dynamic filtering: only {len(batch.kept)} informative groups after "
                               f"{tries} tries (wanted {cfg.prompts_per_rollout})")
            batch.kept = batch.kept[:cfg.prompts_per_rollout]
        batch.metrics = self.metrics(batch.seen, n, cfg.pass_k)
        engine = getattr(self, "engine", None)  # (tests build a Rollout without __init__)
        if hasattr(engine, "pool_metrics"):  # disaggregated: live / lost servers, retries
            batch.metrics.update(engine.pool_metrics())
        batch.metrics.update(filtered_groups=float(batch.status.count("filtered")),
                             failed_groups=float(batch.status.count("failed")), rollout_tries=float(tries))
        if self.clock is not None:
            batch.metrics["requeued"] = float(self.requeued - requeued)
        return batch

    def check_failures(self, batch: RolloutBatch, dump_path: str | None):
        """Dump every trajectory (JSONL, with its group's status) before the failure budget is
        checked, so a stopped run leaves the errors on disk."""
        if dump_path:
            self.dump(batch.seen, batch.status, dump_path)
        flat = [t for g in batch.seen for t in g]
        failed = sum(t.failed for t in flat)
        if flat and failed / len(flat) > self.cfg.max_failed_ratio:
            errors = "\n  ".join(f"{t.uid}: {t.error}" for t in flat if t.failed)
            raise RuntimeError(
                f"{failed}/{len(flat)} trajectories failed, more than actor.rollout.max_failed_ratio="
                f"{self.cfg.max_failed_ratio}; errors (also in {dump_path or 'the rollout dump'}):\n  "
                f"{errors[:3000]}")
        if failed:
            logger.warning(f"{failed}/{len(flat)} trajectories failed (env errors); their groups "
                           f"are left out of the update. First: {next(t.error for t in flat if t.failed)}")

    def run(self, prompt_source, step: int, train: bool = True,
            dump_path: str | None = None) -> tuple[list[list], dict]:
        """Trajectories grouped per prompt for training, and rollout metrics.

        `prompt_source(k)` returns the k-th batch of prompts of this step (k > 0 only for refills
        after filtering). Train groups containing a failed trajectory are dropped (an env error
        says nothing about the policy); with dynamic filtering, groups whose rewards are all
        equal are too, and more prompts are drawn until prompts_per_rollout groups are kept or
        max_refill_tries refills were made. Every trajectory is dumped to `dump_path`.
        """
        batch = self.run_batch(prompt_source, step, train)
        self.check_failures(batch, dump_path)
        return batch.kept, batch.metrics

    @staticmethod
    def metrics(groups: list[list], n: int, pass_k=()) -> dict:
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([t.reward for t in flat], dtype=torch.float64)
        scores = torch.tensor([t.score for t in flat], dtype=torch.float64)
        lengths = torch.tensor([t.num_action_tokens for t in flat], dtype=torch.float64)
        out = {
            "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(flat) > 1 else 0.0,
            "score": scores.mean().item(), "score_std": scores.std().item() if len(flat) > 1 else 0.0,
            "response_length": lengths.mean().item(),
            "truncated_ratio": sum(t.truncated for t in flat) / len(flat),
            # the last turn stopped by max_new_tokens rather than a stop token / eos
            "overlong_ratio": sum(bool(t.turns) and t.turns[-1].get("finish_reason") == "length"
                                 for t in flat) / len(flat),
            "turns": sum(t.num_turns for t in flat) / len(flat),
            "failed": float(sum(t.failed for t in flat)),
        }
        # reward components of composed rewards (RL2/rollout/rewards.py), mean per trajectory
        parts = defaultdict(float)
        for t in flat:
            for name, v in (t.extra_info or {}).get("reward_components", {}).items():
                parts[name] += float(v) / len(flat)
        out.update({f"reward/{name}": v for name, v in parts.items()})
        # mean@n, pass@n and pass@k (k < n: unbiased from all n) per data source; score > 0 passes.
        by_source = defaultdict(list)
        for g in groups:
            by_source[g[0].extra_info.get("data_source", "all")].append(g)
        for src, gs in by_source.items():
            out[f"{src}/mean@{n}"] = sum(t.score for g in gs for t in g) / (len(gs) * n)
            for k in sorted({n, *(k for k in pass_k if k <= n)}):
                out[f"{src}/pass@{k}"] = sum(pass_at_k(len(g), sum(t.score > 0 for t in g), k)
                                             for g in gs) / len(gs)
        return out

    @staticmethod
    def dump(groups: list[list], status: list[str], path: str):
        if dist.get_rank() != 0:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            for g, st in zip(groups, status):
                for t in g:
                    f.write(json.dumps(dict(t.to_json(), group_status=st)) + "\n")

    def shutdown(self):
        self.env.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
        close_loop(self.loop)  # (an engine that owns its loop has closed it already)


def shape_overlong(traj, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment, per turn: a turn of L action tokens with
    L > max_new_tokens - buffer loses penalty * (L - (max_new_tokens - buffer)) / buffer (at most
    `penalty`), added to the reward on its last token and to traj.reward. A turn is a maximal run
    of action tokens in a sequence. Returns the total penalty."""
    start, total = max_new_tokens - buffer, 0.0
    for s in traj.samples:
        mask = s["action_mask"].tolist()
        t = 0
        while t < len(mask):
            if not mask[t]:
                t += 1
                continue
            end = t
            while end + 1 < len(mask) and mask[end + 1]:
                end += 1
            length = end - t + 1
            if length > start:
                p = penalty * min(1.0, (length - start) / buffer)
                s["rewards"][end] -= p
                total += p
            t = end + 1
    traj.reward -= total
    return total
