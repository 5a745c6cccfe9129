"""Zig-zag ring attention on real gloo groups == full causal attention per sequence."""
import copy

import torch
import torch.distributed as dist

from tests.dist_utils import run_dist
from RL2.parallel.attention import PackedContext, packed_kwargs, register
from RL2.parallel import ring_attention as ring_module
from RL2.parallel.ring_attention import ring_attention

LENGTHS = [5, 13, 8, 1]  # padded per sequence to a multiple of 2 * sp
HQ, HKV, DIM = 4, 2, 8  # GQA


def padded(lengths, sp):
    return [-(-n // (2 * sp)) * 2 * sp for n in lengths]


def zigzag(x, lengths_padded, sp, rank):
    """This rank's share of a padded packed row: chunks r and 2sp-1-r of every sequence."""
    parts, start = [], 0
    for n in lengths_padded:
        chunks = x[start:start + n].chunk(2 * sp)
        parts += [chunks[rank], chunks[2 * sp - 1 - rank]]
        start += n
    return torch.cat(parts)


def unzigzag(shards, lengths_padded, sp):
    """Inverse of zigzag given every rank's share (list indexed by rank)."""
    seqs, start = [], 0
    for n in lengths_padded:
        local = [s[start // sp:(start + n) // sp] for s in shards]  # this sequence on each rank
        chunks = [None] * (2 * sp)
        for r, part in enumerate(local):
            chunks[r], chunks[2 * sp - 1 - r] = part.chunk(2)
        seqs.append(torch.cat(chunks))
        start += n
    return torch.cat(seqs)


def local_cu_seqlens(lengths_padded, sp):
    return torch.tensor([0, *torch.tensor(lengths_padded).cumsum(0).tolist()],
                        dtype=torch.int32) // sp


def reference_attention(q, k, v, lengths_padded):
    """Plain causal softmax attention per (padded) sequence, K/V heads repeated for GQA."""
    outs, start = [], 0
    for n in lengths_padded:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for x in (ks, vs))
        s = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def check_ring(group, sp, rank, host=None):
    """Max |ring - reference| of out, dq, dk, dv on this rank, per dtype."""
    errors = {}
    lp = padded(LENGTHS, sp)
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(0)  # same global tensors on every rank
        q, k, v = (torch.randn(sum(lp), h, DIM, generator=g, dtype=dtype)
                   for h in (HQ, HKV, HKV))
        dout = torch.randn(sum(lp), HQ, DIM, generator=g, dtype=dtype)
        real = torch.cat([torch.arange(p) < n for n, p in zip(LENGTHS, lp)])
        dout[~real] = 0  # padding carries no loss

        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out = reference_attention(*ref_in, lp)
        ref_grads = torch.autograd.grad(ref_out, ref_in, dout)

        local = [zigzag(x, lp, sp, rank).requires_grad_() for x in (q, k, v)]
        out = ring_attention(*local, local_cu_seqlens(lp, sp), max(lp) // sp, group, host=host)
        out.backward(zigzag(dout, lp, sp, rank))
        errors[str(dtype)] = {
            name: (a - zigzag(b, lp, sp, rank)).abs().max().item()
            for name, a, b in [("out", out, ref_out)]
            + [(n, x.grad, gr) for n, x, gr in zip(("dq", "dk", "dv"), local, ref_grads)]
        }
        # no real query sees padded keys, so their gradients are exactly zero
        pad_local = ~zigzag(real, lp, sp, rank)
        errors[str(dtype)]["pad_dkv"] = max(local[1].grad[pad_local].abs().max().item(),
                                            local[2].grad[pad_local].abs().max().item())
    return errors


def _ring_worker(rank, world_size, sub_size):
    from RL2.parallel.host_comm import shared_group

    results = {"world": check_ring(dist.group.WORLD, world_size, rank)}
    # K/V blocks through shared memory (the CPU default, actor.cpu_comm=shm) instead of P2P
    host = shared_group(dist.group.WORLD, "ring attention")
    results["world_shm"] = check_ring(dist.group.WORLD, world_size, rank, host)
    assert host.calls > 0  # served through shared memory, not a silent fallback to P2P
    # the actor, reference and critic each build their own sp group over the same ranks: one
    # shared file serves them all; another use of the same ranks gets its own
    assert shared_group(dist.new_group(list(range(world_size))), "ring attention") is host
    assert shared_group(dist.group.WORLD, "fsdp comm") is not host
    # sp groups of sub_size inside the world (dp x sp); every rank creates every group.
    # sub_size 1: the ring degenerates to local causal attention without communication.
    groups = [dist.new_group(list(range(s, s + sub_size))) for s in range(0, world_size, sub_size)]
    sub = groups[rank // sub_size]
    results["subgroup"] = check_ring(sub, sub_size, rank % sub_size)
    if sub_size > 1:
        sub_host = shared_group(sub, "ring attention")
        assert sub_host is not host
        results["subgroup_shm"] = check_ring(sub, sub_size, rank % sub_size, sub_host)
        assert sub_host.calls > 0
    return results


def assert_small(results):
    tol = {"torch.float64": 1e-10, "torch.float32": 5e-6}
    for rank_result in results:
        for errors in rank_result.values():
            for dtype, errs in errors.items():
                for name, err in errs.items():
                    assert err < tol[dtype], (dtype, name, err, rank_result)


def _fused_ring(rank, world_size):
    """fp32 ring attention with 64-wide heads, the own block in the kernel or in ATen's blocks:
    max |error| of each against a float64 reference, and the kernel calls made."""
    from RL2.utils import cpu_ops

    calls = []
    for name in ("attention_forward", "attention_backward"):
        fn = getattr(ring_module, name)
        setattr(ring_module, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    lengths, hq, hkv, dim = [37, 90, 1, 20], 6, 2, 64
    lp = padded(lengths, world_size)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lp), h, dim, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(sum(lp), hq, dim, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [reference_attention(*ref_in, lp)]
    ref += torch.autograd.grad(ref[0], ref_in, dout)
    errors = {}
    for fused in (False, True):
        local = [zigzag(x, lp, world_size, rank).float().requires_grad_() for x in (q, k, v)]
        out = ring_attention(*local, local_cu_seqlens(lp, world_size), max(lp) // world_size,
                             dist.group.WORLD, fused=fused)
        out.backward(zigzag(dout, lp, world_size, rank).float())
        got = [out] + [x.grad for x in local]
        errors[fused] = [(a.double() - zigzag(b, lp, world_size, rank)).abs().max().item()
                         for a, b in zip(got, ref)]
    return errors, calls, cpu_ops.attention_takes(*(x[None].transpose(1, 2) for x in local))


def test_ring_attention_runs_its_own_block_in_the_kernel():
    """actor.cpu_fused_ops: a rank's own (causal) block of every local sequence goes through
    the C kernel in one call forward and one backward (given the ring's final out and lse);
    out, dq, dk and dv stay as close to float64 as ATen's blocks get (x 1.5)."""
    from RL2.utils import small_gemm

    if not small_gemm.available():
        import pytest

        pytest.skip("RL2's AVX-512 kernel not built here")
    for errors, calls, takes in run_dist(_fused_ring, 2):
        assert takes and calls == ["attention_forward", "attention_backward"]
        for name, plain, fused in zip(("out", "dq", "dk", "dv"), errors[False], errors[True]):
            assert fused <= 1.5 * plain + 1e-6, (name, plain, fused)


def test_ring_attention_sp2_and_single_rank_groups():
    assert_small(run_dist(_ring_worker, 2, 1))


def test_ring_attention_sp4_and_sp2_subgroups():
    assert_small(run_dist(_ring_worker, 4, 2))


# --- a whole tiny model with sp=2 == the single-process packed forward -------------------------

MODEL_LENGTHS = [6, 11, 3]
VOCAB = 64


def build_model(arch):
    # imported here so that the ring-only workers above do not pay for transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64)
    torch.manual_seed(0)  # identical replicas on every rank
    return model_cls._from_config(copy.deepcopy(cfg), attn_implementation=register(),
                                  dtype=torch.float32)


def _model_worker(rank, sp):
    lp = padded(MODEL_LENGTHS, sp)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in MODEL_LENGTHS]
    weights = torch.randn(sum(MODEL_LENGTHS), VOCAB, generator=g)
    errors = {}
    for arch in ("qwen2", "llama"):
        # reference: the whole unpadded packed row in this process
        ref = build_model(arch)
        cu = torch.tensor([0, *torch.tensor(MODEL_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        ctx = PackedContext(cu, max(MODEL_LENGTHS))
        pos = torch.cat([torch.arange(n) for n in MODEL_LENGTHS])
        ref_logits = ref(input_ids=torch.cat(ids)[None], position_ids=pos[None], use_cache=False,
                         **packed_kwargs(ctx)).logits[0]
        (ref_logits * weights).sum().backward()

        # sp: pad every sequence (position_ids keep counting), zig-zag split, ring attention
        model = build_model(arch)
        pad = [torch.cat([x, torch.zeros(p - n, dtype=x.dtype)]) for x, n, p in
               zip(ids, MODEL_LENGTHS, lp)]
        pos_pad = torch.cat([torch.arange(p) for p in lp])
        real = torch.cat([torch.arange(p) < n for n, p in zip(MODEL_LENGTHS, lp)])
        w_pad = torch.zeros(sum(lp), VOCAB)
        w_pad[real] = weights
        sp_ctx = PackedContext(local_cu_seqlens(lp, sp), max(lp) // sp, sp_group=dist.group.WORLD)
        logits = model(input_ids=zigzag(torch.cat(pad), lp, sp, rank)[None],
                       position_ids=zigzag(pos_pad, lp, sp, rank)[None], use_cache=False,
                       **packed_kwargs(sp_ctx)).logits[0]
        (logits * zigzag(w_pad, lp, sp, rank)).sum().backward()

        shards = [torch.empty_like(logits) for _ in range(sp)]
        dist.all_gather(shards, logits.detach().contiguous())
        full = unzigzag(shards, lp, sp)[real]
        err = {"logits": (full - ref_logits).abs().max().item()}
        ref_params = dict(ref.named_parameters())
        grad_err = 0.0
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)  # each rank holds the gradient of its own tokens' loss
            scale = ref_params[name].grad.abs().max().item() + 1e-6
            grad_err = max(grad_err, (p.grad - ref_params[name].grad).abs().max().item() / scale)
        err["grads_rel"] = grad_err
        errors[arch] = err
    return errors


def test_model_with_sp2_equals_single_process():
    for rank_errors in run_dist(_model_worker, 2):
        for arch, err in rank_errors.items():
            assert err["logits"] < 1e-5, (arch, err)
            assert err["grads_rel"] < 1e-5, (arch, err)


# --- one block: ATen's CPU flash kernel (the CPU path) == the matmul version (other devices) ----

def test_flash_kernel_only_where_it_supports_the_heads(monkeypatch):
    """torch < 2.9's CPU flash kernel has no GQA: grouped heads then take the matmul block."""
    from RL2.parallel import ring_attention as ra

    q, k = torch.zeros(3, HQ, DIM), torch.zeros(3, HKV, DIM)
    assert ra._flash(q, k) and ra._flash(q, q)
    monkeypatch.setattr(ra, "_FLASH_GQA", False)
    assert not ra._flash(q, k) and ra._flash(q, q)


def test_block_kernels_agree():
    """Both block implementations against each other, with the global out/lse of a two-block
    softmax as the ring's backward passes them: causal diagonal and full blocks, GQA, float64."""
    from RL2.parallel import ring_attention as ra

    g = torch.Generator().manual_seed(3)
    c = 7
    q, dout = (torch.randn(c, HQ, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2 * c, HKV, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    scale = DIM ** -0.5
    # the query chunk sees key chunk 0 whole and key chunk 1 causally (its own chunk)
    blocks = [(slice(0, c), False), (slice(c, 2 * c), True)]
    results = {}
    for name, fwd, bwd in [("flash", ra._flash_block_forward, ra._flash_block_backward),
                           ("matmul", ra._matmul_block_forward, ra._matmul_block_backward)]:
        parts = [fwd(q, k[ks], v[ks], scale, causal) for ks, causal in blocks]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        out = sum(o * torch.exp(l - lse).T[..., None] for o, l in parts)
        grads = [bwd(dout, q, k[ks], v[ks], out, lse, scale, causal) for ks, causal in blocks]
        dq = grads[0][0] + grads[1][0]
        dk = torch.cat([grads[0][1], grads[1][1]])
        dv = torch.cat([grads[0][2], grads[1][2]])
        results[name] = (out, lse, dq, dk, dv)
    # reference: autograd through plain softmax attention of q over all 2c keys (mask on chunk 1)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    qh, kh, vh = (x.transpose(0, 1) for x in ref_in)
    kh, vh = (x.repeat_interleave(HQ // HKV, dim=0) for x in (kh, vh))
    s = qh @ kh.transpose(1, 2) * scale
    mask = torch.cat([torch.zeros(c, c, dtype=torch.bool), torch.ones(c, c, dtype=torch.bool).triu(1)], 1)
    s = s.masked_fill(mask, float("-inf"))
    ref_out = (s.softmax(-1) @ vh).transpose(0, 1)
    ref = (ref_out, torch.logsumexp(s, -1), *torch.autograd.grad(ref_out, ref_in, dout))
    for name, got in results.items():
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            assert (a - b).abs().max().item() < 1e-10, (name, what)


def fake_ring_flash(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                    causal=False, group=None):
    """zigzag_ring_flash_attn_varlen_func of ring-flash-attn 0.1.8 on the CPU: refuses what it and
    flash-attn's kernel refuse (fp16/bf16 (total, heads, head_dim) inputs, int32 contiguous
    cu_seqlens on q's device; zigzag_ring_flash_attn_varlen.py halves cu_seqlens and max_seqlen,
    so every local sequence and max_seqlen must be even, and max_seqlen cover the longest);
    computes the ring with RL2's pure-torch path in fp32."""
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
    assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous() and cu_seqlens.device == q.device
    lengths = cu_seqlens.diff()
    assert bool((lengths % 2 == 0).all()) and max_seqlen % 2 == 0 and max_seqlen >= int(lengths.max())
    assert causal and dropout_p == 0.0 and group is not None
    return ring_attention(q.float(), k.float(), v.float(), cu_seqlens.tolist(), max_seqlen, group,
                          scale=softmax_scale, use_flash=False).to(q.dtype)


def _ring_flash_worker(rank, world_size):
    """The CUDA branch (ring-flash-attn) through the fake, on bf16 shards."""
    from RL2.parallel import attention, ring_attention as ra

    attention.flash_supported = lambda q: True
    calls = []
    ra._ring_flash_varlen = lambda: lambda *a, **kw: calls.append(1) or fake_ring_flash(*a, **kw)
    lp = padded(LENGTHS, world_size)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lp), h, DIM, generator=g) for h in (HQ, HKV, HKV))
    reference = zigzag(reference_attention(q, k, v, lp), lp, world_size, rank)
    local = [zigzag(x, lp, world_size, rank).bfloat16() for x in (q, k, v)]
    cu = local_cu_seqlens(lp, world_size).long()  # as a list or int64: the branch casts
    out = ring_attention(*local, cu, max(lp) // world_size, dist.group.WORLD)
    return len(calls), out.dtype, (out.float() - reference).abs().max().item()


def test_ring_flash_branch_hands_ring_flash_attn_what_it_takes():
    for calls, dtype, err in run_dist(_ring_flash_worker, 2):
        assert calls == 1 and dtype == torch.bfloat16 and err < 0.03, (calls, dtype, err)
