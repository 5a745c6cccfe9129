"""Applies DTensor tensor parallelism (Megatron-style TP) to HF Qwen2/Qwen3/Llama/Mistral models,
from a table of per-layer plans keyed by model type.

(Log-probs from vocab-sharded logits: vocab_logps.py; gradient clipping across meshes:
collectives.py.)
"""
import logging

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)

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
