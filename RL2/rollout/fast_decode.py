"""One decode step of a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral without sliding
window) written with plain tensor ops over the engine's KV buffers.

Why: at decode time (one token per row) a small model spends more time in HF's module and mask
plumbing than in its matmuls, and HF's SDPA path copies the whole KV cache per layer per step to
expand grouped-query heads whenever a padding mask is present. This step calls the HF model's own
weights, norms and rotary module (so numerics and RoPE variants stay HF's), attends with grouped
heads without expanding them, and adds the padding mask as a precomputed bias. Anything it does not
recognise runs through the HF forward instead (`supports` says which).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ARCHS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def supports(model) -> bool:
    """True when `decode_step` computes exactly what the HF forward does for this model."""
    cfg = model.config
    if type(model).__name__ not in _ARCHS or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "pretraining_tp", 1) != 1 or getattr(cfg, "sliding_window", None) and (
            getattr(cfg, "use_sliding_window", True)):
        return False
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(m, torch.nn.Linear) for m in linears)
            and hasattr(attn, "scaling") and hasattr(attn, "head_dim"))


def _linear(x: torch.Tensor, proj) -> torch.Tensor:
    # the functional call skips nn.Module dispatch (~7 per layer per step)
    return F.linear(x, proj.weight, proj.bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def decode_step(model, tokens: torch.Tensor, positions: torch.Tensor, kv, mask: torch.Tensor) -> torch.Tensor:
    """Logits [B, vocab] of the next token for each row.

    tokens, positions: [B] (the last sampled token and its position id). kv: the engine's
    `BatchKV` (this step's keys and values are written at column `kv.end`; the caller advances
    it). mask: [B, W] padding mask of the live columns including this step's (W = end+1-start).
    """
    body = model.model
    rows = tokens.shape[0]
    x = body.embed_tokens(tokens[:, None])                       # [B, 1, H]
    cos, sin = body.rotary_emb(x, positions[:, None])             # [B, 1, D]
    cos, sin = cos[:, :, None], sin[:, :, None]                    # [B, 1, 1, D]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    bias = bias.masked_fill_(mask == 0, float("-inf"))[:, None, None, :]  # [B, 1, 1, W]
    live = slice(kv.start, kv.end + 1)
    for li, layer in enumerate(body.layers):
        attn = layer.self_attn
        d = attn.head_dim
        residual = x
        h = layer.input_layernorm(x)
        q = _linear(h, attn.q_proj).view(rows, 1, -1, d)
        k = _linear(h, attn.k_proj).view(rows, 1, -1, d)
        v = _linear(h, attn.v_proj).view(rows, 1, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)          # [B, 1, heads, D]
        kv.k[li][:rows, :, kv.end] = k[:, 0]
        kv.v[li][:rows, :, kv.end] = v[:, 0]
        keys, values = kv.k[li][:rows, :, live], kv.v[li][:rows, :, live]  # [B, Hkv, W, D]
        kv_heads = keys.shape[1]
        # grouped query heads: [B, Hkv, G, D] against the unexpanded [B, Hkv, W, D] cache
        qg = q.view(rows, kv_heads, -1, d)
        scores = torch.matmul(qg, keys.transpose(2, 3)).float() * attn.scaling + bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).reshape(rows, 1, -1)     # [B, 1, Hq * D]
        x = residual + _linear(out, attn.o_proj)
        residual = x
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = residual + _linear(F.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)
    x = body.norm(x)
    return model.lm_head(x)[:, 0]
