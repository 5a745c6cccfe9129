"""Prefill and decode of a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral without sliding
window) written with plain tensor ops over the engine's own KV buffers (`kv_cache.BatchKV`).

Why our own forward instead of the HF one: (1) no dependence on transformers' cache classes
(their layout and update hooks changed across 4.x/5.x; the vLLM extra pins an older transformers
than the trainer's), so the engine only relies on the model's parameters and on a few stable
module attributes (`embed_tokens`, `layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`, `rotary_emb`, `lm_head`), which
`supports` checks; (2) speed: prefill runs unpadded (all prompts packed into one sequence for the
matmuls, attention per prompt), and a decode step adds a per-row padding bias to grouped-query
attention without expanding K/V and without HF's mask construction. The model's own rotary
module gives cos / sin and its norms' weights and epsilon are used as HF uses them, so numerics
and RoPE variants stay HF's; on the CPU in fp32 RL2's kernel (`linear.fused`, `linear.attention`,
RL2/utils/small_gemm.c) does the norm, rotation, residual add, SiLU(gate) * up and decode-step
attention around its products with HF's arithmetic (sums in another order), and a decode
step's layers in one call (`linear.decode_layers`, the same bits). Tests compare both paths
to HF `generate` and to an HF forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ARCHS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def supports(model) -> bool:
    """True when this module computes exactly what the HF forward does for this model."""
    cfg = model.config
    if type(model).__name__ not in _ARCHS or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "pretraining_tp", 1) != 1 or getattr(cfg, "sliding_window", None) and (
            getattr(cfg, "use_sliding_window", True)):
        return False
    body = getattr(model, "model", None)
    if not all(hasattr(body, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    layer = body.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, body.norm]
    norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    return (all(isinstance(m, torch.nn.Linear) for m in linears)
            and all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon")
                    and tuple(n.weight.shape) == (n.weight.shape[-1],) for n in norms)
            and hasattr(attn, "scaling") and hasattr(attn, "head_dim"))


def _linear(x: torch.Tensor, proj) -> torch.Tensor:
    # the functional call skips nn.Module dispatch (~7 per layer per step); callers may pass
    # another `linear(x, proj)` (the runner's oneDNN-packed weights, RL2/utils/onednn.py)
    return F.linear(x, proj.weight, proj.bias)


def _project(linear, x: torch.Tensor, projs: tuple, norm=None) -> list[torch.Tensor]:
    """Several projections of one input (RMS-normalised first by the module `norm`, if given);
    one stacked product when `linear` offers it, with the norm inside it when `linear.fused`
    takes it (RL2's CPU kernel, fp32: the norm's eager ops cost more than its arithmetic)."""
    fused = getattr(linear, "fused", None)
    if norm is not None and fused is not None and x.dtype == torch.float32:
        y = fused(x, projs, norm=(norm.weight, norm.variance_epsilon))
        if y is not None:
            return list(y.split([p.weight.shape[0] for p in projs], dim=-1))
    if norm is not None:
        x = _norm(norm, x)
    many = getattr(linear, "many", None)
    return many(x, projs) if many else [linear(x, p) for p in projs]


def _add_linear(linear, res: torch.Tensor, x: torch.Tensor, proj) -> torch.Tensor:
    """res + linear(x, proj), the add inside the product when `linear.fused` takes it."""
    fused = getattr(linear, "fused", None)
    y = fused(x, (proj,), res=res) if fused is not None else None
    return res + linear(x, proj) if y is None else y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    # F.rms_norm is one call and bitwise equal to HF's fp32 RMSNorm (checked in the tests); in
    # other dtypes HF upcasts to fp32 first, so its own module runs
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _qkv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linear=_linear):
    """Rotated queries and keys, and values, as [tokens, heads, head_dim] (x: [tokens, hidden])."""
    attn = layer.self_attn
    d, n = attn.head_dim, x.shape[0]
    projs, norm = (attn.q_proj, attn.k_proj, attn.v_proj), layer.input_layernorm
    fused = getattr(linear, "fused", None)
    if fused is not None and x.dtype == torch.float32 and not hasattr(attn, "q_norm"):
        # the norm, the product and the rotation of the queries' and keys' heads in one call
        sizes = [p.weight.shape[0] for p in projs]
        y = fused(x, projs, norm=(norm.weight, norm.variance_epsilon),
                  rope=(cos[:, 0], sin[:, 0], (sizes[0] + sizes[1]) // d))
        if y is not None:
            return tuple(t.view(n, -1, d) for t in y.split(sizes, dim=-1))
    q, k, v = (t.reshape(n, -1, d) for t in _project(linear, x, projs, norm=norm))
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
        q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
    qk = _rotate(torch.cat([q, k], dim=1), cos, sin)  # one elementwise pass for both
    return qk[:, :q.shape[1]], qk[:, q.shape[1]:], v


def _finish_layer(layer, x: torch.Tensor, attn_out: torch.Tensor, linear=_linear) -> torch.Tensor:
    """Output projection, residuals and MLP of one decoder layer (x: the layer's input)."""
    x = _add_linear(linear, x, attn_out, layer.self_attn.o_proj)
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    fused = getattr(linear, "fused", None)
    act = None
    if fused is not None and x.dtype == torch.float32:  # the norm and SiLU(gate) * up inside
        act = fused(x, (mlp.gate_proj, mlp.up_proj), norm=(norm.weight, norm.variance_epsilon),
                    glu=True)
    if act is None:
        gate, up = _project(linear, x, (mlp.gate_proj, mlp.up_proj), norm=norm)
        act = F.silu(gate) * up
    return _add_linear(linear, x, act, mlp.down_proj)


def linear_groups(model) -> list[tuple]:
    """Every module group this file passes to `linear` (one module) or `linear.many` (q/k/v,
    gate/up): `_qkv`, `_finish_layer` and `_logits` below; compiled_decode.py names each one."""
    groups = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
                   (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
    if isinstance(model.lm_head, torch.nn.Linear):
        groups.append((model.lm_head,))
    return groups


def _logits(model, x: torch.Tensor, linear=_linear) -> torch.Tensor:
    head = model.lm_head
    if isinstance(head, torch.nn.Linear):
        return _project(linear, x, (head,), norm=model.model.norm)[0]
    return head(_norm(model.model.norm, x))


@torch.inference_mode()
def prefill(model, suffixes: list[list[int]], prefixes: list, device, linear=_linear):
    """Run the new tokens of P prompts. suffixes[i]: token ids not cached yet; prefixes[i]: None
    or per-layer (keys, values) [kv_heads, n_i, head_dim] of the prompt's first n_i tokens.

    Returns (logits [P, vocab] of each prompt's last token, keys, values, lens): keys/values per
    layer [P, kv_heads, W, head_dim] holding each prompt's whole KV (prefix + suffix, lens[i]
    tokens) right-aligned, ready for `BatchKV.add`.
    """
    return mixed(model, None, None, suffixes, prefixes, device, linear)[1:]


@torch.inference_mode()
def mixed(model, tokens: torch.Tensor | None, kv, suffixes: list[list[int]], prefixes: list, device,
          linear=_linear):
    """A decode step of the rows of `kv` (as `decode`: tokens [B], a free column at `kv.end`, the
    caller advances) and the prefill of P prompts (as `prefill`) in ONE forward pass: the
    linear layers read their weights once for both. On the CPU a decode step's few rows are
    bound by that read, so a prompt's tokens ride along almost free instead of costing a pass
    of their own (multi-turn rollouts admit a turn or two at a time while others decode).
    Returns (decode logits [B, vocab], then `prefill`'s four results)."""
    body = model.model
    b = 0 if tokens is None else tokens.shape[0]
    n_prefix = [p[0][0].shape[1] if p else 0 for p in prefixes]
    lens = [h + len(s) for h, s in zip(n_prefix, suffixes)]
    ids = torch.tensor([t for s in suffixes for t in s], device=device)
    positions = torch.cat([torch.arange(h, n, device=device) for h, n in zip(n_prefix, lens)])
    if b:
        ids, positions = torch.cat([tokens, ids]), torch.cat([kv.lens, positions])
        bias = kv.bias(dtype=body.embed_tokens.weight.dtype)
    x = body.embed_tokens(ids)                                   # [B + N, hidden], no padding
    cos, sin = body.rotary_emb(x[None], positions[None])         # [1, B + N, D]
    cos, sin = cos[0, :, None], sin[0, :, None]                  # [B + N, 1, D]
    keys, values = [], []
    for li, layer in enumerate(body.layers):
        q, k, v = _qkv(layer, x, cos, sin, linear)
        out, kbuf, vbuf = _attend_prompts(layer.self_attn, q[b:], k[b:], v[b:], n_prefix, lens,
                                          [p[li] if p else None for p in prefixes])
        if b:
            step_k, step_v = kv.write(li, k[:b], v[:b])
            qg = q[:b].view(b, step_k.shape[1], -1, q.shape[-1])
            out = torch.cat([_attend_step(qg, step_k, step_v, bias, layer.self_attn.scaling, linear)
                             .reshape(b, -1), out])
        keys.append(kbuf)
        values.append(vbuf)
        x = _finish_layer(layer, x, out, linear)
    new = torch.tensor([len(s) for s in suffixes], device=device)
    rows = torch.cat([torch.arange(b, device=device), b + new.cumsum(0) - 1])
    logits = _logits(model, x.index_select(0, rows), linear)
    return logits[:b], logits[b:], keys, values, torch.tensor(lens, device=device)


def _attend_prompts(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: list[int],
                    lens: list[int], prefixes: list):
    """One layer's attention of P prompts' new tokens (q/k/v [N, heads, D], packed) over their
    cached prefix (prefixes[i]: (keys, values) [kv_heads, n_prefix[i], D] or None) and
    themselves. Returns (out [N, heads * D], keys, values [P, kv_heads, max(lens), D] with each
    prompt's lens[i] tokens right-aligned)."""
    width = max(lens)
    kbuf = k.new_zeros(len(lens), k.shape[1], width, k.shape[2])
    vbuf = torch.zeros_like(kbuf)
    outs, offset = [], 0
    for i, (h, n) in enumerate(zip(n_prefix, lens)):
        s = n - h
        if h:
            kbuf[i, :, width - n:width - s], vbuf[i, :, width - n:width - s] = prefixes[i]
        kbuf[i, :, width - s:] = k[offset:offset + s].transpose(0, 1)
        vbuf[i, :, width - s:] = v[offset:offset + s].transpose(0, 1)
        outs.append(_attend_prompt(attn, q[offset:offset + s], kbuf[i, :, width - n:],
                                   vbuf[i, :, width - n:], h))
        offset += s
    return torch.cat(outs), kbuf, vbuf


def _attend_prompt(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int):
    """Causal attention of one prompt's s new queries [s, heads, D] over its n keys [kv_heads, n,
    D] (the first n - s cached). Returns [s, heads * D]."""
    s = q.shape[0]
    mask = None
    if n_prefix:  # causal, aligned to the bottom right: query j sees keys <= n_prefix + j
        cols = torch.arange(k.shape[1], device=q.device)
        mask = cols[None, :] <= n_prefix + torch.arange(s, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=not n_prefix, scale=attn.scaling, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(s, -1)


@torch.inference_mode()
def decode(model, tokens: torch.Tensor, kv, linear=_linear) -> torch.Tensor:
    """Logits [B, vocab] of the next token of each row of `kv` (a `BatchKV` with a free column at
    `kv.end`, where this step's keys and values are written; the caller advances it).
    tokens: [B] the last sampled token of each row, at position `kv.lens`."""
    return _decode(model, tokens, kv.lens, kv.bias(dtype=model.model.embed_tokens.weight.dtype),
                   kv.write, linear, kv)


@torch.inference_mode()
def decode_static(model, tokens: torch.Tensor, positions: torch.Tensor, column: torch.Tensor,
                  bias: torch.Tensor, keys: list, values: list, linear=_linear) -> torch.Tensor:
    """`decode` with shapes that do not change from step to step, as a CUDA graph needs: the
    step attends over the whole buffers (keys/values per layer [B, kv_heads, L, D], the first B
    rows of the cache), `bias` [B, 1, 1, L] masks every column but a row's own tokens and the
    one being written, and this step's keys and values are written at `column` ([1] long, a
    tensor so that a replayed graph reads its new value)."""
    return static_step(model, tokens, positions, column, bias, keys, values, linear)


def static_step(model, tokens, positions, column, bias, keys, values, linear=_linear):
    """`decode_static` without its inference-mode decorator, for torch.compile to trace (it
    fails on a decorated function's inference tensors; compiled_decode.py enters the mode)."""

    def write(li, k, v):
        keys[li].index_copy_(2, column, k[:, :, None])
        values[li].index_copy_(2, column, v[:, :, None])
        return keys[li], values[li]

    return _decode(model, tokens, positions, bias, write, linear)


def _attend_step(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                 scale: float, linear=None) -> torch.Tensor:
    """Attention of a decode step, q [B, kv_heads, G, D] over keys/values [B, kv_heads, W, D]:
    through `linear.attention` when it takes these tensors (RL2's CPU kernel, fp32: it reads
    each key and value row once for the whole query group), else two batched matmuls and a
    softmax (in fp32, as HF's eager attention). For these shapes (a few queries per row)
    PyTorch's CPU flash-attention kernel took 2x as long as the matmuls (192 vs 94 us per layer
    at 16 rows x 86 columns; benchmarks/README.md, fix 13)."""
    attention = getattr(linear, "attention", None)
    out = attention(q, keys, values, bias, scale) if attention is not None else None
    if out is not None:
        return out
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).add_(bias)
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), values)


def _decode(model, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, write,
            linear, kv=None) -> torch.Tensor:
    """One decode step; write(layer, k, v) stores the step's keys and values [B, kv_heads, D]
    and returns the keys and values to attend over, [B, kv_heads, W, D] (W: bias's last dim).
    With kv (the `BatchKV` that `write` writes to), the layers may run as one call of
    `linear.decode_layers` (RL2's CPU kernel: the same ops, bit for bit, without the Python
    between them), which writes the cache itself."""
    body = model.model
    rows = tokens.shape[0]
    x = body.embed_tokens(tokens)                                # [B, hidden]
    cos, sin = body.rotary_emb(x[None], positions[None])         # [1, B, D]
    cos, sin = cos[0, :, None], sin[0, :, None]                  # [B, 1, D]
    whole = getattr(linear, "decode_layers", None) if kv is not None else None
    if whole is not None:
        live = kv.live()[2]
        y = whole(body.layers, x, (cos[:, 0], sin[:, 0]), (kv.k, kv.v, live.start, live.stop - 1),
                  bias)
        if y is not None:
            return _logits(model, y, linear)
    for li, layer in enumerate(body.layers):
        q, k, v = _qkv(layer, x, cos, sin, linear)               # [B, heads, D]
        keys, values = write(li, k, v)
        # one row's query heads of a group as a query block: [B, kv_heads, G, D] against the
        # unexpanded cache (no copy of K/V per group), the padding as an additive bias
        qg = q.view(rows, keys.shape[1], -1, q.shape[-1])
        x = _finish_layer(layer, x, _attend_step(qg, keys, values, bias,
                                                   layer.self_attn.scaling, linear)
                          .reshape(rows, -1), linear)
    return _logits(model, x, linear)
