"""Applies DTensor tensor parallelism (Megatron-style TP) to HF Qwen2/Qwen3/Llama/Mistral models.

Also: log-probs / entropy from vocab-sharded logits, and gradient clipping across meshes.
"""
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")

# Per-decoder-layer plan, keyed by module path inside `model.layers[i]`. Column-parallel
# projections leave their output sharded on the head / hidden dim; the row-parallel ones consume
# that shard and all-reduce, so each block costs one all-reduce in forward and one in backward.
LAYER_PLAN = {
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

# Logits/log-prob work is done in token chunks of about this many local-vocab elements.
_CHUNK_ELEMENTS = 1 << 24


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
    2. each decoder layer: column-parallel q/k/v/gate/up, row-parallel o/down (`LAYER_PLAN`);
       HF attention reshapes with -1 heads, so local head counts need no patch; Qwen3's
       per-head q/k norms get head-sharded inputs (`QK_NORM_PLAN`);
    3. causal LMs with a divisible vocabulary: row-parallel (vocab-sharded) embeddings and a
       vocab-parallel lm_head whose logits stay a DTensor sharded on the last dim
       (consume them with `logps_and_entropy`); tied weights are re-tied to one DTensor,
       possible because both are sharded on the vocab dim (Shard(0));
    4. everything else (norms, rotary, a value/score head) stays replicated.
    """
    tp_size = tp_mesh.size()
    vocab_parallel = validate_tp(model.config, tp_size)
    base = getattr(model, model.base_model_prefix, model)
    for layer in base.layers:
        plan = dict(LAYER_PLAN)
        if hasattr(layer.self_attn, "q_norm"):
            plan.update(QK_NORM_PLAN)
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
    """Divide head-count attributes, for attention classes that reshape with them (transformers
    5.23's Qwen2/Qwen3/Llama/Mistral use -1 and keep none; num_key_value_groups is a ratio)."""
    for name in ("num_heads", "num_attention_heads", "num_key_value_heads"):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, getattr(attn, name) // tp_size)


def logps_and_entropy(logits, labels: torch.Tensor, temperature: float = 1.0,
                      need_entropy: bool = False):
    """Log-probs of `labels` under softmax(logits / temperature), and optionally the entropy.

    `logits` (..., V) is a plain tensor or a DTensor sharded on the vocab dim (Shard(-1)) over one
    mesh dim (other mesh dims replicated). Each rank works on its local vocab shard only; the
    log-sum-exp, the label logit and sum(p*z) are all-reduced over the shard group. `labels`
    (...) are global vocab ids. Returns (logps (...), entropy (...) or None) as plain tensors,
    differentiable w.r.t. `logits`.
    """
    group, vocab_start = None, 0
    if isinstance(logits, DTensor):
        group, vocab_start = _vocab_shard_group(logits)
        logits = logits.to_local()  # autograd-aware: gradients return as the same DTensor layout
    shape = logits.shape[:-1]
    local = logits.reshape(-1, logits.shape[-1])
    logps, entropy = _VocabParallelLogps.apply(
        local, labels.reshape(-1), vocab_start, group, float(temperature), need_entropy)
    return logps.view(shape), (entropy.view(shape) if need_entropy else None)


def _vocab_shard_group(logits: DTensor):
    """The process group the vocab dim is sharded over, and this rank's first vocab id."""
    mesh, sharded = logits.device_mesh, []
    for dim, placement in enumerate(logits.placements):
        if isinstance(placement, Partial):
            raise ValueError("logits must not be Partial; redistribute them to Shard(-1) first")
        if placement.is_shard():
            if placement.dim not in (-1, logits.ndim - 1):
                raise ValueError(f"logits must be sharded on the vocab dim, got {logits.placements}")
            sharded.append(dim)
    if not sharded:
        return None, 0
    if len(sharded) > 1:
        raise ValueError(f"logits sharded over several mesh dims: {logits.placements}")
    dim = sharded[0]
    # torch.chunk semantics: every rank but the last holds ceil(V / n) columns.
    chunk = math.ceil(logits.shape[-1] / mesh.size(dim))
    return mesh.get_group(dim), mesh.get_local_rank(dim) * chunk


class _VocabParallelLogps(torch.autograd.Function):
    """Exact log-softmax statistics over a vocab split across ranks, with an analytic backward.

    Forward, per token chunk of z = local logits / T (no division when T == 1): the local
    log-sum-exp l_r (one fused pass), the label logit (0 if another rank owns it) and, for the
    entropy, the local entropy H_r (sums of small terms: accurate for large logits too). Two
    all-reduces combine them: M = max_r l_r, then [sum_r exp(l_r - M), label logit,
    sum_r exp(l_r - M) * (H_r + M - l_r)], so lse = M + log(S0) and H = S2 / S0 + log(S0).
    Backward needs no communication: with p = exp(z - lse), E[z] = lse - H,
      dlogp/dz = onehot - p,  dH/dz = p * (E[z] - z),
    computed in place on one chunk-sized buffer. The outputs are identical on all ranks and every
    rank computes the same loss from them, so each rank's upstream gradient is already the full
    one (the all-reduce's backward is identity).
    """

    @staticmethod
    def forward(ctx, local, labels, vocab_start, group, temperature, need_entropy):
        n_tok, v_local = local.shape
        dtype = torch.promote_types(local.dtype, torch.float32)
        rows = max(1, _CHUNK_ELEMENTS // max(v_local, 1))
        scale = None if temperature == 1.0 else 1.0 / temperature
        in_shard = (labels >= vocab_start) & (labels < vocab_start + v_local)
        local_idx = torch.where(in_shard, labels - vocab_start, 0)

        local_lse = torch.empty(n_tok, dtype=dtype, device=local.device)
        sums = torch.empty(3 if need_entropy else 2, n_tok, dtype=dtype, device=local.device)
        for s in range(0, n_tok, rows):
            sl = slice(s, s + rows)
            z = local[sl].to(dtype)
            if scale is not None:
                z = z * scale
            local_lse[sl] = torch.logsumexp(z, -1)
            label_z = z.gather(-1, local_idx[sl, None]).squeeze(-1)
            sums[1, sl] = torch.where(in_shard[sl], label_z, 0)
            if need_entropy:  # local entropy H_r = -sum p (z - l_r), p = exp(z - l_r): small terms
                d = z - local_lse[sl, None]
                sums[2, sl] = -(d.exp() * d).sum(-1)
        group_max = local_lse.clone()
        _all_reduce(group_max, dist.ReduceOp.MAX, group)
        sums[0] = (local_lse - group_max).exp()
        if need_entropy:  # H = sum_r w_r (H_r + lse - l_r), w_r = exp(l_r - M) / S0
            sums[2] = sums[0] * (sums[2] + group_max - local_lse)
        _all_reduce(sums, dist.ReduceOp.SUM, group)

        lse = group_max + sums[0].log()
        logps = sums[1] - lse
        entropy = sums[2] / sums[0] + sums[0].log() if need_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(local, local_idx, in_shard, lse, entropy)
        ctx.scale, ctx.rows, ctx.need_entropy = scale, rows, need_entropy
        if not need_entropy:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        local, local_idx, in_shard, lse, entropy = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        dtype = lse.dtype
        grad = torch.empty_like(local)
        use_entropy = ctx.need_entropy and grad_entropy is not None
        g_lp = grad_logps if grad_logps is not None else torch.zeros_like(lse)
        mean_z = lse - entropy
        for s in range(0, local.shape[0], rows):
            sl = slice(s, s + rows)
            g = local[sl].to(dtype, copy=True)  # z; then p; then the gradient, in place
            if scale is not None:
                g.mul_(scale)
            if use_entropy:
                h = (mean_z[sl, None] - g).mul_(grad_entropy[sl, None])
            g.sub_(lse[sl, None]).exp_()
            if use_entropy:
                h.mul_(g)  # p * (E[z] - z) * dL/dH
            g.mul_(-g_lp[sl, None])
            g.scatter_add_(-1, local_idx[sl, None], (g_lp[sl] * in_shard[sl])[:, None])
            if use_entropy:
                g.add_(h)
            if scale is not None:
                g.mul_(scale)
            grad[sl] = g
        return grad, None, None, None, None, None


def _all_reduce(tensor: torch.Tensor, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


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
            dist.all_reduce(sq, group=group)
        total += sq.item()
    norm = math.sqrt(total)
    if max_norm is not None and max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm
