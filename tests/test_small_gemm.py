"""RL2's AVX-512 kernel for the CPU engine's decode-step products (RL2/utils/small_gemm.py):
F.linear's numbers within fp32 rounding at every shape the engine sends it, the same bits with
any thread count, the routing between it and oneDNN in PackedLinears, the engine's tokens, and a
clear fallback where it cannot be built."""
import asyncio
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine
from RL2.utils import onednn, small_gemm

CAN_BUILD = ("avx512f" in small_gemm.cpu_flags() and onednn.available()
             and (shutil.which("gcc") or shutil.which("cc")) is not None)
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no AVX-512 CPU or no C compiler here")


@needs_kernel
def test_the_kernel_builds_where_it_can():
    # CI's machine has AVX-512 and gcc: the kernel must not silently fall back there
    lib, why = small_gemm.load()
    assert lib is not None, why
    assert len(small_gemm.openmp_libraries()) == 1  # linked to PyTorch's own OpenMP runtime


@needs_kernel
@pytest.mark.parametrize("n,k", [(1024, 512), (100, 37), (17, 64), (3, 5), (48, 1536)])
@pytest.mark.parametrize("rows", [1, 7, 13, 16, 40, 64, 100, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_f_linear(n, k, rows, bias):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    y = small_gemm.linear(x, small_gemm.pack(w), n, b)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    # fp32 sums over k in another order than MKL's: relative to the size of the terms
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=2e-6 * k ** 0.5 * 4)


@needs_kernel
def test_batched_input_and_more_rows_than_a_strip_takes():
    w, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(3, 11, 24)  # 33 rows: passes of 12, 12 and 9 rows over one panel
    torch.testing.assert_close(small_gemm.linear(x, small_gemm.pack(w), 40, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
def test_same_bits_with_any_thread_count():
    # each output column is one thread's ordered sum: the thread count cannot change a bit
    w, x = torch.randn(304, 256), torch.randn(16, 256)
    packed = small_gemm.pack(w)
    _same_bits_with_1_2_3_threads(lambda: small_gemm.linear(x, packed, 304))


@needs_kernel
@pytest.mark.parametrize("mode", ["plain", "bias+res", "norm", "glu", "rope", "odd strip"])
def test_rows_give_the_same_bits_alone_and_in_any_group(mode):
    # more than 12 rows go in groups whose passes take turns over chunks of k, the sums carried
    # between chunks (fix 35): each row's sums still run over k in order, so a row alone (one
    # pass, no chunks) and the same row among 1, 13, 48 (one group) or 100 (groups of 48, 48
    # and 4) rows give the same bits, at k not a multiple of the 64-step chunk
    g = torch.Generator().manual_seed(len(mode))
    heads, d, k = 3, 64, 200
    n = 48 if mode == "odd strip" else heads * d + 40
    w, b, u = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(n, k, generator=g)
    x, res = torch.randn(100, k, generator=g), torch.randn(100, n, generator=g)
    norm = (torch.randn(k, generator=g), 1e-6)
    cos, sin = _rotary(100, d, g)
    packed = small_gemm.pack_glu(w, u) if mode == "glu" else small_gemm.pack(w)

    def run(i, j):
        kw = dict(bias=b)
        if mode == "bias+res":
            kw["res"] = res[i:j]
        elif mode == "norm":
            kw["norm"] = norm
        elif mode == "glu":
            kw.update(bias=small_gemm.pack_glu_bias(b, None), glu=True, norm=norm)
        elif mode == "rope":
            kw["rope"] = (cos[i:j], sin[i:j], heads)
        return small_gemm.linear(x[i:j], packed, n, **kw)

    alone = torch.cat([run(i, i + 1) for i in range(100)])
    for i, j in [(0, 13), (13, 61), (0, 100)]:
        assert torch.equal(run(i, j), alone[i:j]), (mode, i, j)
    _same_bits_with_1_2_3_threads(lambda: run(0, 100))


def _same_bits_with_1_2_3_threads(fn):
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(fn())
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
@pytest.mark.parametrize("n,k", [(1024, 512), (100, 37), (17, 64), (3, 5)])
@pytest.mark.parametrize("rows", [1, 13, 16, 64])
def test_fused_norm_and_residual_match_the_eager_ops(n, k, rows):
    # what a decoder layer does around its products: res + linear(RMSNorm(x))
    g = torch.Generator().manual_seed(n + k + rows)
    w, b, nw = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(k, generator=g)
    x, res = torch.randn(rows, k, generator=g) * 3, torch.randn(rows, n, generator=g)
    packed, tol = small_gemm.pack(w), dict(rtol=1e-5, atol=8e-6 * k ** 0.5)
    normed = F.rms_norm(x, (k,), nw, 1e-6)
    torch.testing.assert_close(small_gemm.linear(x, packed, n, b, norm=(nw, 1e-6)),
                               F.linear(normed, w, b), **tol)
    torch.testing.assert_close(small_gemm.linear(x, packed, n, b, res=res), res + F.linear(x, w, b),
                               **tol)
    torch.testing.assert_close(small_gemm.linear(x, packed, n, None, res, (nw, 1e-6)),
                               res + F.linear(normed, w), **tol)
    # the norm's rows are shared out among threads, the panels after a barrier: same bits
    _same_bits_with_1_2_3_threads(lambda: small_gemm.linear(x, packed, n, b, res, (nw, 1e-6)))


@needs_kernel
@pytest.mark.parametrize("n,k", [(1536, 512), (100, 37), (17, 64), (3, 5)])
@pytest.mark.parametrize("rows", [1, 13, 16, 128])
@pytest.mark.parametrize("biases", [(False, False), (True, False), (True, True)])
def test_gated_mlp_activation_matches_silu_gate_times_up(n, k, rows, biases):
    # glu: a gate's and an up projection's strips alternate, the kernel stores SiLU(gate) * up
    g = torch.Generator().manual_seed(n + k + rows)
    gate, up, nw = torch.randn(n, k, generator=g), torch.randn(n, k, generator=g), torch.randn(k, generator=g)
    bg, bu = (torch.randn(n, generator=g) if b else None for b in biases)
    x = torch.randn(rows, k, generator=g)
    h = F.rms_norm(x, (k,), nw, 1e-6)
    want = F.silu(F.linear(h, gate, bg)) * F.linear(h, up, bu)
    got = small_gemm.linear(x, small_gemm.pack_glu(gate, up), n, small_gemm.pack_glu_bias(bg, bu),
                            norm=(nw, 1e-6), glu=True)
    # errors of the two products (relative to their terms' size), carried through the product
    scale = (F.linear(h, up, bu).abs() + F.linear(h, gate, bg).abs() + 1) * k ** 0.5
    assert ((got - want).abs() <= 2e-6 * scale + 1e-5 * want.abs()).all()


@needs_kernel
def test_gated_activation_at_the_edges_of_the_exponential():
    # SiLU through the kernel's own exp: as torch's where it overflows, underflows, and on NaN
    vals = [-200.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 0.5, 1.0, 5.0, 20.0, 88.0, 200.0,
            float("nan"), float("inf"), float("-inf")]
    eye = torch.eye(16)
    for v in vals:
        x = torch.zeros(1, 16)
        x[0, 0] = v
        got = small_gemm.linear(x, small_gemm.pack_glu(eye, eye), 16, glu=True)[0, 0]
        want = F.silu(torch.tensor(v)) * v
        assert torch.isclose(got, want, rtol=1e-6, atol=0, equal_nan=True), (v, got, want)
    x = torch.linspace(-30, 30, 4096).view(-1, 16)
    got = torch.cat([small_gemm.linear(r[None], small_gemm.pack_glu(eye, eye), 16, glu=True) for r in x])
    torch.testing.assert_close(got, F.silu(x) * x, rtol=1e-6, atol=1e-30)


def _rotary(rows: int, head_dim: int, g: torch.Generator):
    pos = torch.randint(0, 4000, (rows,), generator=g).float()
    freqs = pos[:, None] / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,k", [(8, 4, 64, 512), (2, 1, 32, 40), (4, 2, 128, 96)])
@pytest.mark.parametrize("rows", [1, 16, 65])
def test_rotary_embedding_matches_hf_rotate_half(heads, kv_heads, head_dim, k, rows):
    # rope: the q and k heads of a q/k/v product rotated in the kernel, v left as it is
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(heads + head_dim + rows)
    n = (heads + 2 * kv_heads) * head_dim
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    cos, sin = _rotary(rows, head_dim, g)
    y = F.linear(x, w, b)
    q, kk = (t.view(rows, -1, head_dim).transpose(0, 1) for t in y[:, :(heads + kv_heads) * head_dim]
             .split([heads * head_dim, kv_heads * head_dim], -1))
    q, kk = apply_rotary_pos_emb(q, kk, cos, sin, unsqueeze_dim=0)  # HF's [heads, rows, D]
    want = torch.cat([q.transpose(0, 1).reshape(rows, -1), kk.transpose(0, 1).reshape(rows, -1),
                      y[:, (heads + kv_heads) * head_dim:]], -1)
    order = small_gemm.rope_order(n, heads + kv_heads, head_dim)
    got = small_gemm.linear(x, small_gemm.pack(w[order]), n, b[order], rope=(cos, sin, heads + kv_heads))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-6 * k ** 0.5 * 4)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 80, 16])  # 80, 16: the kernel's generic loop
@pytest.mark.parametrize("group", [1, 2, 7, 8])
@pytest.mark.parametrize("width", [1, 16, 17, 100])
def test_decode_attention_matches_the_eager_ops(head_dim, group, width):
    # q as llama_forward makes it (a view of the rotated q/k output), keys and values a window
    # of a larger cache buffer, some rows' leading columns padding (-inf)
    g = torch.Generator().manual_seed(head_dim + group + width)
    rows, kv_heads = 5, 2
    qk = torch.randn(rows, kv_heads * group + kv_heads, head_dim, generator=g)
    q = qk[:, :kv_heads * group].view(rows, kv_heads, group, head_dim)
    buffers = [torch.randn(rows + 2, kv_heads, width + 9, head_dim, generator=g) for _ in range(2)]
    keys, values = (b[:rows, :, 4:4 + width] for b in buffers)
    pad = torch.tensor([0, width - 1, width // 2, 0, 1])[:rows].clamp(max=width - 1)
    bias = torch.zeros(rows, 1, 1, width).masked_fill_(torch.arange(width) < pad[:, None, None, None],
                                                     float("-inf"))
    from RL2.rollout import llama_forward

    got = small_gemm.attention(q, keys, values, bias, head_dim ** -0.5)
    want = llama_forward._attend_step(q, keys, values, bias, head_dim ** -0.5)  # the eager ops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and in llama_forward, through PackedLinears
    pl = onednn.PackedLinears(small=True)
    torch.testing.assert_close(llama_forward._attend_step(q, keys, values, bias, 0.1, pl),
                               llama_forward._attend_step(q, keys, values, bias, 0.1), rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_decode_attention_skips_left_padding_with_the_same_bits(head_dim):
    """Whole 16-column chunks of left padding (-inf) are skipped: the same bits as reading every
    column (the softmax sums the same lanes in the same order), and padding below the chunk
    holding a row's first token is never read (NaN there stays out of the output)."""
    from RL2.rollout import llama_forward

    g = torch.Generator().manual_seed(head_dim)
    rows, kv_heads, group, width = 4, 2, 3, 300
    q = torch.randn(rows, kv_heads, group, head_dim, generator=g)
    keys, values = (torch.randn(rows, kv_heads, width, head_dim, generator=g) for _ in range(2))
    first = torch.tensor([37, 0, 299, 16])  # each row's first live column
    bias = torch.zeros(rows, 1, 1, width).masked_fill_(torch.arange(width) < first[:, None, None, None],
                                                     float("-inf"))
    full = small_gemm.attention(q, keys, values, bias, 0.125)
    torch.testing.assert_close(full, llama_forward._attend_step(q, keys, values, bias, 0.125),
                               rtol=1e-5, atol=1e-6)
    # a finite bias of -3e38 weighs those columns exactly 0 too, but is not skipped: the bits
    # of the kernel reading every column
    assert torch.equal(full, small_gemm.attention(q, keys, values, bias.clamp(min=-3e38), 0.125))
    poisoned = [t.clone() for t in (keys, values)]
    for r in range(rows):
        for t in poisoned:
            t[r, :, :int(first[r]) // 16 * 16] = float("nan")
    assert torch.equal(small_gemm.attention(q, *poisoned, bias, 0.125), full)


def test_decode_attention_declines_what_it_does_not_take():
    q, kv, bias = torch.randn(2, 2, 2, 64), torch.randn(2, 2, 9, 64), torch.zeros(2, 1, 1, 9)
    for args in [(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), bias.bfloat16()),  # not fp32
                 (torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64),
                  torch.zeros(2, 1, 1, 9)),  # a group of 9 queries
                 (torch.randn(2, 2, 2, 40), torch.randn(2, 2, 9, 40), torch.randn(2, 2, 9, 40), bias),
                 (torch.randn(2, 2, 2, 272), torch.randn(2, 2, 9, 272), torch.randn(2, 2, 9, 272), bias),
                 (q, kv, kv, torch.zeros(2, 9)),  # the bias in another shape
                 (q, kv.transpose(2, 3).contiguous().transpose(2, 3), kv, bias)]:  # keys column-major
        assert small_gemm.attention(*args, 0.125) is None
    assert onednn.PackedLinears(small=False).attention(q, kv, kv, bias, 0.125) is None


@needs_kernel
def test_fused_arguments_of_the_wrong_shape_are_refused():
    w, x = torch.randn(8, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match="residual"):
        small_gemm.linear(x, small_gemm.pack(w), 8, res=torch.randn(2, 7))
    with pytest.raises(ValueError, match="norm weight"):
        small_gemm.linear(x, small_gemm.pack(w), 8, norm=(torch.randn(15), 1e-6))
    with pytest.raises(ValueError, match="take no residual"):
        small_gemm.linear(x, small_gemm.pack_glu(w, w), 8, res=torch.randn(2, 8), glu=True)
    cos = torch.randn(2, 32)
    with pytest.raises(ValueError, match="rope"):  # 32 columns of rope in an 8-column product
        small_gemm.linear(x, small_gemm.pack(w), 8, rope=(cos, cos, 1))
    with pytest.raises(ValueError, match="rope"):  # a head_dim the kernel does not split
        small_gemm.rope_order(96, 2, 48)


def test_eligibility():
    w = torch.randn(32, 8)
    assert small_gemm.eligible(torch.randn(small_gemm.MAX_ROWS, 8), w)
    assert small_gemm.eligible(torch.randn(2, 3, 8), w)
    assert not small_gemm.eligible(torch.randn(small_gemm.MAX_ROWS + 1, 8), w)  # prefill: oneDNN
    assert not small_gemm.eligible(torch.randn(0, 8), w)
    assert not small_gemm.eligible(torch.randn(4, 8, dtype=torch.bfloat16), w.bfloat16())
    assert not small_gemm.eligible(torch.randn(4, 8, dtype=torch.float64), w.double())


def test_openmp_runtimes_are_read_from_the_process_map():
    maps = textwrap.dedent("""\
        7f00-7f01 r-xp 00000000 08:01 1 /venv/torch/lib/libgomp.so.1
        7f01-7f02 r--p 00001000 08:01 1 /venv/torch/lib/libgomp.so.1
        7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libgomp.so.1
        7f03-7f04 rw-p 00000000 00:00 0
        7f04-7f05 r-xp 00000000 08:01 3 /venv/torch.libs/libgomp-a34b3233.so.1
        7f05-7f06 r-xp 00000000 08:01 4 /venv/torch/lib/libtorch_cpu.so
    """)
    assert small_gemm.openmp_libraries(maps) == {
        "/venv/torch/lib/libgomp.so.1", "/usr/lib/x86_64-linux-gnu/libgomp.so.1",
        "/venv/torch.libs/libgomp-a34b3233.so.1"}


@needs_kernel
def test_packed_linears_route_few_rows_to_the_kernel_and_the_rest_to_onednn():
    from RL2.rollout import llama_forward

    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(64, n, bias=True) for n in (64, 32, 32))
    o = torch.nn.Linear(64, 64, bias=False)
    pl = onednn.PackedLinears(small=True)
    assert pl.small
    for rows in (1, small_gemm.MAX_ROWS, small_gemm.MAX_ROWS + 1, 100):
        x = torch.randn(rows, 64)
        got = pl.many(x, (q, k, v)) + [pl(x, o)]
        for y, lin in zip(got, (q, k, v, o)):
            torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
    # few rows went to the kernel's copies, the others to oneDNN's: one of each per weight set
    assert set(pl._strips) == {(q, k, v), o} and set(pl._packed) == {(q, k, v), o}
    # weights changed in place (a colocated sync): after clear() the new values are used
    with torch.no_grad():
        for lin in (q, k, v, o):
            lin.weight.mul_(-1)
    pl.clear()
    x = torch.randn(4, 64)
    torch.testing.assert_close(pl.stacked(x, (q, k, v)), torch.cat([q(x), k(x), v(x)], -1),
                               rtol=1e-5, atol=1e-5)
    # without `small` nothing goes to the kernel
    off = onednn.PackedLinears()
    off(x, o)
    assert not off.small and not off._strips
    # fused norm / residual (more rows than the kernel's product takes: test_many_rows_...);
    # None tells the caller to do them itself
    nw, res = torch.randn(64), torch.randn(4, 64)
    torch.testing.assert_close(pl.fused(x, (o,), norm=(nw, 1e-6), res=res),
                               res + o(F.rms_norm(x, (64,), nw, 1e-6)), rtol=1e-5, atol=1e-5)
    assert off.fused(x, (o,), res=res) is None
    gate, up = torch.nn.Linear(64, 48), torch.nn.Linear(64, 48, bias=False)
    torch.testing.assert_close(pl.fused(x, (gate, up), glu=True), F.silu(gate(x)) * up(x),
                               rtol=1e-5, atol=1e-5)
    assert pl.fused(x, (q, k), glu=True) is None  # not a gate / up pair of one shape
    cos, sin = _rotary(4, 32, torch.Generator().manual_seed(0))
    got = pl.fused(x, (q, k, v), rope=(cos, sin, 3))  # heads of 32: q's two and k's one
    want = torch.cat([q(x), k(x), v(x)], -1)
    heads = want[:, :96].view(4, 3, 32)
    want[:, :96] = llama_forward._rotate(heads, cos[:, None], sin[:, None]).flatten(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    odd = torch.randn(4, 48)  # heads of 48: the kernel does not split them
    assert pl.fused(x, (q, k, v), rope=(odd, odd, 2)) is None


@needs_kernel
def test_many_rows_fuse_onednns_product_with_the_kernels_epilogues():
    """Past MAX_ROWS (a prefill), `fused` is oneDNN's product with the norm, SiLU(gate) * up and
    the rotation as one C pass each: the eager ops' results (the rotation bit for bit), and
    None where a pass does not take the tensors (the caller then runs the eager ops)."""
    from RL2.rollout import llama_forward

    torch.manual_seed(0)
    rows = small_gemm.MAX_ROWS + 37
    q, k, v = (torch.nn.Linear(64, n, bias=True) for n in (64, 32, 32))
    o, gate, up = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 48), torch.nn.Linear(64, 48)
    pl, x, nw, res = onednn.PackedLinears(small=True), torch.randn(rows, 64), torch.randn(64), torch.randn(rows, 64)
    with torch.inference_mode():
        h = F.rms_norm(x, (64,), nw, 1e-6)
        torch.testing.assert_close(pl.fused(x, (o,), norm=(nw, 1e-6), res=res), res + pl(h, o),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(pl.fused(x, (o,), res=res), res + pl(x, o))  # the same ops
        torch.testing.assert_close(pl.fused(x, (gate, up), norm=(nw, 1e-6), glu=True),
                                   F.silu(gate(h)) * up(h), rtol=1e-5, atol=1e-5)
        cos, sin = _rotary(rows, 32, torch.Generator().manual_seed(1))
        got = pl.fused(x, (q, k, v), rope=(cos, sin, 3))
        want = pl.stacked(x, (q, k, v))
        want[:, :96] = llama_forward._rotate(want[:, :96].view(rows, 3, 32), cos[:, None],
                                             sin[:, None]).flatten(1)
        assert torch.equal(got, want)
        assert pl.fused(x, (q, k), glu=True) is None  # not a gate / up pair of one shape
        odd = torch.randn(rows, 48)  # heads of 48: not a multiple of 32
        assert pl.fused(x, (q, k, v), rope=(odd, odd, 2)) is None
        assert pl.fused(x.double(), (o,), res=res.double()) is None
        assert pl.fused(x.t().contiguous().t(), (o,), res=res) is None  # column-major rows
        assert onednn.PackedLinears().fused(x, (o,), res=res) is None  # no kernel asked for
        # the norm and the activation: the arithmetic of the kernel's few-row epilogues (seen
        # through an identity product, exact) and the eager ops' results within rounding
        eye, few = torch.eye(64), x[:8]
        torch.testing.assert_close(small_gemm.rms_norm(x, nw, 1e-6), h, rtol=1e-6, atol=1e-6)
        assert torch.equal(small_gemm.rms_norm(few, nw, 1e-6),
                           small_gemm.linear(few, small_gemm.pack(eye), 64, norm=(nw, 1e-6)))
        gu = torch.randn(rows, 64) * 8
        torch.testing.assert_close(small_gemm.silu_mul(gu, 32), F.silu(gu[:, :32]) * gu[:, 32:],
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(small_gemm.silu_mul(gu[:8], 32),
                           small_gemm.linear(gu[:8], small_gemm.pack_glu(eye[:32], eye[32:]), 32, glu=True))
        assert small_gemm.silu_mul(gu, 40) is None and small_gemm.rms_norm(x, nw[:8], 1e-6) is None


def _decode_steps(model, pl, ids):
    """Logits of llama_forward's prefill of ids[:, :60] and decode steps over the rest, through pl."""
    from RL2.rollout import llama_forward
    from RL2.rollout.kv_cache import BatchKV

    logits, keys, values, lens = llama_forward.prefill(model, [r[:60].tolist() for r in ids],
                                                       [None] * len(ids), "cpu", pl)
    kv = BatchKV()
    kv.add(keys, values, lens, room=8)
    got = [logits]
    for j in range(60, ids.shape[1]):
        kv.reserve(1)
        got.append(llama_forward.decode(model, ids[:, j], kv, pl))
        kv.advance()
    return torch.stack(got, 1)


def _counting(pl, name, calls):
    method = getattr(pl, name)

    def counted(*a, **kw):
        out = method(*a, **kw)
        if out is not None:  # the kernel took it
            calls.append(kw)
        return out
    setattr(pl, name, counted)


def _two_paths():
    """(a PackedLinears whose decode_layers calls are counted into `calls`, one without
    decode_layers: op by op), calls"""
    whole, op_by_op, calls = onednn.PackedLinears(small=True), onednn.PackedLinears(small=True), []
    _counting(whole, "decode_layers", calls)
    op_by_op.decode_layers = None
    return (whole, op_by_op), calls


@needs_kernel
def test_decoder_layers_with_the_kernels_fused_ops_match_hf():
    # llama_forward hands each layer's RMSNorms, rotary, residual adds and SiLU(gate) * up to
    # the kernel: with the product at the decode steps (here op by op, without decode_layers),
    # as passes of their own around oneDNN's product in the prefill (180 rows); both must
    # still give HF's logits
    model = _model(5)
    pl, calls = onednn.PackedLinears(small=True), []
    pl.decode_layers = None
    _counting(pl, "fused", calls)
    ids = torch.randint(4, 512, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    got = _decode_steps(model, pl, ids)
    torch.testing.assert_close(got, want[:, 59:], rtol=1e-4, atol=1e-4)
    # in the prefill and each of the 4 decode steps, per layer: the q/k/v product with its norm
    # and rotation, o_proj with its residual, gate/up with its norm and activation, down_proj
    # with its residual; then the final norm with the LM head
    assert sum("norm" in kw for kw in calls) == 5 * (2 * 2 + 1)
    assert sum("res" in kw for kw in calls) == 5 * 2 * 2
    assert sum(kw.get("glu", False) for kw in calls) == 5 * 2
    assert sum(kw.get("rope") is not None for kw in calls) == 5 * 2


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,hidden,bias,layers,rows", [
    (4, 2, 128, True, 2, 5), (2, 1, 256, False, 2, 5), (8, 1, 256, True, 2, 5),
    (4, 4, 128, False, 2, 5), (4, 2, 128, True, 3, 20)])
def test_whole_decode_layers_equal_the_op_by_op_path_bit_for_bit(heads, kv_heads, hidden, bias,
                                                                  layers, rows):
    # decode_layers runs a step's fused ops in one kernel call and writes the cache itself: the
    # same arithmetic in the same order as the op-by-op path, so the same bits, over steps that
    # evict rows and move the window; head_dim 32 / 64 / 128 and query groups of 1 / 2 / 8; an
    # odd number of layers (the output's buffer alternates) and 20 rows (chunked products)
    from RL2.rollout import llama_forward
    from RL2.rollout.kv_cache import BatchKV

    torch.manual_seed(7)
    cls = Qwen2ForCausalLM if bias else LlamaForCausalLM
    cfg = (Qwen2Config if bias else LlamaConfig)(
        vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden + 16,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256)
    model = cls(cfg).eval()
    prompts = [[(7 * i + 3 * j) % 300 for j in range(3 + 5 * (i % 9))] for i in range(rows)]
    runs = []
    paths, calls = _two_paths()
    for pl in paths:
        logits, keys, values, lens = llama_forward.prefill(model, prompts, [None] * rows, "cpu", pl)
        kv, last, out = BatchKV(), logits.argmax(-1), []
        kv.add(keys, values, lens, room=4)  # too little room: the window moves, buffers grow
        for step in range(12):
            kv.reserve(1)
            lg = llama_forward.decode(model, last, kv, pl)
            kv.advance()
            out.append(lg)
            last = lg.argmax(-1)
            if step == 5:
                kv.compact([4, 1, 3])
                last = last[[4, 1, 3]]
        runs.append(out)
    got, want = runs
    assert len(calls) == 12  # every step's layers in one call
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(32, 4, 2), (64, 4, 1)])
def test_whole_decode_layers_of_qwen3_match_hf(head_dim, heads, kv_heads):
    # Qwen3 normalises each query and key head before the rotation: decode_layers does it after
    # the product (its norm sums in another order: close to the op-by-op path, not equal)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=400, hidden_size=128, intermediate_size=272, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=256)).eval()
    with torch.no_grad():  # norms away from 1, so that a skipped or misplaced norm shows
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(4, 400, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    paths, calls = _two_paths()
    got, op_by_op = (_decode_steps(model, pl, ids) for pl in paths)
    assert len(calls) == 4
    torch.testing.assert_close(got, op_by_op, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want[:, 59:], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_decode_layers_are_laid_out_once_and_dropped_with_the_weights(monkeypatch):
    # PackedLinears keeps one DecodeLayers per model: built on the first step it can take (a
    # step of too many rows is refused, not remembered), kept over steps and cache buffers
    # that change, rebuilt for another model and after clear() (weights changed)
    from RL2.rollout import llama_forward
    from RL2.rollout.kv_cache import BatchKV

    model, pl = _model(3), onednn.PackedLinears(small=True)
    made, make = [], small_gemm.DecodeLayers.make

    def counting_make(*a, **kw):
        made.append(make(*a, **kw))
        return made[-1]

    def steps(rows, n=2):
        prompts = [[(3 * i + j) % 500 for j in range(4 + i % 7)] for i in range(rows)]
        logits, keys, values, lens = llama_forward.prefill(model, prompts, [None] * rows, "cpu", pl)
        kv, last = BatchKV(), logits.argmax(-1)
        kv.add(keys, values, lens, room=n)
        for _ in range(n):
            kv.reserve(1)
            last = llama_forward.decode(model, last, kv, pl).argmax(-1)
            kv.advance()

    monkeypatch.setattr(small_gemm.DecodeLayers, "make", counting_make)
    steps(small_gemm.MAX_ROWS + 1)  # over the kernel's rows: op by op, nothing kept
    assert made == [] and pl._layers is None
    steps(3)
    steps(4)  # another cache: the same layout, re-pointed
    assert len(made) == 1 and made[0] is not None and pl._layers[1] is made[0]
    pl.clear()
    steps(3)
    assert len(made) == 2 and pl._layers[1] is made[1]
    other = _model(4)
    model = other
    steps(3)
    assert len(made) == 3 and pl._layers[0] is other.model.layers


@needs_kernel
def test_whole_decode_layers_decline_what_they_do_not_take():
    # the caller falls back to the op-by-op path on None: wrong dtypes, shapes or windows, at
    # the layout (make) or at a step (the call)
    x = torch.randn(2, 64)
    keys = [torch.zeros(2, 1, 8, 32) for _ in range(2)]
    w = small_gemm.pack(torch.randn(128, 64))
    layer = dict(norm1=(torch.ones(64), 1e-6), qkv=(w, 128, None), o=(small_gemm.pack(torch.randn(64, 64)), 64, None),
                 norm2=(torch.ones(64), 1e-6), glu=(small_gemm.pack_glu(torch.randn(32, 64), torch.randn(32, 64)), 32, None),
                 down=(small_gemm.pack(torch.randn(64, 32)), 64, None), qk_norm=None)
    make = lambda change={}, **kw: small_gemm.DecodeLayers.make(  # noqa: E731
        [layer, {**layer, **change}], **{**dict(kv_heads=1, head_dim=32, scale=0.1), **kw})
    step = dict(rope=(torch.ones(2, 32), torch.zeros(2, 32)), cache=(keys, [k.clone() for k in keys], 2, 5),
                bias=torch.zeros(2, 1, 1, 4))
    layers = make()
    assert layers(x, **step) is not None
    for change in (dict(qkv=(w, 112, None)),                                  # not heads + 2 kv heads
                   dict(o=(small_gemm.pack(torch.randn(64, 32)), 64, None)),  # o_proj's K is not 4 x 32
                   dict(down=(small_gemm.pack(torch.randn(64, 48)), 64, None)),  # nor down_proj's 32
                   dict(o=(layer["o"][0], 64, torch.zeros(32))),              # a bias of 32, not 64
                   dict(norm2=(torch.ones(64).double(), 1e-6))):
        assert make(change) is None, change
    assert make(head_dim=16) is None and make(kv_heads=3) is None
    for change in (dict(bias=torch.zeros(2, 1, 1, 5)),                        # the window is 4 wide
                   dict(cache=(keys, keys, 2, 8)),                             # column past the buffer
                   dict(cache=(keys[:1], keys[:1], 2, 5)),                     # a layer's buffers missing
                   dict(cache=([k.double() for k in keys], keys, 2, 5)),
                   dict(cache=(keys, [torch.zeros(2, 1, 9, 32)] * 2, 2, 5)),   # buffers of two shapes
                   dict(rope=(torch.ones(2, 16), torch.zeros(2, 16)))):
        assert layers(x, **{**step, **change}) is None, change
    assert layers(x.double(), **step) is None
    assert layers(torch.randn(3, 64), **step) is None                          # rows != cos rows
    assert layers(x, **step) is not None  # a refused step leaves the layers usable


def _model(seed):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).eval()


@needs_kernel
def test_engine_decodes_through_the_kernel_with_onednn_engine_tokens():
    prompts = [[(5 * i + j) % 512 for j in range(4 + 3 * i)] for i in range(6)]

    def run(engine):
        async def go():
            params = SamplingParams(temperature=0, max_new_tokens=20)
            return await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        return [out[0] for out in asyncio.run(go())]

    kernel, plain = TorchEngine(_model(3), None), TorchEngine(_model(3), None, small_gemm=False)
    got, want = run(kernel), run(plain)
    assert kernel.runner.linear.small and kernel.runner.linear._strips  # the default, and used
    assert not plain.runner.linear._strips
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    # new weights: the strips are rebuilt, as oneDNN's packed copies are
    other = _model(4)
    for engine in (kernel, plain):
        engine.update_weights(other.state_dict().items())
    assert [o.token_ids for o in run(kernel)] == [o.token_ids for o in run(plain)]


SCRIPT = """
import torch
from RL2.utils import onednn, small_gemm
lib, why = small_gemm.load()
print("WHY", why)
pl = onednn.PackedLinears(small=True)
lin = torch.nn.Linear(8, 4)
x = torch.randn(2, 8)
assert not pl.small and torch.allclose(pl(x, lin), lin(x), atol=1e-6)
"""


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_without_a_working_compiler_the_engine_keeps_onednn_and_says_why(tmp_path, compiler):
    cc = tmp_path / "cc"
    if compiler == "failing":
        cc.write_text("#!/bin/sh\necho 'cc: fatal error: no input' >&2\nexit 1\n")
        cc.chmod(0o755)
    env = dict(os.environ, CC=str(cc), RL2_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    why = proc.stdout.split("WHY ", 1)[1]
    if "avx512f" not in small_gemm.cpu_flags():
        assert "no AVX-512" in why
    elif compiler == "missing":
        assert "no C compiler" in why
    else:
        assert "could not build" in why and "no input" in why


@needs_kernel
@pytest.mark.parametrize("rows,cols", [(1, 1), (16, 16), (17, 33), (64, 16), (65, 200), (1376, 1536),
                                       (100, 7)])
def test_transpose_equals_torch_for_any_shape_row_stride_and_thread_count(rows, cols):
    # full 16 x 16 blocks go through registers, edge blocks element by element: every shape
    # here has one or both; a row stride past the row (a column slice) is read as such
    x = torch.randn(rows, cols + 5)
    for src in (x[:, :cols].contiguous(), x[:, 2:2 + cols]):
        _same_bits_with_1_2_3_threads(lambda: small_gemm.transpose(src))
        assert torch.equal(small_gemm.transpose(src), src.t().contiguous())


@needs_kernel
def test_transpose_declines_what_it_does_not_take():
    assert small_gemm.transpose(torch.randn(4, 6, dtype=torch.float64)) is None
    assert small_gemm.transpose(torch.randn(6, 4).t()) is None  # columns not contiguous
    assert small_gemm.transpose(torch.randn(2, 3, 4)) is None
    assert small_gemm.transpose(torch.randn(0, 4)).shape == (4, 0)
    assert small_gemm.transpose(torch._neg_view(torch.randn(20, 20))) is None  # lazy negation


@needs_kernel
@pytest.mark.parametrize("sizes,k", [([16], 32), ([40], 33), ([7], 5), ([1536], 512), ([512, 256, 256], 64),
                                     ([512, 256, 250], 96), ([20, 30], 64)])
def test_packing_in_c_is_the_torch_layout_bit_for_bit(sizes, k):
    # pack_many's one copy must lay out exactly what pack / pack_glu of the stacked rows do:
    # one weight, q / k / v stacked, the rotary order, a gate's and up's alternating strips,
    # tails under 16 rows; ([20, 30]) a strip would mix two weights: torch's ops, same layout
    ws = [torch.randn(n, k) for n in sizes]
    stacked = torch.cat(ws)
    want = {None: small_gemm.pack(stacked)}
    n = stacked.shape[0]
    if k % 32 == 0 and n >= 128 and all(s % 16 == 0 for s in sizes[:-1]):
        order = small_gemm.rope_order(n, n // 128, 64)  # head_dim 64: rows really move
        assert not torch.equal(order, torch.arange(n))
        assert small_gemm.strip_sources(ws, order) is not None  # the C copy, not the fallback
        want[order] = small_gemm.pack(stacked[order])
    for order, layout in want.items():
        _same_bits_with_1_2_3_threads(lambda: small_gemm.pack_many(ws, order=order))
        assert torch.equal(small_gemm.pack_many(ws, order=order), layout)
    assert (small_gemm.strip_sources(ws) is None) == any(s % 16 for s in sizes[:-1])
    up = torch.randn(sizes[0], k)
    assert torch.equal(small_gemm.pack_many([ws[0], up], glu=True), small_gemm.pack_glu(ws[0], up))
    # not dense row-major (a transposed view): torch's ops, the same layout
    t = torch.randn(k, sizes[0]).t()
    assert small_gemm.strip_sources([t]) is None
    assert torch.equal(small_gemm.pack_many([t]), small_gemm.pack(t))
