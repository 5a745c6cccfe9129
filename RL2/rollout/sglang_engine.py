"""SGLang rollout engine (GPU only, optional extra): a thin adapter from `sglang.Engine` (0.5.23)
to the RL2 `Engine` interface.

- generate: `async_generate(input_ids=..., sampling_params=..., return_logprob=True)`, one call per
  sample (n calls share the prompt through SGLang's radix cache; each gets its own derived seed).
  Token ids and log-probs come from `meta_info["output_token_logprobs"]`, entries
  (logprob, token_id, text). SGLang's log-probs are log_softmax(logits / T) before top-p/top-k
  (greedy: T = 1), like the torch engine. Seeds go in as `sampling_seed` when this SGLang has it.
- memory: SGLang keeps the released tags in a set and `resume_memory_occupation` does
  `offload_tags.remove(tag)` (a KeyError kills the scheduler for a tag that is not released);
  torch_memory_saver refuses to pause a paused region. So the adapter always names its tags
  explicitly, tracks which are released, and only releases/resumes what it must. The engine is
  released right after start-up (the trainer owns the GPU until the first sync).
- update_weights: inside `begin_weight_update()` / `end_weight_update()` (0.5.23 rejects an
  update outside that session), in dtype-homogeneous buckets cast to the engine's dtype; flush
  the radix cache on the last bucket only. Every call's `(success, message)` is checked: a failed
  update raises instead of leaving the engine sampling from stale or released weight memory.
  Each rank of the rollout tp group hands its own GPU copy of a bucket (`load_format=
  "flattened_bucket"`, one serialised payload per SGLang TP rank, gathered on a gloo group).
- start-up runs with torchrun's TORCHELASTIC_* variables removed: with
  TORCHELASTIC_USE_AGENT_STORE=True, the c10d stores SGLang's subprocesses create all become
  clients of a store nobody serves (torch/distributed/rendezvous.py), and start-up hangs.
- update_adapter (LoRA, `actor.rollout.lora_sync`): the engine starts with `enable_lora`,
  `max_lora_rank` and `lora_target_modules` (0.5.23 needs both without initial `lora_paths`) and
  `enable_weights_cpu_backup` (the base is never pushed again, and a release without the backup
  drops it); each
  sync writes a PEFT directory and `load_lora_adapter`s it under a new name (0.5.23 refuses a
  name that is loaded), requests name it in `lora_path`, and the previous one is unloaded. The
  load/unload calls return `LoRAUpdateOutput(success, error_message)`: a failure raises.
- SGLang binds its asyncio loop at construction (`self.loop`): run rollouts on that loop, and call
  the synchronous methods (update/release/resume/shutdown) outside it.
"""
import asyncio
import contextlib
import inspect
import logging
import os
from typing import Iterable

import torch
import torch.distributed as dist

from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams, check_prompt
from RL2.rollout.sglang_server import context_limit
from RL2.rollout.vllm_transfer import cast_copies
from RL2.rollout.weight_layout import make_buckets
from RL2.utils.process import free_port, port_below_ephemeral
from RL2.utils.seeding import derive_seed
from RL2.workers.lora import AdapterVersions

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20
# sglang/srt/constants.py GPU_MEMORY_TYPE_*. Resume order for a sync: weights, (update), then
# cuda_graph and kv_cache; release all three while training.
WEIGHTS, CUDA_GRAPH, KV_CACHE = "weights", "cuda_graph", "kv_cache"
ALL_TAGS = (WEIGHTS, CUDA_GRAPH, KV_CACHE)


def param_names(cls) -> set[str]:
    """Constructor parameter names of an SGLang config class (dataclass, msgspec Struct or plain)."""
    fields = getattr(cls, "__struct_fields__", None) or getattr(cls, "__dataclass_fields__", None)
    return set(fields) if fields else set(inspect.signature(cls).parameters)


def _accepts_seed() -> bool:
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    except ImportError:
        return False
    return "sampling_seed" in param_names(SGLangSamplingParams)


def nccl_port(slot: int, slots: int, low: int = 22000, high: int = 29999) -> int:
    """A free port for an engine's torch.distributed rendezvous, drawn from its own slice of the
    range SGLang samples when none is given (srt/utils/network.py get_free_port_below_ephemeral:
    below the ephemeral ports, as the scheduler binds it only later). Engines of one host (one
    per base GPU) use disjoint slices: two starting together cannot draw the same port."""
    return port_below_ephemeral(slot, slots, low, high)


def _finish_reason(meta: dict) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


@contextlib.contextmanager
def torchrun_env_scrubbed():
    """Run the body without torchrun's TORCHELASTIC_* variables (restored afterwards)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TORCHELASTIC_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def engine_dtype(model_path: str, dtype: str = "auto") -> torch.dtype:
    """The dtype SGLang 0.5.23 serves `model_path` in (sglang/srt/configs/model_config.py
    `_get_and_verify_dtype`): the config's dtype, fp32 checkpoints as fp16 (Gemma: bf16)."""
    if dtype != "auto":
        return getattr(torch, {"half": "float16", "float": "float32"}.get(dtype, dtype))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    found = getattr(torch, found) if isinstance(found, str) else found
    if found == torch.float32:
        return torch.bfloat16 if config.model_type.startswith("gemma") else torch.float16
    return found


def check_result(result, what: str) -> None:
    """SGLang's weight calls return (success, message); raise on failure."""
    success, message = result
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def serialize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """This rank's payload for `load_format="flattened_bucket"`: the bucket, already in the
    engine dtype on this rank's GPU (`push_buckets`); SGLang TP rank i opens the CUDA-IPC handle
    of payload i."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # CUDA IPC keyed by device uuid (SGLang's own receiver does this)
    flat = FlattenedTensorBucket(named_tensors=bucket)
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()})


def push_buckets(named_tensors, bucket_bytes: int, dtype: torch.dtype, group=None,
                 engine=None) -> None:
    """Every rank of a rollout tp group serialises its own copy of each bucket; the leader (group
    rank 0, holding `engine`) gathers them on the gloo `group` (None: the leader alone) and loads
    them. The leader's status is broadcast after each bucket, so every rank keeps its GPU copy
    until it was read, and every rank raises if an update failed."""
    # each tensor copied as it is taken: the weight-sync stream's shm views are valid only until
    # it writes the bucket after next, and both make_buckets and this loop read ahead
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    buckets = make_buckets(cast_copies(named_tensors, dtype, device), bucket_bytes)
    bucket = next(buckets, None)
    error = _call(engine.begin_weight_update, "begin_weight_update") if engine is not None else None
    while bucket is not None:
        following = next(buckets, None)
        payloads = _gather(serialize_bucket(bucket), group)
        if engine is not None and error is None:
            error = _call(lambda: engine.update_weights_from_tensor(
                named_tensors=payloads, load_format="flattened_bucket",
                flush_cache=following is None), "update_weights_from_tensor")
        error = _from_leader(error, group)
        bucket = following
    if engine is not None:  # always close the session, also after a failed update
        end_error = _call(engine.end_weight_update, "end_weight_update")
        error = error or end_error
    error = _from_leader(error, group)
    if error:
        raise RuntimeError(error)


def _gather(payload, group) -> list | None:
    """Every group member's payload, in group-rank order, on the leader (None elsewhere)."""
    if group is None:
        return [payload]
    leader = dist.get_global_rank(group, 0)
    out = [None] * dist.get_world_size(group) if dist.get_rank() == leader else None
    dist.gather_object(payload, out, dst=leader, group=group)
    return out


def _from_leader(value, group):
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def check_lora_result(result, what: str) -> None:
    """SGLang's LoRA calls return LoRAUpdateOutput(success, error_message); raise on failure."""
    if not result.success:
        raise RuntimeError(f"SGLang {what} failed: {result.error_message}")


def _call(fn, what: str) -> str | None:
    try:
        check_result(fn(), what)
    except RuntimeError as e:
        return str(e)
    return None


class SGLangEngine(Engine):
    def __init__(self, model_path: str, tokenizer=None, *, tp_size: int = 1,
                 mem_fraction_static: float = 0.5, base_gpu_id: int = 0, port: int | None = None,
                 enable_memory_saver: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group=None, lora_rank: int = 0, lora_target_modules=(), lora_dir: str | None = None,
                 **server_args):
        """Extra keyword arguments are passed to `sglang.Engine` (SGLang ServerArgs names).
        `group`: gloo process group of this rollout tp group (this rank is its first member; the
        others hold an `SGLangPeer`), None when the group is this rank alone. `tokenizer` is unused (SGLang loads its own for stop strings).
        `lora_rank` > 0: serve LoRA adapters of that rank on `lora_target_modules`
        (`update_adapter`), written under `lora_dir` (null: a temporary directory)."""
        import sglang

        self.bucket_bytes, self.group = bucket_bytes, group
        self.adapters, self._lora = None, None
        if lora_rank:
            server_args.update(enable_lora=True, max_lora_rank=int(lora_rank),
                               lora_target_modules=list(lora_target_modules))
            # adapter syncs never push the base again, but releasing "weights" frees it without a
            # copy (weight_updater.py release_memory_occupation) unless it is backed up on the CPU
            server_args.setdefault("enable_weights_cpu_backup", True)
            self.adapters = AdapterVersions(lora_dir)
        self.dtype = engine_dtype(model_path, server_args.get("dtype", "auto"))
        server_args.setdefault("nccl_port", nccl_port(base_gpu_id, max(base_gpu_id + 1, torch.cuda.device_count())))
        with torchrun_env_scrubbed():
            self.engine = sglang.Engine(
                model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                base_gpu_id=base_gpu_id, port=port or free_port(),
                enable_memory_saver=enable_memory_saver, **server_args)
        self.loop = self.engine.loop
        # what the scheduler admits (prompt + new tokens), read as for a server (context_limit)
        self.max_model_len = context_limit(self.engine.get_server_info(), 1 << 62)
        self.released: set[str] = set()
        self.release_memory()  # the trainer owns the GPU until the first weight sync
        self.accepts_seed = _accepts_seed()
        if not self.accepts_seed:
            logger.warning("this SGLang has no sampling_seed: seeded requests are not reproducible")
        elif not server_args.get("enable_deterministic_inference"):
            # SGLang builds the per-request seed tensor only in deterministic-inference mode
            # (srt/sampling/sampling_batch_info.py); otherwise sampling_seed is ignored
            logger.warning("SGLang ignores per-request seeds unless "
                           "actor.rollout.sglang.enable_deterministic_inference=true: rollouts "
                           "will not repeat exactly on resume")

    def _sampling_params(self, params: SamplingParams, seed: int | None, prompt_len: int = 0) -> dict:
        out = dict(temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else -1,
                   max_new_tokens=min(params.max_new_tokens, self.max_model_len - prompt_len),
                   skip_special_tokens=False)
        if params.stop:
            out["stop"] = list(params.stop)
        if params.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        if seed is not None and self.accepts_seed:
            out["sampling_seed"] = seed
        return out

    async def _generate_one(self, prompt_ids: list[int], sampling: dict) -> GenerationOutput:
        lora = {"lora_path": self._lora[0]} if self._lora is not None else {}  # the adapter's name
        out = await self.engine.async_generate(input_ids=list(prompt_ids), sampling_params=sampling,
                                               return_logprob=True, **lora)
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        token_ids = [int(e[1]) for e in entries] if entries else list(out.get("output_ids", []))
        return GenerationOutput(token_ids, [float(e[0]) for e in entries], _finish_reason(meta))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        params.validate()
        prompt_ids = check_prompt(prompt_ids, self.max_model_len)
        if self.released:
            raise RuntimeError(f"SGLang memory {sorted(self.released)} is released: sync the "
                               "weights (which resumes it) before generating")
        seeds = [None if params.seed is None else derive_seed(params.seed, i) for i in range(params.n)]
        return list(await asyncio.gather(*[
            self._generate_one(prompt_ids, self._sampling_params(params, seed, len(prompt_ids)))
            for seed in seeds]))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if WEIGHTS in self.released:
            raise RuntimeError("SGLang weights are released: resume ['weights'] before updating")
        push_buckets(named_tensors, self.bucket_bytes, self.dtype, self.group, self.engine)

    def update_adapter(self, named_tensors, config: dict) -> None:
        if self.adapters is None:
            raise RuntimeError("this SGLang engine was built without LoRA (lora_rank=0)")
        self._lora = self.adapters.sync(named_tensors, config, self._load_adapter)

    def _load_adapter(self, new: tuple, previous: tuple | None) -> None:
        check_lora_result(self.engine.load_lora_adapter(lora_name=new[0], lora_path=new[2]), "load_lora_adapter")
        self._lora = new  # requests use it from now on, even if the unload below fails
        if previous is not None:
            check_lora_result(self.engine.unload_lora_adapter(lora_name=previous[0]), "unload_lora_adapter")

    def release_memory(self, tags: list[str] | None = None) -> None:
        todo = [t for t in _tags(tags) if t not in self.released]
        if todo:
            self.engine.release_memory_occupation(tags=todo)
            self.released.update(todo)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        todo = [t for t in _tags(tags) if t in self.released]
        if todo:
            self.engine.resume_memory_occupation(tags=todo)
            self.released.difference_update(todo)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.adapters is not None:
            self.adapters.close()


def _tags(tags) -> list[str]:
    tags = list(ALL_TAGS) if tags is None else list(tags)
    unknown = set(tags) - set(ALL_TAGS)
    if unknown:
        raise ValueError(f"unknown SGLang memory tags {sorted(unknown)}; known: {ALL_TAGS}")
    return tags


class SGLangPeer:
    """The rest of an SGLang rollout tp group (ranks without the engine): they take part in every
    weight update by handing their own GPU copy of each bucket to the leader."""

    def __init__(self, group, bucket_bytes: int, dtype: torch.dtype):
        self.group, self.bucket_bytes, self.dtype = group, bucket_bytes, dtype

    def update_weights(self, named_tensors) -> None:
        push_buckets(named_tensors, self.bucket_bytes, self.dtype, self.group)

    def update_adapter(self, named_tensors, config: dict) -> None:
        for _ in named_tensors:  # the stream is a collective; the leader loads the adapter
            pass

    def release_memory(self, tags=None) -> None:
        pass

    def resume_memory(self, tags=None) -> None:
        pass

    def can_share_weights(self, named_tensors=None) -> bool:
        return False
