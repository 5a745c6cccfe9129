"""Packed-sequence attention for ordinary HF models, registered as attn_implementation "rl2_packed".

Load the model with `attn_implementation=register()` and call it on one packed row:
    model(input_ids=ids[None], position_ids=pos[None], use_cache=False, **packed_kwargs(ctx))
HF forwards unknown model kwargs (TransformersKwargs) from `model(...)` through the decoder layers
into the attention function, so the per-batch `PackedContext` travels with the call and no global
state is needed. The registered mask function returns None for the plain causal case, so HF never
builds a T x T mask; the attention function then runs causal attention inside every packed
sequence (CPU: SDPA per sequence, or RL2's C kernel for modules `cpu_ops.use_attention` marked;
CUDA fp16/bf16: flash-attn varlen if installed; with an sp group: zig-zag ring attention). A
sequence may also continue the prefix of an earlier one (shared prompts: the same kernels over
gathered keys, with a bottom-right causal mask). Without a context (generate, padded batches) it
behaves like HF "sdpa".
"""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from RL2.parallel.ring_attention import ring_attention

logger = logging.getLogger(__name__)

NAME = "rl2_packed"
CTX_KWARG = "rl2_ctx"


class PackedContext:
    """Where the sequences of one packed row start and end (this rank's tokens).

    cu_seqlens: int32 (n_seqs + 1,) local boundaries; with sp they are the zig-zag shard
    boundaries, identical on every rank of the group. max_seqlen: longest local sequence.
    sp_group: process group of the sequence-parallel ranks, or None.
    ring_host: a `host_comm.HostGroup` of sp_group when ring attention may pass K/V blocks
    through shared memory (CPU, one host), or None (P2P over the group's backend).
    prefix_lens: per sequence, how many leading tokens of its root (the last sequence before it
    with prefix 0) it also attends to (a DPO pair's rejected side sees its chosen side's
    prompt, a GRPO sample its group's: `packing.shared_tail`); None or all 0: plain causal
    attention inside each sequence. Not with sp.

    A plain class on purpose: FSDP2's input cast (`torch.distributed.utils._apply_to_tensors`)
    rebuilds every dataclass it finds in the forward kwargs at every FSDP unit, which would drop
    the cached `bounds` and cost one device-to-host sync per layer.
    """

    __slots__ = ("cu_seqlens", "max_seqlen", "sp_group", "ring_host", "prefix_lens", "_bounds",
                 "_keys", "last_rows")

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, sp_group: Any = None,
                 ring_host: Any = None, prefix_lens: list[int] | None = None):
        self.cu_seqlens, self.max_seqlen, self.sp_group = cu_seqlens, max_seqlen, sp_group
        self.ring_host = ring_host
        self.prefix_lens = list(prefix_lens) if prefix_lens and any(prefix_lens) else None
        self._bounds = self._keys = None
        self.last_rows = None  # (rows, their context) for the pruned last layer (last_layer.py)

    @property
    def bounds(self) -> list[int]:
        """cu_seqlens as Python ints (one device sync per micro-batch, not per layer)."""
        if self._bounds is None:
            self._bounds = [int(b) for b in self.cu_seqlens.tolist()]
        return self._bounds

    def keys(self, device) -> tuple[torch.Tensor, list[int], torch.Tensor, int]:
        """With `prefix_lens`: (index, key bounds, key cu_seqlens, longest key run). The index
        lists the row positions each sequence attends to, sequence after sequence (its root's
        first p tokens, then its own); key bounds say where each sequence's keys start and end
        in it (also as an int32 tensor for flash-attn, with the most keys of a sequence). Built
        once per micro-batch, not per layer."""
        if self._keys is None:
            b, idx, cu_k, root = self.bounds, [], [0], None
            if len(self.prefix_lens) != len(b) - 1:
                raise ValueError(f"{len(self.prefix_lens)} prefix lengths for {len(b) - 1} sequences")
            for j, p in enumerate(self.prefix_lens):
                if not p:
                    root = j
                elif root is None or p > b[root + 1] - b[root]:
                    raise ValueError(f"sequence {j} continues {p} tokens of the last sequence "
                                     "before it with prefix 0, but there is none or it has fewer")
                else:
                    idx.append(torch.arange(b[root], b[root] + p))
                idx.append(torch.arange(b[j], b[j + 1]))
                cu_k.append(cu_k[-1] + p + b[j + 1] - b[j])
            self._keys = (torch.cat(idx).to(device), cu_k,
                          torch.tensor(cu_k, dtype=torch.int32, device=device),
                          max(e - s for s, e in zip(cu_k[:-1], cu_k[1:])))
        return self._keys

    @property
    def gathered(self) -> bool:
        """Whether a sequence's keys are other rows than its queries (`keys`)."""
        return self.prefix_lens is not None or self._keys is not None

    def suffixes(self, first: list[int], device) -> tuple[torch.Tensor, "PackedContext"]:
        """Queries from row first[i] to the end of each sequence i (first[i] = its end: none),
        keys as before: (the query rows, a context for them whose `keys` index this one's rows).
        A sequence without queries is left out (the kernel takes no keys without queries, and
        flash-attn's one-query-per-sequence path no empty sequence)."""
        b = self.bounds
        # each sequence's keys as they are now: its slice of `keys`, or its own rows
        index, kb = self.keys(device)[:2] if self.prefix_lens else (None, b)
        rows, keys, cu_q, cu_k = [], [], [0], [0]
        for j, (s, e, f) in enumerate(zip(b[:-1], b[1:], first)):
            if f == e:
                continue
            cu_q.append(cu_q[-1] + e - f)
            rows.append(torch.arange(f, e, device=device))
            keys.append(torch.arange(s, e, device=device) if index is None else index[kb[j]:kb[j + 1]])
            cu_k.append(cu_k[-1] + kb[j + 1] - kb[j])
        sub = PackedContext(torch.tensor(cu_q, dtype=torch.int32, device=device),
                            max(e - s for s, e in zip(cu_q[:-1], cu_q[1:])))
        sub._bounds = cu_q
        sub._keys = (torch.cat(keys), cu_k,
                     torch.tensor(cu_k, dtype=torch.int32, device=device),
                     max(e - s for s, e in zip(cu_k[:-1], cu_k[1:])))
        return torch.cat(rows), sub


def packed_kwargs(ctx: PackedContext) -> dict:
    """Extra kwargs for `model(...)` that route `ctx` to every attention layer."""
    return {CTX_KWARG: ctx}


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, packed_mask)
    return NAME


def packed_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function for `create_causal_mask`: None (no mask) when attention is plain causal.

    "Plain" = no padding mask, no cache offset, q and kv of equal length, no sliding window in
    reach and no extra mask pattern (use_vmap marks or/and mask functions). HF switches its own
    "is causal" shortcut off when it detects packed position_ids, so this ignores
    `allow_is_causal_skip`: the attention function handles packing itself. Anything else
    (generation with a cache, padded batches) gets HF's ordinary SDPA mask.
    """
    from transformers.masking_utils import sdpa_mask

    no_padding = attention_mask is None or (attention_mask.ndim == 2 and bool(attention_mask.all()))
    if (
        no_padding
        and not use_vmap
        and isinstance(q_offset, int) and q_offset == 0
        and isinstance(kv_offset, int) and kv_offset == 0
        and q_length == kv_length
        and (local_size is None or kv_length < local_size)
    ):
        return None
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, attention_mask=attention_mask, local_size=local_size,
        use_vmap=use_vmap, **kwargs,
    )


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function. query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D)."""
    ctx: PackedContext | None = kwargs.get(CTX_KWARG)
    # features transformers passes that no path here implements: refuse, never drop them
    if kwargs.get("softcap"):
        raise NotImplementedError("attention logit softcapping (e.g. Gemma-2's "
                                  "attn_logit_softcapping) is not supported by RL2's attention")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (e.g. gpt-oss) are not supported by RL2's attention")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if ctx is None:
        return _unpacked_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row (batch size 1), got {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("pass no attention_mask with a PackedContext: cu_seqlens define the sequences")
    sp = 1 if ctx.sp_group is None else torch.distributed.get_world_size(ctx.sp_group)
    if ctx.prefix_lens and sp > 1:
        raise NotImplementedError("sequences that continue another's prefix (shared prompts) "
                                  "cannot be split by ring attention: use sp_size=1")
    window = kwargs.get("sliding_window")
    longest = ctx.max_seqlen * sp + max(ctx.prefix_lens or [0])
    if ctx.gathered:
        longest = max(longest, ctx.keys(query.device)[3])
    if window is not None and longest > window:
        raise NotImplementedError(
            f"sliding window {window} is shorter than a packed sequence ({longest} tokens)")
    if ctx.bounds[0] != 0 or ctx.bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seqlens span [{ctx.bounds[0]}, {ctx.bounds[-1]}) but the row has "
                         f"{query.shape[2]} tokens from 0")

    if ctx.sp_group is not None:
        if dropout > 0:
            raise NotImplementedError("attention dropout is not supported with ring attention")
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
        out = ring_attention(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, ctx.sp_group, scale=scaling,
                             host=ctx.ring_host, fused=getattr(module, "rl2_fused_attention", False))
        return out[None], None
    flash = _flash_varlen() if flash_supported(query) else None
    if flash is not None:
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        cu = cu_k = ctx.cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_k = ctx.max_seqlen
        if ctx.gathered:  # gathered keys; flash-attn aligns a causal mask with fewer queries
            # than keys to the bottom right (flash_attn_varlen_func's docstring, 2.8.3)
            index, _, cu_k, max_k = ctx.keys(q.device)
            k, v = k.index_select(0, index), v.index_select(0, index)
        out = flash(q, k, v, cu, cu_k, ctx.max_seqlen, max_k, dropout_p=dropout,
                    softmax_scale=scaling, causal=True)
        return out[None], None
    bounds_k = None
    if ctx.gathered:
        index, bounds_k, _, _ = ctx.keys(query.device)
        key, value = key.index_select(2, index), value.index_select(2, index)
    if getattr(module, "rl2_fused_attention", False) and not dropout:
        from RL2.utils import cpu_ops  # actor.cpu_fused_ops marked the module (fp32 CPU, C kernel)

        if cpu_ops.attention_takes(query, key, value, gathered=bounds_k is not None):
            return cpu_ops.causal_attention(query, key, value, ctx.bounds, scaling, bounds_k), None
    return _causal_per_sequence(query, key, value, ctx.bounds, scaling, dropout, bounds_k), None


def flash_supported(q) -> bool:
    """Whether flash-attn's kernels take `q`: fp16/bf16 on an Ampere or newer GPU (flash_api.cpp
    refuses older ones), head dim a multiple of 8 up to 256 (its kernel checks; only
    flash_attn_varlen_func pads other sizes, ring-flash-attn calls the kernel directly).
    Otherwise the pure-torch paths run."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and _sm_major(q.device) >= 8)


@lru_cache(maxsize=None)
def _sm_major(device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def rope_types(model) -> list[str]:
    """The RoPE types of `model`'s rotary modules (transformers sets `rope_type`, a str or a
    dict per layer type)."""
    types = []
    for m in model.modules():
        rope = getattr(m, "rope_type", None)
        if isinstance(rope, str):
            types.append(rope)
        elif isinstance(rope, dict):
            types += [t for t in rope.values() if isinstance(t, str)]
    return types


def config_rope_types(config) -> list[str]:
    """The RoPE types a HF config asks for, before any model is built: `rope_parameters`
    (transformers 5: one dict, or one per layer type) or the older `rope_scaling` ("type" or
    "rope_type"), also in a multimodal config's text part."""
    types = []
    for c in {id(x): x for x in (config, config.get_text_config())}.values():
        for key in ("rope_parameters", "rope_scaling"):
            value = getattr(c, key, None)
            if not isinstance(value, dict):
                continue
            for params in (value.values() if all(isinstance(v, dict) for v in value.values()) else [value]):
                kind = params.get("rope_type") or params.get("type")
                if isinstance(kind, str):
                    types.append(kind)
    return list(dict.fromkeys(types))  # transformers 5 aliases rope_scaling to rope_parameters


def check_sp_rope(types: list[str], sp: int) -> None:
    """Ring attention splits each sequence over the sp ranks; RoPE types that pick their
    frequencies from the largest position id in the batch ("dynamic", "longrope":
    transformers/modeling_rope_utils.py) would pick them per rank, so ranks would rotate one
    sequence's q/k differently. `types`: `config_rope_types` before the load, `rope_types`
    after it (remote code may choose its own)."""
    bad = sorted({t for t in types if "dynamic" in t or t == "longrope"})
    if sp > 1 and bad:
        raise NotImplementedError(f"sp_size={sp} with rope_type {bad}: these choose RoPE "
                                  "frequencies from each rank's own positions; use sp_size=1")


@lru_cache(maxsize=None)
def _flash_varlen():
    """flash_attn.flash_attn_varlen_func, or None. Its signature, (total, heads, dim) layout and
    GQA (fewer K/V heads) were read in flash-attn 2.8.3's source, which tests/test_flash_source.py
    checks against this call; the call itself has never run (no GPU here)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        logger.warning("flash_attn is not installed: packed attention on GPU runs SDPA per sequence")
        return None
    return flash_attn_varlen_func


def _causal_per_sequence(query, key, value, bounds, scaling, dropout, bounds_k=None) -> torch.Tensor:
    """Causal SDPA over each [start, end) slice of the row (bounds from 0 to T); exact, and no
    T x T mask. The row is cut with one `split` per tensor, not a slice per sequence: backward
    then joins the pieces' gradients once, where per-sequence slices each allocated and summed
    a gradient of the whole row (n sequences: n x the row's size per layer; benchmarks/README.md,
    fix 20). `bounds_k`: the keys are gathered (`PackedContext.keys`) and a sequence with more
    keys than queries sees all of its prefix and its own tokens causally (a bottom-right mask)."""
    gqa = query.shape[1] != key.shape[1]
    sizes = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    sizes_k = sizes if bounds_k is None else [e - s for s, e in zip(bounds_k[:-1], bounds_k[1:])]
    outs = []
    for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes_k, dim=2), value.split(sizes_k, dim=2)):
        n, m = q.shape[2], k.shape[2]
        if not n:
            continue
        mask = None if n == m else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                   scale=scaling, dropout_p=dropout, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2)


def _unpacked_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """No context: HF "sdpa" semantics, but packed position_ids (restarts) stay correct too."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import find_packed_sequence_indices

    position_ids = kwargs.get("position_ids")
    batch, _, q_len, _ = query.shape
    if attention_mask is None and position_ids is not None and q_len == key.shape[2] > 1:
        seq_idx = find_packed_sequence_indices(position_ids.expand(batch, -1))
        if seq_idx is not None and batch == 1:
            counts = torch.bincount(seq_idx[0]).tolist()
            bounds = [0]
            for n in counts:
                bounds.append(bounds[-1] + n)
            return _causal_per_sequence(query, key, value, bounds, scaling, dropout), None
        if seq_idx is not None:  # several packed rows: a block-causal mask (rare fallback)
            same = seq_idx[:, None, :, None] == seq_idx[:, None, None, :]
            attention_mask = same & torch.ones(q_len, q_len, dtype=torch.bool,
                                               device=query.device).tril()
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)
