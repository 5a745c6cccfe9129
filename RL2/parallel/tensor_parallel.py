"""Applies DTensor tensor parallelism (Megatron-style TP) to HF Qwen2/Qwen3/Llama/Mistral models,
from a table of per-layer plans keyed by model type.

Also: gradient clipping across meshes. (Log-probs from vocab-sharded logits: vocab_logps.py.)
"""
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)

from RL2.parallel.collectives import check_device, group_device

logger = logging.getLogger(__name__)

# Per-decoder-layer plan, keyed by module path inside `model.layers[i]`. Column-parallel
# projections leave their output sharded on the head / hidden dim; the row-parallel ones consume
# that shard and all-reduce, so each block costs one all-reduce in forward and one in backward.
MEGATRON_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}

# Qwen3 normalises q and k per head, on the local heads (B, T, heads/tp, head_dim). A plain
# replicated weight would only get the gradient of the local heads; as a Replicate DTensor fed a
# head-sharded input (Shard(2)) its gradient is summed over all heads by DTensor. (The style
# wraps the weight with from_local: every rank must hold the same values, as after loading.)
QK_NORM_PLAN = {
    "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
}

# The layer plan of each supported `config.model_type`; a new architecture is one entry.
TP_PLANS = {
    "qwen2": MEGATRON_PLAN,
    "qwen3": {**MEGATRON_PLAN, **QK_NORM_PLAN},
    "llama": MEGATRON_PLAN,
    "mistral": MEGATRON_PLAN,
}
SUPPORTED_MODEL_TYPES = tuple(TP_PLANS)


def validate_tp(config, tp_size: int) -> bool:
    """Check that `config` can be split over `tp_size` ranks.

    Steps:
    1. the architecture must be one whose plan is known (Qwen2, Qwen3, Llama, Mistral);
    2. attention heads, key/value heads and the MLP width must be divisible by tp_size;
    3. the vocabulary: if divisible, embeddings and lm_head are vocab-parallel; otherwise they stay
       replicated (logged) — correct, only less memory-efficient.
    Returns True when the vocabulary will be sharded.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor parallelism supports model_type in {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
            f"set tp_size=1 for this model")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, key)
        if value % tp_size:
            raise ValueError(f"{key}={value} is not divisible by tp_size={tp_size}")
    vocab_parallel = config.vocab_size % tp_size == 0
    if not vocab_parallel:
        logger.warning(
            f"vocab_size={config.vocab_size} is not divisible by tp_size={tp_size}: "
            f"keeping embeddings and lm_head replicated")
    return vocab_parallel


def apply_tp(model: nn.Module, tp_mesh):
    """Shard an HF decoder (CausalLM or TokenClassification) over the 1-D `tp_mesh`.

    Steps:
    1. validate the config (raises on unsupported architectures / indivisible sizes);
    2. each decoder layer: the plan of its model type (`TP_PLANS`): column-parallel
       q/k/v/gate/up, row-parallel o/down; HF attention reshapes with -1 heads, so local head
       counts need no patch; Qwen3's per-head q/k norms get head-sharded inputs;
    3. causal LMs with a divisible vocabulary: row-parallel (vocab-sharded) embeddings and a
       vocab-parallel lm_head whose logits stay a DTensor sharded on the last dim
       (consume them with `logps_and_entropy`); tied weights are re-tied to one DTensor,
       possible because both are sharded on the vocab dim (Shard(0));
    4. everything else (norms, rotary, a value/score head) stays replicated.
    """
    tp_size = tp_mesh.size()
    vocab_parallel = validate_tp(model.config, tp_size)
    base = getattr(model, model.base_model_prefix, model)
    plan = TP_PLANS[model.config.model_type]
    for layer in base.layers:
        parallelize_module(layer, tp_mesh, plan)
        _localize_head_counts(layer.self_attn, tp_size)

    lm_head = getattr(model, "lm_head", None)
    if vocab_parallel and lm_head is not None:
        embed = base.embed_tokens
        tied = lm_head.weight is embed.weight
        prefix = "" if base is model else f"{model.base_model_prefix}."
        parallelize_module(model, tp_mesh, {
            # Masked local lookup, then all-reduce: the output is an ordinary replicated tensor.
            f"{prefix}embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        if tied:
            model.lm_head.weight = base.embed_tokens.weight
    logger.info(f"Applied tensor parallelism to the model (tp={tp_size}, "
                f"vocab_parallel={vocab_parallel and lm_head is not None})")
    return model


def _localize_head_counts(attn: nn.Module, tp_size: int):
    """Divide head-count attributes, for attention classes that reshape with them (HF's
    Qwen2/Qwen3/Llama/Mistral reshape with -1 and keep none; num_key_value_groups is a ratio)."""
    for name in ("num_heads", "num_attention_heads", "num_key_value_heads"):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, getattr(attn, name) // tp_size)


@torch.no_grad()
def grad_norm_and_clip(params, max_norm: float | None) -> float:
    """Total L2 norm of the gradients of `params` (any mix of meshes / placements), then clip.

    Steps:
    1. per gradient, the squared L2 norm of the local shard (Partial grads are first reduced);
    2. sum these per set of process groups the gradient is sharded over (replicated mesh dims
       hold copies and are not reduced; plain tensors are treated as replicated);
    3. all-reduce each sum over its groups, add up: every rank gets the same total;
    4. if max_norm > 0 and the norm is finite, scale every gradient by min(1, max_norm / norm).
    A non-finite norm leaves gradients untouched; callers should skip the optimizer step.
    """
    grads = [p.grad for p in params if p.grad is not None]
    buckets: dict[tuple, torch.Tensor] = {}
    for g in grads:
        groups = ()
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                               for pl in g.placements])
            mesh = g.device_mesh
            # Any non-Replicate dim is sharded (FSDP x TP uses _StridedShard, not a Shard).
            groups = tuple(mesh.get_group(d) for d, pl in enumerate(g.placements)
                           if not pl.is_replicate() and mesh.size(d) > 1)
            g = g.to_local()
        sq = g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum().to(torch.float64)
        # Insertion order is the parameter order, the same on every rank: collectives line up.
        buckets[groups] = buckets.get(groups, 0) + sq
    total = 0.0
    for groups, sq in buckets.items():
        for group in groups:
            # grads may live on the CPU (offload_params) while NCCL serves CUDA only
            sq = sq.to(group_device(group))
            dist.all_reduce(check_device(sq, group), group=group)
        total += sq.item()
    norm = math.sqrt(total)
    if max_norm is not None and max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm
