"""A worker: one HF model sharded over every rank (FSDP2 + optional TP/SP), its optimizer and
scheduler, and the packed forward used by all trainers."""
import inspect
import logging
import math

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from RL2.algorithms.losses import upcast
from RL2.data.packing import (MicroBatch, imbalance_note, micro_batch_loads, pack, plan_micro_batches,
                              resolve_share_prompt, share_prefixes, token_capacity, unpack)
from RL2.parallel import host_comm
from RL2.parallel.attention import PackedContext, check_sp_rope, config_rope_types, packed_kwargs, rope_types
from RL2.parallel.collectives import gather_objects
from RL2.parallel.fsdp import parallelize, reshard, resolve_reshard
from RL2.parallel.mesh import ParallelDims
from RL2.utils import cpu_ops, onednn
from RL2.utils.config import check_choice, resolve_dtype
from RL2.workers import last_layer, lora
from RL2.workers.loading import load_sharded, model_config

logger = logging.getLogger(__name__)


def make_scheduler(optimizer, cfg: DictConfig, total_steps: int):
    warmup = int(cfg.warmup_ratio * total_steps)
    floor = cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if cfg.scheduler == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if cfg.scheduler == "linear":
            return floor + (1 - floor) * (1 - progress)
        raise ValueError(f"unknown scheduler {cfg.scheduler!r}: use constant, cosine or linear")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def takes_positions_to_keep(model) -> bool:
    """Whether `model`'s forward is transformers' own and takes `logits_to_keep`, which since
    transformers 4.56 (our floor) reads a 1-D tensor as the positions to compute logits for.
    Remote code may read the argument as a count of last positions: not used there."""
    cls = next((c for c in type(model).__mro__ if "forward" in c.__dict__), None)
    return (cls is not None and cls.__module__.startswith("transformers.")
            and "logits_to_keep" in inspect.signature(cls.forward).parameters)


class Worker:
    def __init__(self, cfg: DictConfig, device: str, *, value_head: bool = False,
                 train: bool = True, total_steps: int = 1, seed: int = 0):
        self.cfg, self.device, self.value_head, self.train = cfg, device, value_head, train
        self.dims = ParallelDims(dist.get_world_size(), cfg.ddp_size, cfg.tp_size, cfg.sp_size, device)
        self.compute_dtype = resolve_dtype(cfg.dtype, device)
        prune = last_layer.resolve(cfg, device)  # a bad value stops the run before loading
        choice = check_choice(cfg.get("cpu_matmul", "auto"), "cpu_matmul", onednn.CHOICES)
        cpu_matmul = onednn.resolve(choice)
        if choice == "auto" and device == "cpu":
            logger.info("cpu_matmul=auto: %s (CPU vendor %r)", cpu_matmul, onednn.cpu_vendor() or "unknown")
        cpu_comm = check_choice(cfg.get("cpu_comm", "shm"), "cpu_comm", host_comm.CHOICES)
        self.reshard_after_forward = resolve_reshard(cfg.reshard_after_forward, device)
        # Master weights stay fp32 (fp64 when asked for, e.g. exactness tests).
        master = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        torch.manual_seed(seed)  # a fresh value head is drawn on rank 0 and broadcast

        def shard(model):
            if train and cfg.gradient_checkpointing:
                model.config.use_cache = False
            parallelize(model, self.dims, param_dtype=self.compute_dtype,
                        gradient_checkpointing=train and cfg.gradient_checkpointing,
                        offload_params=cfg.offload_params,
                        reshard_after_forward=self.reshard_after_forward,
                        cpu_comm=cpu_comm)

        # offload_params: FSDP2 keeps the shards on the host and moves them in for compute
        where = torch.device("cuda", torch.cuda.current_device()) if (
            device == "cuda" and not cfg.offload_params) else torch.device("cpu")
        self.peft = None  # the PeftModel around self.model when LoRA is on (RL2/workers/lora.py)

        def prepare(model):
            if lora.enabled(cfg):
                self.peft = lora.apply_lora(model, cfg.lora, value_head,
                                            lora.base_dtype(cfg.lora, device, master))

        if self.dims.sp > 1:  # before any weight is read
            check_sp_rope(config_rope_types(model_config(cfg.model_name, value_head, cfg.trust_remote_code)),
                          self.dims.sp)
        self.model = load_sharded(cfg.model_name, value_head, master, cfg.trust_remote_code,
                                  shard, where, prepare)
        if cpu_matmul == "onednn" and device == "cpu":
            n = onednn.use_for_linears(self.model)  # TP's DTensor weights keep F.linear
            logger.info("cpu_matmul=onednn: %d linear layers computed by oneDNN", n)
        if cfg.get("cpu_fused_ops", True) and device == "cpu":  # DTensor / non-fp32: HF's forward
            logger.info("cpu_fused_ops: %d RMSNorms, %d MLPs, %d attentions and %d rotary "
                        "embeddings through RL2's kernel", *cpu_ops.use_for_model(self.model),
                        cpu_ops.use_attention(self.model), cpu_ops.use_rope(self.model))
        self.config = self.model.config
        self.logits_for_actions_only = not value_head and takes_positions_to_keep(self.model)
        # ... and the last layer only at those rows (its keys and values everywhere)
        self.prune_last_layer = (self.logits_for_actions_only and prune
                                 and last_layer.install(self.model))
        if cfg.get("prune_last_layer") is True and not self.prune_last_layer:
            logger.warning("prune_last_layer=true: not applied (%s)", "a value model" if value_head
                           else "a model family or forward last_layer.py does not know")
        self._pruned_logged = self._imbalance_logged = False
        # pairs (DPO, RM: `flatten_pairs`) and samples that repeat an earlier one's first tokens
        # (`plan`) compute them once; the PPO critic reads values at prompt tokens of every
        # sample, so `plan` keeps a value model's samples whole
        self.share_prompt = resolve_share_prompt(cfg, device)
        check_sp_rope(rope_types(self.model), self.dims.sp)
        # ring attention's K/V blocks through shared memory, as FSDP's collectives (cpu_comm)
        self.ring_host = None
        if device == "cpu" and cpu_comm == "shm" and self.dims.sp > 1:
            self.ring_host = host_comm.shared_group(self.dims.sp_group, "ring attention")
        self.capacity = token_capacity(cfg)
        self.optimizer = self.scheduler = None
        self.nonfinite_streak = 0  # optimizer steps skipped in a row for a non-finite grad norm
        if train:
            trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters (+ head)
            self.optimizer = torch.optim.AdamW(
                trainable, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                # fused: one kernel per parameter list, no per-param DTensor dispatch (well ahead
                # of foreach=True, on CPU too)
                weight_decay=cfg.weight_decay, fused=True)
            self.scheduler = make_scheduler(self.optimizer, cfg, total_steps)
        else:
            self.model.eval()

    def adapters_disabled(self):
        """Context: the frozen base model (LoRA adapters bypassed), e.g. as the reference."""
        return lora.adapters_disabled(self.peft)

    # ----- batching -----
    def plan(self, samples: list[dict], groups: list[list[int]] | None = None) -> list[MicroBatch]:
        """This rank's packed micro-batches; the plan is made on rank 0 and broadcast so every
        rank agrees on it even if tie-breaks differ. With `share_prompt`, no `groups` and a causal
        LM (a value model keeps its samples whole: the PPO critic reads every token), samples
        that begin alike (a GRPO group's prompt) are packed as tails continuing one shared
        prefix sequence (`packing.share_prefixes`; micro-batches then also hold those prefixes,
        with action_mask 0); per-token outputs cover the tails."""
        return self._plan(*self._layout(samples, groups)[:2], note=True)

    def _layout(self, samples: list[dict], groups: list[list[int]] | None, share: bool | None = None):
        """(samples, groups, tokens each sample leaves to a shared prefix or None) as packed.
        `share`: whether the caller reads nothing at shared prompt tokens (None: a causal LM's
        log-probs, yes; a value model's values, no)."""
        share = not self.value_head if share is None else share
        if groups is None and self.share_prompt and share:
            return share_prefixes(samples, self.capacity, self.dims.dp)
        return samples, groups, None

    def _plan(self, samples: list[dict], groups: list[list[int]] | None,
              note: bool = False) -> list[MicroBatch]:
        """`note`: a training pass; the first unbalanced one of the run is logged."""
        lengths = [len(s["input_ids"]) for s in samples]
        plan = [None]
        if dist.get_rank() == 0:
            plan[0] = plan_micro_batches(lengths, self.dims.dp, self.capacity, groups=groups,
                                         sp_size=self.dims.sp)
        dist.broadcast_object_list(plan, src=0)
        if note and not self._imbalance_logged and dist.get_rank() == 0:
            message = imbalance_note(micro_batch_loads(plan[0], lengths, self.dims.sp))
            if message:  # once a run: a step of few long sequences does this every time
                self._imbalance_logged = True
                logger.warning("%s: %s (logged once)", type(self).__name__.lower(), message)
        return [pack(samples, idx, self.dims.sp, self.dims.sp_rank).to(self.device)
                for idx in plan[0][self.dims.dp_rank]]

    # ----- forward -----
    def forward(self, mb: MicroBatch, temperature: float = 1.0, need_entropy: bool = False) -> dict:
        """Per-token outputs of one micro-batch (local to this sp rank): `logps` (+`entropy`) of
        `labels` for a causal LM (0 outside `action_mask` when the model takes
        `logits_to_keep`), `values` for a value model."""
        ctx = PackedContext(mb.cu_seqlens, mb.max_seqlen, self.dims.sp_group, self.ring_host,
                            mb.prefix_lens)
        keep = self._action_positions(mb)  # None for a value model (logits_for_actions_only off)
        rows = keep  # the rows of the model's output that `keep` is
        if keep is not None and self.prune_last_layer:
            pruned = last_layer.plan(ctx, keep)
            rows = keep if pruned is None else pruned
            if pruned is not None and not self._pruned_logged:
                self._pruned_logged = True
                logger.info("prune_last_layer: the last layer at %d of %d rows (keys and values at "
                            "all) in the first micro-batch that skips any", len(ctx.last_rows[0]),
                            len(mb.data["input_ids"]))
        out = self.model(input_ids=mb.data["input_ids"][None], position_ids=mb.data["position_ids"][None],
                         use_cache=False, **packed_kwargs(ctx),
                         **({} if keep is None else {"logits_to_keep": rows}))
        logits = out.logits
        if self.value_head:
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            return {"values": upcast(logits[0, :, 0])}
        from RL2.parallel.vocab_logps import logps_and_entropy

        labels = mb.data["labels"]
        logps, entropy = logps_and_entropy(logits[0], labels if keep is None else labels[keep],
                                           temperature, need_entropy)
        result = {"logps": logps, "entropy": entropy} if need_entropy else {"logps": logps}
        if keep is not None:  # 0 where no loss or metric reads a value (every use is masked);
            # x 1 on action tokens, x 0 on a padding micro-batch's stand-in row
            kept = mb.data["action_mask"][keep] != 0
            result = {k: v.new_zeros(len(labels)).index_copy(0, keep, v * kept)
                      for k, v in result.items()}
        return result

    def _action_positions(self, mb: MicroBatch) -> torch.Tensor | None:
        """The positions whose log-probs anything reads (`action_mask`: every loss, KL, metric
        and check weights by it), as indices for the model's `logits_to_keep`, so the lm_head
        and the log-softmax skip prompts (TRL's GRPO does the same; the head is ~20% of a
        SmolLM2 token's compute). None: every position (nothing to skip, or the model does not
        take `logits_to_keep`)."""
        if not self.logits_for_actions_only:
            return None
        mask = mb.data["action_mask"]
        keep = mask.nonzero()[:, 0]
        if len(keep) == len(mask):
            return None
        return keep if len(keep) else keep.new_zeros(1)  # a padding micro-batch: one row

    @torch.no_grad()
    def infer(self, samples: list[dict], key: str, groups: list[list[int]] | None = None,
              share: bool | None = None, **kw) -> list[torch.Tensor]:
        """Run `forward` over every sample and return output `key` per sample, in order, on every
        rank (micro-batches are spread over dp ranks, then gathered; `groups` as for `plan`,
        `share` as for `_layout`: outputs at shared prompt tokens then read 0)."""
        was_training = self.model.training
        self.model.eval()
        n, local = len(samples), {}
        samples, groups, dropped = self._layout(samples, groups, share)  # outputs back at full length
        for mb in self._plan(samples, groups):
            out = self.forward(mb, **kw)[key]
            # i >= n: a shared prefix's own sequence (`share_prefixes`)
            kept = [(i, t.detach()) for i, t in zip(mb.indices, unpack(mb, out, self.dims.sp_group)) if i < n]
            if not kept:
                continue
            # one host copy per micro-batch: each .cpu() of a CUDA tensor waits for the GPU
            host = upcast(torch.cat([t for _, t in kept])).cpu().split([len(t) for _, t in kept])
            for (i, _), t in zip(kept, host):
                if dropped and dropped[i]:  # left to its group's prefix: nothing reads them (0 there)
                    t = torch.cat([t.new_zeros(dropped[i], *t.shape[1:]), t])
                local[i] = t
        if was_training:
            self.model.train()
        if self.train and not self.reshard_after_forward:
            # a no-grad pass has no backward to free what it gathered: free it here, so the
            # shards are what the next rollout or sync sees. A frozen model (the reference)
            # keeps its gathered weights for the run: its one all-gather is its last.
            reshard(self.model)
        host_comm.trim(self.model)
        merged = {}
        for part in gather_objects(local):
            merged.update(part)
        return [merged[i] for i in range(n)]

    # ----- update -----
    def all_reduce_metric(self, value: float) -> float:
        """Sum of a per-rank partial metric over data ranks; tp ranks hold copies, so divide."""
        return self.all_reduce_metrics([value])[0]

    def all_reduce_metrics(self, values) -> list[float]:
        """`all_reduce_metric` of each value, in one collective (each is a round trip through
        the backend: ~1 ms on gloo between two busy processes)."""
        from RL2.parallel.collectives import all_reduce_floats

        return [v / self.dims.tp for v in all_reduce_floats(list(values))]

    def step(self) -> float:
        """Clip by the global grad norm, take an optimizer step; returns the pre-clip norm."""
        from RL2.parallel.collectives import clip_coefficient, grad_norm as total_norm

        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = total_norm(params)
        if math.isfinite(grad_norm):
            self._move_optimizer_state(to_params=True)
            self._clipped_step(params, clip_coefficient(grad_norm, self.cfg.max_grad_norm))
            self._move_optimizer_state(to_params=False)
            self.nonfinite_streak = 0
        else:
            # the norm is global, so every rank skips (and stops) at the same step
            self.nonfinite_streak += 1
            limit = self.cfg.get("max_nonfinite_steps", 0) or 0
            logger.warning(f"grad norm is {grad_norm}; skipping the optimizer step "
                           f"({self.nonfinite_streak} in a row)")
            if 0 < limit <= self.nonfinite_streak:
                raise FloatingPointError(
                    f"the gradients were non-finite (grad norm {grad_norm}) in {self.nonfinite_streak} "
                    f"optimizer steps in a row (max_nonfinite_steps={limit}): the run has diverged "
                    "or its data makes the loss non-finite; stopping (the last checkpoint is intact)")
        self.optimizer.zero_grad(set_to_none=True)
        host_comm.trim(self.model)  # no pooled FSDP buffers between steps (rollouts, syncs)
        self.scheduler.step()
        return grad_norm

    def _clipped_step(self, params, coef: float | None):
        """The optimizer step on the gradients scaled by `coef` (None: as they are). Fused AdamW
        unscales as it reads: `grad_scale`, the divisor torch.amp.GradScaler hands an optimizer
        with `_step_supports_amp_scaling` (torch/optim/adam.py), saves a pass over every
        gradient (25.7M fp32: ~5 ms of a 0.8 s DPO step, 2 threads; benchmarks/README fix 51)."""
        if coef is None:
            self.optimizer.step()
        elif getattr(self.optimizer, "_step_supports_amp_scaling", False):
            self.optimizer.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32,
                                                     device=params[0].device)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale
        else:
            for p in params:
                p.grad.mul_(coef)
            self.optimizer.step()

    def _move_optimizer_state(self, to_params: bool):
        """`offload_optimizer`: AdamW moments live on the CPU between steps and, for the step, on
        the device of their parameter's shard (the CPU too with `offload_params`: the fused
        AdamW kernel needs the state beside the parameter)."""
        if not self.cfg.offload_optimizer:
            return
        for param, state in self.optimizer.state.items():
            local = param.to_local() if hasattr(param, "to_local") else param
            device = local.device if to_params else torch.device("cpu")
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":
                    state[k] = v.to(device)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]
