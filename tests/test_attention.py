"""Packed attention ("rl2_packed") on tiny HF models == every sequence forwarded alone with HF."""
import copy

import pytest
import torch
from transformers import (
    AttentionInterface, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask

from RL2.parallel import attention
from RL2.parallel.attention import NAME, PackedContext, packed_kwargs, register

ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
VOCAB = 96
LENGTHS = [5, 9, 7]


def tiny_config(arch):
    cfg_cls, _ = ARCHS[arch]
    # 4 query heads over 2 K/V heads: exercises GQA
    return cfg_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=64, tie_word_embeddings=False)


def build(arch, attn, state=None):
    # a fresh config per model: from_config records attn_implementation on the config object
    _, model_cls = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls._from_config(copy.deepcopy(tiny_config(arch)), attn_implementation=attn,
                                   dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def packed_batch(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ctx = PackedContext(cu_seqlens=cu, max_seqlen=max(lengths))
    weights = torch.randn(sum(lengths), VOCAB, generator=g)  # a loss that touches every logit
    return seqs, pos, ctx, weights


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_register_is_idempotent():
    assert register() == register() == NAME
    assert AttentionInterface._global_mapping[NAME] is attention.packed_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is attention.packed_mask


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("ref_attn", ["sdpa", "eager"])
def test_packed_equals_separate_sequences(arch, ref_attn):
    packed = build(arch, register())
    ref = build(arch, ref_attn, packed.state_dict())
    seqs, pos, ctx, weights = packed_batch()

    logits = packed(input_ids=torch.cat(seqs)[None], position_ids=pos[None], use_cache=False,
                    **packed_kwargs(ctx)).logits[0]
    (logits * weights).sum().backward()

    ref_logits, start = [], 0
    for seq in seqs:
        out = ref(input_ids=seq[None], use_cache=False).logits[0]
        (out * weights[start:start + len(seq)]).sum().backward()
        ref_logits.append(out)
        start += len(seq)
    torch.testing.assert_close(logits, torch.cat(ref_logits), atol=1e-5, rtol=0)
    ref_grads = grads(ref)
    for name, g in grads(packed).items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_per_sequence_attention_with_empty_sequences_equals_sliced_sdpa():
    # empty sequences (repeated bounds) are skipped; gradients equal one SDPA per slice
    torch.manual_seed(0)
    bounds = [0, 5, 5, 14, 21, 21]
    q, k, v = (torch.randn(1, h, 21, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = attention._causal_per_sequence(q, k, v, bounds, 0.3, 0.0)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=0.3, enable_gqa=True)
        for s, e in zip(bounds[:-1], bounds[1:]) if e > s], dim=2).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(got, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def shared_prefix_batch(seed=2):
    """A row [a | prompt+c | r | r2 | b]: r and r2 continue the first 7 tokens (the prompt) of
    their root, the last sequence before them with prefix 0. Returns the row, its position_ids
    and bounds, prefix_lens, and each sequence as HF sees it alone with the row positions whose
    logits it owns."""
    g = torch.Generator().manual_seed(seed)
    a, prompt, c, r, r2, b = (torch.randint(0, VOCAB, (n,), generator=g) for n in (4, 7, 6, 5, 2, 3))
    row = torch.cat([a, prompt, c, r, r2, b])
    pos = torch.cat([torch.arange(4), torch.arange(13), torch.arange(7, 12), torch.arange(7, 9), torch.arange(3)])
    bounds, prefix_lens = [0, 4, 17, 22, 24, 27], [0, 0, 7, 7, 0]
    alone = [(a, list(range(0, 4))), (torch.cat([prompt, c]), list(range(4, 17))),
             (torch.cat([prompt, r]), [None] * 7 + list(range(17, 22))),
             (torch.cat([prompt, r2]), [None] * 7 + list(range(22, 24))), (b, list(range(24, 27)))]
    return row, pos, bounds, prefix_lens, alone


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_sequence_continuing_a_shared_prefix_equals_it_forwarded_whole(arch):
    """A DPO pair's rejected side packed after its chosen side without their common prompt
    (`packing.shared_tail`): its logits and every gradient equal HF's on the whole sequence."""
    packed, ref = build(arch, register()), None
    ref = build(arch, "eager", packed.state_dict())
    row, pos, bounds, prefix_lens, alone = shared_prefix_batch()
    ctx = PackedContext(torch.tensor(bounds, dtype=torch.int32), 13, prefix_lens=prefix_lens)
    logits = packed(input_ids=row[None], position_ids=pos[None], **packed_kwargs(ctx)).logits[0]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weights).sum().backward()
    for seq, where in alone:
        out = ref(input_ids=seq[None]).logits[0]
        mine = [i for i, w in enumerate(where) if w is not None]
        rows = [where[i] for i in mine]
        torch.testing.assert_close(out[mine], logits[rows].detach(), atol=1e-5, rtol=0)
        (out[mine] * weights[rows]).sum().backward()
    ref_grads = grads(ref)
    for name, g in grads(packed).items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_prefix_lengths_are_checked():
    row, pos, bounds, _, _ = shared_prefix_batch()
    model = build("qwen2", register())
    for prefix_lens, match in (([3, 0, 0, 0, 0], "sequence 0"), ([0, 5, 0, 0, 0], "sequence 1"),
                               ([0, 0, 7, 0, 9], "sequence 4"), ([0, 0, 7], "3 prefix lengths")):
        ctx = PackedContext(torch.tensor(bounds, dtype=torch.int32), 13, prefix_lens=prefix_lens)
        with pytest.raises(ValueError, match=match):
            model(input_ids=row[None], position_ids=pos[None], **packed_kwargs(ctx))
    assert PackedContext(torch.tensor(bounds), 13, prefix_lens=[0] * 5).prefix_lens is None


def test_no_token_by_token_mask_is_built():
    # the model's own mask step: HF would build a (1, 1, T, T) block mask for packed position_ids
    seqs, pos, ctx, _ = packed_batch()
    embeds = torch.zeros(1, len(pos), 32)
    for attn, expect_mask in ((register(), False), ("sdpa", True)):
        config = build("qwen2", attn).config
        mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None,
                                  past_key_values=None, position_ids=pos[None])
        assert (mask is not None) == expect_mask, attn
        if expect_mask:
            assert mask.shape[-2:] == (len(pos), len(pos))

    # and inside a real forward every layer gets attention_mask=None plus the context
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get(attention.CTX_KWARG)))
        return attention.packed_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("rl2_packed_spy", spy)
    AttentionMaskInterface.register("rl2_packed_spy", attention.packed_mask)
    model = build("qwen2", "rl2_packed_spy")
    model(input_ids=torch.cat(seqs)[None], position_ids=pos[None], use_cache=False,
          **packed_kwargs(ctx))
    assert len(seen) == 2 and all(mask is None and c is ctx for mask, c in seen)


def test_bad_context_is_rejected():
    model = build("llama", register())
    seqs, pos, _, _ = packed_batch()
    for bounds in ([0, 5, 14, 20], [1, 5, 14, 21]):  # the row has 21 tokens, from 0
        bad = PackedContext(torch.tensor(bounds, dtype=torch.int32), 9)
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(input_ids=torch.cat(seqs)[None], position_ids=pos[None], use_cache=False,
                  **packed_kwargs(bad))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_without_context_behaves_like_sdpa(arch):
    model = build(arch, register())
    ref = build(arch, "sdpa", model.state_dict())
    seqs, pos, _, _ = packed_batch()
    with torch.no_grad():
        # packed position_ids but no context: sequences found from the position restarts
        out = model(input_ids=torch.cat(seqs)[None], position_ids=pos[None], use_cache=False).logits[0]
        alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs])
        torch.testing.assert_close(out, alone, atol=1e-5, rtol=0)
        # two packed rows in one batch (block-causal mask fallback)
        seqs2, pos2, _, _ = packed_batch([7, 5, 9], seed=2)
        out = model(input_ids=torch.stack([torch.cat(seqs), torch.cat(seqs2)]),
                    position_ids=torch.stack([pos, pos2]), use_cache=False).logits
        alone2 = torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs2])
        torch.testing.assert_close(out, torch.stack([alone, alone2]), atol=1e-5, rtol=0)
        # a left-padded batch with an attention mask (the generate path)
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        kw = dict(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(model(**kw).logits * mask[..., None],
                                   ref(**kw).logits * mask[..., None], atol=1e-5, rtol=0)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
    assert torch.equal(model.generate(**gen), ref.generate(**gen))


def test_softcapping_and_attention_sinks_are_refused_not_dropped():
    """transformers passes Gemma-2's `softcap` and gpt-oss's `s_aux` (sinks) to the attention
    function (transformers' own flash integration forwards both); no RL2 path implements them,
    so they stop the forward instead of being ignored (a Gemma-2 with softcapping gave logits
    0.39 off eager's)."""
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    ctx = PackedContext(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32), max_seqlen=6)
    kw = {attention.CTX_KWARG: ctx}
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="softcapping"):
        attention.packed_attention_forward(module, q, kv, kv, None, softcap=30.0, **kw)
    with pytest.raises(NotImplementedError, match="sinks"):
        attention.packed_attention_forward(module, q, kv, kv, None, s_aux=torch.zeros(4), **kw)
    out, _ = attention.packed_attention_forward(module, q, kv, kv, None, softcap=None, **kw)
    assert out.shape == (1, 6, 4, 8)


def test_flash_kernels_only_where_they_run(monkeypatch):
    """flash-attn refuses pre-Ampere GPUs and head dims not a multiple of 8 or over 256 in its
    kernel (flash_api.cpp; ring-flash-attn calls the kernel without flash_attn_varlen_func's
    padding): those take the pure-torch paths."""
    from types import SimpleNamespace

    monkeypatch.setattr(attention, "_sm_major", lambda device: 8)
    q = lambda d, dtype=torch.bfloat16, cuda=True: SimpleNamespace(  # noqa: E731
        is_cuda=cuda, dtype=dtype, shape=(10, 4, d), device="cuda:0")
    assert attention.flash_supported(q(128)) and attention.flash_supported(q(256))
    assert not any(attention.flash_supported(x) for x in
                   (q(100), q(512), q(128, torch.float32), q(128, cuda=False)))
    monkeypatch.setattr(attention, "_sm_major", lambda device: 7)  # V100 / T4
    assert not attention.flash_supported(q(128, torch.float16))


def test_sequence_parallel_refuses_rope_that_depends_on_the_longest_position():
    model = build("qwen2", "sdpa")
    attention.check_sp_rope(attention.rope_types(model), 2)  # default RoPE: fine
    model.model.rotary_emb.rope_type = "dynamic"
    attention.check_sp_rope(attention.rope_types(model), 1)
    with pytest.raises(NotImplementedError, match=r"sp_size=2 with rope_type \['dynamic'\]"):
        attention.check_sp_rope(attention.rope_types(model), 2)
    model.model.rotary_emb.rope_type = {"full_attention": "longrope"}
    with pytest.raises(NotImplementedError, match="longrope"):
        attention.check_sp_rope(attention.rope_types(model), 4)


def test_rope_types_are_read_from_the_config_before_the_load():
    """The worker checks sp against the config before any weight is read; every config layout
    transformers 5.24 keeps gives the type its model's rotary modules get."""
    from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

    types = attention.config_rope_types
    assert types(LlamaConfig()) == ["default"]
    assert types(Qwen2Config(rope_scaling={"type": "dynamic", "factor": 2.0})) == ["dynamic"]
    layered = Gemma3TextConfig(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0,
                           "short_factor": [1.0] * 128, "long_factor": [1.0] * 128,
                           "original_max_position_embeddings": 4096}})
    assert sorted(types(layered)) == ["default", "longrope"]
    assert "longrope" in types(Gemma3Config(text_config=layered.to_dict()))  # multimodal: its text part
    with pytest.raises(NotImplementedError, match="longrope"):
        attention.check_sp_rope(types(layered), 2)
    config = Qwen2Config(**{**tiny_config("qwen2").to_dict(), "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    model = ARCHS["qwen2"][1]._from_config(config)
    assert attention.rope_types(model) == types(model.config) == ["dynamic"]


FLASH_BACKWARDS = []  # (total_q, max_seqlen_q) of every backward the fake ran


def fake_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p=0.0, softmax_scale=None, causal=False, exact=False):
    """flash_attn_varlen_func of flash-attn 2.8.3 on the CPU, forward and backward: refuses what
    mha_varlen_fwd and mha_varlen_bwd refuse (csrc/flash_attn/flash_api.cpp: fp16/bf16, one
    dtype, int32 contiguous cu_seqlens of batch+1 entries on q's device, last dims contiguous,
    (total, heads, head_dim) with head_dim a multiple of 8 up to 256, query heads a multiple of
    K/V heads, and with max_seqlen_q = 1 and more query than K/V heads exactly one query per
    sequence); its kernel's grid covers max_seqlen rows per sequence only, so a smaller one is
    refused too. With fewer queries than keys the causal mask is aligned to the bottom right
    (the function's docstring: seqlen_q = 2, seqlen_k = 5 keeps 1 1 1 1 0 / 1 1 1 1 1).
    Computes in fp32; `exact=True` also takes float64 (the kernel does not) so that tests can
    compare gradients to rounding, the dtype rule being checked by the bf16 runs."""
    return _FakeFlashVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, exact)


def _flash_checks(q, k, v, cu_q, cu_k, max_q, max_k, exact):
    """What both mha_varlen_fwd and mha_varlen_bwd check."""
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float64,) if exact else ())
    assert q.dtype in dtypes and k.dtype == v.dtype == q.dtype
    assert all(t.dim() == 3 and t.stride(-1) == 1 and t.device == q.device for t in (q, k, v))
    for cu in (cu_q, cu_k):
        assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.dim() == 1 and cu.device == q.device
    (total, heads, d), (total_k, heads_k, _) = q.shape, k.shape
    assert d % 8 == 0 and d <= 256 and heads % heads_k == 0 and k.shape == v.shape == (total_k, heads_k, d)
    assert cu_q.shape == cu_k.shape and cu_q.numel() >= 2
    assert int(cu_q[-1]) == total and int(cu_k[-1]) == total_k
    # ints: the wrapper's custom ops (torch.library) declare `max_seqlen_q: int`
    assert isinstance(max_q, int) and isinstance(max_k, int)
    assert max_q >= int(cu_q.diff().max()) and max_k >= int(cu_k.diff().max())


def _flash_blocks(q, k, v, cu_q, cu_k, scale, dtype):
    """Per sequence, in `dtype`: its rows (s, e) and keys (sk, ek), its q [heads, n, d], its K/V
    repeated for every query head [heads, m, d], and the masked scores [heads, n, m]."""
    groups = q.shape[1] // k.shape[1]
    for s, e, sk, ek in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qs = q[s:e].transpose(0, 1).to(dtype)
        ks, vs = (t[sk:ek].transpose(0, 1).to(dtype).repeat_interleave(groups, 0) for t in (k, v))
        mask = torch.ones(e - s, ek - sk, dtype=torch.bool).tril(ek - sk - (e - s))  # bottom right
        yield (s, e, sk, ek), qs, ks, vs, (qs @ ks.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))


class _FakeFlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, exact):
        _flash_checks(q, k, v, cu_q, cu_k, max_q, max_k, exact)
        assert causal and dropout_p == 0.0
        (total, heads, d), heads_k = q.shape, k.shape[1]
        if max_q == 1 and heads > heads_k:
            # mha_varlen_fwd's one-query path (no window, no dropout) reshapes q to (batch, heads_k,
            # groups, d): every sequence must have exactly one query, none may be empty (pinned
            # against flash_api.cpp by tests/test_flash_source.py). Its softmax_lse comes back
            # as (heads, batch), which is the backward's (heads, total_q) layout only then.
            assert total == cu_q.numel() - 1, "one-query path: a sequence without a query"
        scale = d ** -0.5 if scale is None else scale
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = torch.empty_like(q), torch.empty(heads, total, dtype=work)  # kernel: fp32 lse
        for (s, e, _, _), _, _, vs, scores in _flash_blocks(q, k, v, cu_q, cu_k, scale, work):
            out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
            lse[:, s:e] = scores.logsumexp(-1)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.meta = (max_q, max_k, scale, causal, exact)  # FlashAttnVarlenFunc saves ctx.causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, exact = ctx.meta
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # the wrapper's maybe_contiguous
        # mha_varlen_bwd: the shared checks, out and dout in q's dtype and shape, last dims
        # contiguous. It has no one-query path: with the saved causal=True it runs the general
        # bottom-right causal kernel (window_size_right = 0), reading softmax_lse at
        # h * total_q + cu_seqlens_q[b] + i.
        _flash_checks(q, k, v, cu_q, cu_k, max_q, max_k, exact)
        assert out.dtype == dout.dtype == q.dtype and out.shape == dout.shape == q.shape
        assert out.stride(-1) == 1 and causal
        work, groups = lse.dtype, q.shape[1] // k.shape[1]
        dq, dk, dv = (torch.zeros(t.shape, dtype=work) for t in (q, k, v))

        def per_kv(x):  # [heads, m, d] -> [m, heads_k, d]: a K/V head sums its query heads
            return x.unflatten(0, (-1, groups)).sum(1).transpose(0, 1)

        for (s, e, sk, ek), qs, ks, vs, scores in _flash_blocks(q, k, v, cu_q, cu_k, scale, work):
            p = (scores - lse[:, s:e, None]).exp()
            do, o = (t[s:e].transpose(0, 1).to(work) for t in (dout, out))
            ds = p * (do @ vs.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
            dq[s:e] = (ds @ ks * scale).transpose(0, 1)
            dk[sk:ek] += per_kv(ds.transpose(1, 2) @ qs * scale)
            dv[sk:ek] += per_kv(p.transpose(1, 2) @ do)
        FLASH_BACKWARDS.append((q.shape[0], max_q))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *[None] * 8


def test_flash_branch_hands_flash_attn_what_its_kernel_takes(monkeypatch):
    """The CUDA branch of packed attention (flash-attn's varlen kernel), run on the CPU through
    a fake that enforces the kernel's checks: a bf16 packed forward equals the per-sequence path
    (the cu_seqlens the trainer builds are int64: the branch casts them)."""
    seqs, pos, ctx, _ = packed_batch()
    ids = torch.cat(seqs)[None]
    model = build("qwen2", register()).to(torch.bfloat16)
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=pos[None], **packed_kwargs(ctx)).logits
        calls = []
        monkeypatch.setattr(attention, "flash_supported", lambda q: True)
        monkeypatch.setattr(attention, "_flash_varlen", lambda: lambda *a, **kw: calls.append(1) or fake_flash_varlen(*a, **kw))
        long_ctx = PackedContext(cu_seqlens=ctx.cu_seqlens.long(), max_seqlen=ctx.max_seqlen)
        flashed = model(input_ids=ids, position_ids=pos[None], **packed_kwargs(long_ctx)).logits
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(flashed, reference, rtol=0, atol=0.05)
    with pytest.raises(AssertionError):  # the fake refuses what the kernel refuses
        q = torch.zeros(21, 4, 8, dtype=torch.bfloat16)
        fake_flash_varlen(q, q[:, :2], q[:, :2], ctx.cu_seqlens.long(), ctx.cu_seqlens.long(), 9, 9, causal=True)


def test_flash_branch_with_a_shared_prefix(monkeypatch):
    """The CUDA branch with a sequence continuing its predecessor's prefix: flash-attn over
    gathered keys (cu_seqlens_k != cu_seqlens_q) equals the CPU path, through the fake."""
    row, pos, bounds, prefix_lens, _ = shared_prefix_batch()
    model = build("qwen2", register()).to(torch.bfloat16)

    def ctx():
        return PackedContext(torch.tensor(bounds), 13, prefix_lens=prefix_lens)

    with torch.no_grad():
        reference = model(input_ids=row[None], position_ids=pos[None], **packed_kwargs(ctx())).logits
        calls = []
        monkeypatch.setattr(attention, "flash_supported", lambda q: True)
        monkeypatch.setattr(attention, "_flash_varlen", lambda: lambda *a, **kw: calls.append(a[4]) or fake_flash_varlen(*a, **kw))
        flashed = model(input_ids=row[None], position_ids=pos[None], **packed_kwargs(ctx())).logits
    assert len(calls) == 2 and calls[0].tolist() == [0, 4, 17, 29, 38, 41]  # r: 7 + 5 keys, r2: 7 + 2
    torch.testing.assert_close(flashed, reference, rtol=0, atol=0.05)


def _logits_and_grads(model, row, pos, ctx):
    """Logits of a packed row and every parameter's gradient of a fixed function of them."""
    logits = model(input_ids=row[None], position_ids=pos[None], **packed_kwargs(ctx)).logits
    up = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=logits.dtype)
    return [logits] + list(torch.autograd.grad((logits * up).sum(), list(model.parameters())))


@pytest.mark.parametrize("batch", ["packed", "shared prefix"])
def test_flash_branch_backward(monkeypatch, batch):
    """The CUDA branch's backward through the fake, which enforces mha_varlen_bwd's checks and
    reads the forward's softmax_lse as that kernel does: in float64 (exact=True) logits and all
    gradients equal the CPU path to rounding; in bf16 both passes take RL2's call."""
    if batch == "packed":
        seqs, pos, ctx0, _ = packed_batch()
        row, bounds, prefix_lens, longest = torch.cat(seqs), ctx0.cu_seqlens.tolist(), None, ctx0.max_seqlen
    else:
        row, pos, bounds, prefix_lens, _ = shared_prefix_batch()
        longest = 13

    def ctx():  # int64 bounds, as the trainer builds them: the branch casts them
        return PackedContext(torch.tensor(bounds), longest, prefix_lens=prefix_lens)

    model = build("qwen2", register()).to(torch.float64)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA
    reference = _logits_and_grads(model, row, pos, ctx())
    monkeypatch.setattr(attention, "flash_supported", lambda q: True)
    monkeypatch.setattr(attention, "_flash_varlen", lambda: lambda *a, **kw: fake_flash_varlen(*a, **kw, exact=True))
    FLASH_BACKWARDS.clear()
    flashed = _logits_and_grads(model, row, pos, ctx())
    assert len(FLASH_BACKWARDS) == 2  # one per layer
    for got, want in zip(flashed, reference):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    monkeypatch.setattr(attention, "_flash_varlen", lambda: fake_flash_varlen)  # bf16: the kernel's dtypes
    FLASH_BACKWARDS.clear()
    _logits_and_grads(model.to(torch.bfloat16), row, pos, ctx())
    assert [n for n, _ in FLASH_BACKWARDS] == [len(row)] * 2
