"""The last decoder layer computed only where logits are read.

A causal LM's log-probs are read at action positions only (`Worker._action_positions`), and the
last layer's output feeds nothing but the final norm and the lm_head. Its keys and values are
needed at every position (the queries attend to them), but its queries, attention, o_proj,
residual and MLP only at the rows whose logits are kept: a DPO pair's prompt, a GRPO group's
shared prompt, an SFT prompt skip them (TRL and verl compute the whole layer). Each sequence
keeps a suffix (from its first kept position on), so its queries see all of its keys under the
bottom-right causal mask that shared prompts already use (`PackedContext.keys`).

Only for transformers' own Llama-shaped decoder layers (`FAMILIES`): the pruned forward below
restates theirs (pre-norm attention with q/k/v/o projections, optional per-head q/k norms,
rotary embeddings, pre-norm MLP), so a family is listed once a test has compared it with HF's
forward (tests/test_last_layer.py). Not with ring attention (sp_size > 1): its zig-zag shards
would need the pruned rows split again.
"""
from __future__ import annotations

import sys
import types
from functools import partial

import torch

from RL2.parallel.attention import CTX_KWARG, NAME, PackedContext
from RL2.parallel.fsdp import decoder_layers
from RL2.utils.config import resolve_cpu_auto

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def resolve(worker_cfg, device: str) -> bool:
    """`prune_last_layer`: true, false or auto (on where it has run, the CPU; CUDA's attention
    over fewer queries than keys, flash-attn's bottom-right mask, has not run here)."""
    return resolve_cpu_auto(worker_cfg, "prune_last_layer", device,
                            "ring attention's shards would need the pruned rows split again")


def install(model: torch.nn.Module) -> bool:
    """Give the last decoder layer the pruned forward (used when a call's PackedContext carries
    `last_rows`); False, and nothing changed, for a model this module does not know."""
    family = getattr(model.config, "model_type", None)
    if family not in FAMILIES or model.config._attn_implementation != NAME:
        return False  # other attention functions would not read the pruned context
    layer = decoder_layers(model)[-1]
    attn = getattr(layer, "self_attn", None)
    own = f"transformers.models.{family}.modeling_{family}"
    # the forward it runs: the family's own (FSDP's subclass of the layer holds that same one)
    if getattr(type(layer).forward, "__module__", None) != own or attn is None or not all(
            hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return False  # remote code, or a layer shaped otherwise
    layer.forward = types.MethodType(_forward(layer.forward, sys.modules[own]), layer)
    return True


def plan(ctx: PackedContext, keep: torch.Tensor) -> torch.Tensor | None:
    """Set `ctx.last_rows` for the kept positions `keep` (sorted row indices) and return them as
    indices into the pruned rows (for `logits_to_keep`); None when nothing would be skipped."""
    if ctx.sp_group is not None:  # `resolve` refuses it; the sub-context would lose the ring
        raise NotImplementedError("prune_last_layer with sequence parallelism (sp_size > 1)")
    b = ctx.bounds
    starts = torch.tensor(b[:-1], device=keep.device)
    at = torch.searchsorted(keep, starts)  # each sequence's first kept index, if inside it
    first = keep[at.clamp(max=len(keep) - 1)].tolist()
    first = [f if a < len(keep) and s <= f < e else e
             for a, f, s, e in zip(at.tolist(), first, b[:-1], b[1:])]
    if sum(e - f for f, e in zip(first, b[1:])) == b[-1]:
        return None
    rows, sub = ctx.suffixes(first, keep.device)
    ctx.last_rows = (rows, sub)
    return torch.searchsorted(rows, keep)


def _forward(original, hf):
    """The last layer's forward: HF's own without `last_rows`, else the pruned one. `hf`: the
    family's modeling module (its apply_rotary_pos_emb and attention registry)."""

    def forward(self, hidden_states, *args, **kwargs):
        ctx = kwargs.get(CTX_KWARG)
        if ctx is None or ctx.last_rows is None:
            return original(hidden_states, *args, **kwargs)
        if args or kwargs.get("attention_mask") is not None:
            raise ValueError("the pruned last layer takes a packed row: no attention mask")
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # as transformers' GradientCheckpointingLayer does for the whole forward
            return self._gradient_checkpointing_func(partial(pruned, self, **kwargs), hidden_states)
        return pruned(self, hidden_states, **kwargs)

    def pruned(self, hidden_states, **kwargs):
        rows, sub = kwargs[CTX_KWARG].last_rows
        attn = self.self_attn
        x = self.input_layernorm(hidden_states)
        q = attn.q_proj(x[:, rows]).view(1, len(rows), -1, attn.head_dim)
        k = attn.k_proj(x).view(1, x.shape[1], -1, attn.head_dim)
        v = attn.v_proj(x).view(1, x.shape[1], -1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = kwargs["position_embeddings"]
        # the family's rotation takes a q and a k of one length: each rides with one head of itself
        q = hf.apply_rotary_pos_emb(q, q[:, :1], cos[:, rows], sin[:, rows])[0]
        k = hf.apply_rotary_pos_emb(k[:, :1], k, cos, sin)[1]
        attend = hf.ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
        # Qwen2 sets a window per layer; Mistral's attention passes its config's
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        out, _ = attend(attn, q, k, v, None, dropout=attn.attention_dropout if attn.training else 0.0,
                        scaling=attn.scaling, sliding_window=window, **{CTX_KWARG: sub})
        h = hidden_states[:, rows] + attn.o_proj(out.reshape(1, len(rows), -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    return forward
