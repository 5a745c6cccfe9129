"""SGLang rollout engine (GPU only, optional extra): a thin adapter from `sglang.Engine` to the
RL2 `Engine` interface.

- generate: `async_generate(input_ids=..., sampling_params=..., return_logprob=True)`, one call per
  sample (n calls share the prompt through SGLang's radix cache; each gets its own derived seed).
  Token ids and log-probs come from `meta_info["output_token_logprobs"]`, entries
  (logprob, token_id, text). SGLang's log-probs are log_softmax(logits / T) before top-p/top-k
  (greedy: T = 1), like the torch engine. Seeds go in as `sampling_seed` when this SGLang has it
  (SGLang applies it under its deterministic-inference mode).
- update_weights: full tensors in dtype-homogeneous buckets of bounded size
  (`make_buckets`), `update_weights_from_tensor` per bucket, flush_cache only on the last one.
- release/resume_memory: `release_memory_occupation` / `resume_memory_occupation` with tags
  ("weights", "kv_cache"; needs enable_memory_saver=True). Weight sync order: resume ["weights"]
  -> update_weights -> resume ["kv_cache"].
- SGLang binds its asyncio loop at construction (`self.loop`): run rollouts on that loop, and call
  the synchronous methods (update/release/resume/shutdown) outside it — they run
  `loop.run_until_complete` internally.
"""
import asyncio
import inspect
import logging
import socket
from typing import Iterable, Iterator

import torch

from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams
from RL2.utils.seeding import derive_seed

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20


def make_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into buckets of one dtype holding <= bucket_bytes (a tensor
    larger than bucket_bytes gets a bucket of its own). Streams: a bucket is yielded as soon as the
    next tensor of its dtype would overflow it; the rest are yielded at the end. Within a dtype
    the input order is kept."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    open_buckets: dict[torch.dtype, tuple[list, int]] = {}
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        bucket, size = open_buckets.get(tensor.dtype, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        open_buckets[tensor.dtype] = (bucket, size + nbytes)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish_reason(meta: dict) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


class SGLangEngine(Engine):
    def __init__(self, model_path: str, tokenizer=None, *, tp_size: int = 1,
                 mem_fraction_static: float = 0.5, base_gpu_id: int = 0, port: int | None = None,
                 enable_memory_saver: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 **server_args):
        """Extra keyword arguments are passed to `sglang.Engine` (SGLang ServerArgs names).
        `tokenizer` is unused (SGLang loads its own from model_path for stop strings)."""
        import sglang

        self.bucket_bytes = bucket_bytes
        self.engine = sglang.Engine(
            model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
            base_gpu_id=base_gpu_id, port=port or _free_port(),
            enable_memory_saver=enable_memory_saver, **server_args)
        self.loop = self.engine.loop
        self.accepts_seed = _accepts_seed()
        if not self.accepts_seed:
            logger.warning("this SGLang has no sampling_seed: seeded requests are not reproducible")

    def _sampling_params(self, params: SamplingParams, seed: int | None) -> dict:
        out = dict(temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else -1,
                   max_new_tokens=params.max_new_tokens, skip_special_tokens=False)
        if params.stop:
            out["stop"] = list(params.stop)
        if params.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        if seed is not None and self.accepts_seed:
            out["sampling_seed"] = seed
        return out

    async def _generate_one(self, prompt_ids: list[int], sampling: dict) -> GenerationOutput:
        out = await self.engine.async_generate(input_ids=list(prompt_ids), sampling_params=sampling,
                                               return_logprob=True)
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        token_ids = [int(e[1]) for e in entries] if entries else list(out.get("output_ids", []))
        return GenerationOutput(token_ids, [float(e[0]) for e in entries], _finish_reason(meta))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        params.validate()
        if not prompt_ids:
            raise ValueError("empty prompt: generation needs at least one prompt token")
        seeds = [None if params.seed is None else derive_seed(params.seed, i) for i in range(params.n)]
        return list(await asyncio.gather(*[
            self._generate_one(prompt_ids, self._sampling_params(params, seed)) for seed in seeds]))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Hold one bucket back so that only the last one flushes the radix cache.
        pending = None
        for bucket in make_buckets(named_tensors, self.bucket_bytes):
            if pending is not None:
                self.engine.update_weights_from_tensor(named_tensors=pending, flush_cache=False)
            pending = bucket
        if pending is not None:
            self.engine.update_weights_from_tensor(named_tensors=pending, flush_cache=True)

    def release_memory(self, tags: list[str] | None = None) -> None:
        self.engine.release_memory_occupation(tags=tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.engine.resume_memory_occupation(tags=tags)

    def shutdown(self) -> None:
        self.engine.shutdown()
