"""Weight sync: training shards (FSDP2 / TP DTensors) -> full tensors with HF names -> engine.

Every rank walks the state dict in the same order (`full_tensor()` is a collective), so this must
run outside any rollout coroutine. The engine receives one lazy stream of tensors: the torch
engine copies each as it arrives (peak extra memory: one tensor); the SGLang adapter groups them
into dtype-homogeneous buckets of bounded size and flushes its cache once, after the last.
"""
import logging
import time
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def iter_full_tensors(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter and buffer of a sharded model; a collective."""
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def sync_weights(model, engine, dtype: torch.dtype | None = None) -> dict:
    """Push the current training weights into `engine` (None on ranks that hold no engine; they
    still take part in the gathers). Returns timing metrics."""
    start = time.perf_counter()
    n_bytes = 0

    def counted():
        nonlocal n_bytes
        for name, t in iter_full_tensors(model, dtype):
            n_bytes += t.numel() * t.element_size()
            yield name, t

    if engine is None:
        for _ in counted():
            pass
    else:
        engine.resume_memory(["weights"])
        engine.update_weights(counted())
        engine.resume_memory(["kv_cache"])
    return {"sync_seconds": time.perf_counter() - start, "sync_bytes": n_bytes}
