"""Zig-zag ring attention for packed sequences (sequence parallelism), pure PyTorch over P2P.

Layout (docs/DEV_SPEC.md, "Packing"): every sequence is padded to Lp, a multiple of 2*sp, and cut
into 2*sp chunks of c = Lp / (2*sp) tokens; rank r holds chunks r and 2*sp-1-r back to back. The
local cu_seqlens (2c per sequence) are therefore the same on every rank, so a rank can slice a K/V
block that arrives from any other rank with its own cu_seqlens. Pairing an early chunk with a late
one balances the causal work across ranks.

Forward: K/V travel around the ring (sp steps); each rank attends its query chunks to the visiting
chunks according to their global chunk index (earlier chunk: full block, same chunk: causal
diagonal, later chunk: skipped) and merges the partial outputs with their log-sum-exp.
Backward: recomputes the blocks from the saved log-sum-exp (flash-attention style) while K/V travel
around the ring again together with dK/dV accumulators, which arrive back at their owner after sp
hops, so dQ, dK and dV are exact. Every P2P exchange is waited for inside the call, so nothing is in
flight when it returns; still put a `dist.barrier()` before `destroy_process_group` (gloo can abort
at exit after P2P otherwise). A block runs ATen's CPU flash-attention kernel on the CPU; elsewhere
it materialises a (heads, c, c) score matrix (a fallback: GPUs should use ring-flash-attn). With
`fused` (actor.cpu_fused_ops: fp32, heads 64 or 128 wide) a rank's own block, every local
sequence causal and the largest share of the work, is one call of RL2's C kernel each way
(`cpu_ops.attention_forward / _backward`; ATen's kernel computes a causal block under ~1000 keys
as a full square), its backward given the ring's final out and lse as ATen's is.

On CUDA with `ring_flash_attn` installed, `ring_attention` calls its
`zigzag_ring_flash_attn_varlen_func` instead (same zig-zag layout). Its signature and layout
were read in ring-flash-attn 0.1.8's source, which tests/test_flash_source.py checks against this
call; the call itself has never run (no GPU here).
"""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Callable

import torch
import torch.distributed as dist

from RL2.parallel.host_comm import as_bytes
from RL2.utils.cpu_ops import attention_backward, attention_forward, attention_takes

logger = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def _ring_flash_varlen():
    """ring-flash-attn's zigzag varlen function, or None when it (or flash_attn) does not import."""
    try:
        _provide_hf_flash_name()
        from ring_flash_attn import zigzag_ring_flash_attn_varlen_func
    except ImportError as e:
        logger.warning("ring_flash_attn does not import (%s): ring attention on GPU runs in pure "
                       "torch (fp32 score blocks: slower, more memory)", e)
        return None
    return zigzag_ring_flash_attn_varlen_func


def _provide_hf_flash_name() -> None:
    """Let ring-flash-attn 0.1.8 import under transformers 5 (see the comment below)."""
    try:
        import transformers.modeling_flash_attention_utils as hf_flash

        if not hasattr(hf_flash, "is_flash_attn_greater_or_equal_2_10"):
            # ring-flash-attn 0.1.8's __init__ imports its HF adapter, which imports this name
            # from here; transformers 5 moved it to transformers.utils (deprecated), so without
            # it the whole package fails to import (its fix, zhuzilin/ring-flash-attention#88,
            # is unreleased)
            from transformers.utils import is_flash_attn_greater_or_equal

            hf_flash.is_flash_attn_greater_or_equal_2_10 = (
                lambda: is_flash_attn_greater_or_equal("2.1.0"))
    except ImportError as e:  # a later transformers: a fixed ring-flash-attn may not need it
        logger.warning("cannot supply transformers' is_flash_attn_greater_or_equal_2_10 (%s)", e)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    max_seqlen: int,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    use_flash: bool | None = None,
    host=None,
    fused: bool = False,
) -> torch.Tensor:
    """Causal attention of zig-zag sharded packed sequences over the ranks of `group`.

    q: (T, Hq, D); k, v: (T, Hkv, D) with Hq a multiple of Hkv (GQA); T = this rank's tokens.
    cu_seqlens: local boundaries (n_seqs + 1,), each local sequence 2c long; max_seqlen: local max.
    use_flash: None = ring-flash-attn when on CUDA with fp16/bf16 and installed; False = pure torch.
    host: a `host_comm.HostGroup` of `group` (CPU, ranks on one host): K/V blocks pass through
    its shared memory instead of gloo P2P.
    fused: a rank's own block (every local sequence, causal) through RL2's C kernel when it
    takes the tensors (`cpu_ops.attention_takes`; actor.cpu_fused_ops marks the modules).
    Returns (T, Hq, D) in q's dtype.
    """
    if group is None:
        group = dist.group.WORLD
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_flash is None:
        from RL2.parallel.attention import flash_supported

        use_flash = flash_supported(q)
    if use_flash:
        fn = _ring_flash_varlen()
        if fn is not None:
            cu = torch.as_tensor(cu_seqlens, dtype=torch.int32, device=q.device)
            return fn(q, k, v, cu, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=True,
                      group=group)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens end at {bounds[-1]} but the shard has {q.shape[0]} tokens")
    if bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0, got {bounds}")
    for s, e in zip(bounds[:-1], bounds[1:]):
        if (e - s) % 2:
            raise ValueError(f"local sequence [{s}, {e}) has odd length: not a zig-zag shard")
    fused = fused and attention_takes(*(x.transpose(0, 1)[None] for x in (q, k, v)))
    return _RingAttention.apply(q, k, v, tuple(int(b) for b in bounds), float(scale), group, host,
                                fused)


class _Ring:
    """Send to the next rank of the group and receive from the previous one."""

    def __init__(self, group: dist.ProcessGroup, host=None):
        self.group, self.host = group, host
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def shift(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start passing `t` on; the returned callable waits and gives the tensor received."""
        if self.size == 1:
            return lambda: t
        t = t.contiguous()
        buf = torch.empty_like(t)
        slots = self.host.publish(t) if self.host is not None else None
        if slots is not None:
            # through shared memory, done before returning. gloo's TCP transfers need its I/O
            # thread, which gets no core while both ranks compute (1 thread each): a 1 MB shift
            # "overlapped" with compute still waited ~2 ms (benchmarks/README.md, fix 17)
            as_bytes(buf).copy_(slots[(self.rank - 1) % self.size])
            self.host.release()
            return lambda: buf
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, buf, group=self.group, group_peer=(self.rank - 1) % self.size),
        ]
        reqs = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for req in reqs:
                req.wait()
            ops.clear()  # the closure kept the send buffer alive until the exchange finished
            return buf

        return wait


def _step_block(rank: int, src: int) -> tuple[tuple[int, int], tuple[int, int], bool]:
    """(query halves, key halves, causal) to compute when K/V of rank `src` visit `rank`: one
    block per sequence and ring step. Half 0/1 is the first/second local chunk, (lo, hi) a range
    of halves. Rank r holds chunks r and 2sp-1-r, so:
    - src == rank: the local 2c tokens are in global order: plain causal attention over them;
    - src < rank: chunk src precedes both local chunks and chunk 2sp-1-src follows both: every
      query sees key half 0 whole;
    - src > rank: only query half 1 (chunk 2sp-1-r, later than both) sees keys, all of them.
    """
    if src == rank:
        return (0, 2), (0, 2), True
    if src < rank:
        return (0, 2), (0, 1), False
    return (1, 2), (0, 2), False


def _halves(bounds: tuple[int, ...]):
    """(start, chunk length) of every non-empty local sequence."""
    return [(s, (e - s) // 2) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def _heads_first(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(L, H, D) -> (H * groups, L, D), repeating each K/V head for its query-head group."""
    x = x.transpose(0, 1)
    return x.repeat_interleave(groups, dim=0) if groups > 1 else x


def _scores(qh, kh, scale, causal):
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale  # (H, Lq, Lk)
    if causal:  # diagonal block: same chunk, equal lengths, plain lower triangle
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


# On the CPU a block goes through ATen's flash-attention kernel, which returns the block's
# log-sum-exp, takes grouped K/V heads as they are and, given the FINAL output and log-sum-exp,
# computes a block's exact share of dQ/dK/dV (ring-flash-attn does the same on GPUs). Against
# the matmul version below: no (H, c, c) score matrix and ~4x fewer ops per block. Other devices
# (a CUDA run without ring-flash-attn) keep the matmul version.
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# Before torch 2.9 the CPU kernel indexed K/V with the query head (no GQA; pytorch #157893):
# with fewer K/V heads it read the wrong heads and wrote past dK/dV.
_FLASH_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _flash(q, k) -> bool:
    return q.device.type == "cpu" and (_FLASH_GQA or q.shape[1] == k.shape[1])


def _block_forward(q, k, v, scale, causal):
    """q (c, H, D), k/v (c, Hkv, D) -> out (c, H, D), lse (H, c) of softmax(q k^T * scale)."""
    return (_flash_block_forward if _flash(q, k) else _matmul_block_forward)(
        q, k, v, scale, causal)


def _block_backward(dout, q, k, v, out, lse, scale, causal):
    """This block's share of (dq, dk, dv), given the final out (c, H, D) and lse (H, c)."""
    return (_flash_block_backward if _flash(q, k) else _matmul_block_backward)(
        dout, q, k, v, out, lse, scale, causal)


def _flash_block_forward(q, k, v, scale, causal):
    out, lse = _FLASH_CPU(*(x.transpose(0, 1)[None] for x in (q, k, v)), 0.0, causal, scale=scale)
    return out[0].transpose(0, 1), lse[0]


def _flash_block_backward(dout, q, k, v, out, lse, scale, causal):
    heads = [x.transpose(0, 1)[None] for x in (dout, q, k, v, out)]
    grads = _FLASH_CPU_BWD(*heads, lse.contiguous()[None], 0.0, causal, scale=scale)
    return [g[0].transpose(0, 1) for g in grads]


def _matmul_block_forward(q, k, v, scale, causal):
    groups = q.shape[1] // k.shape[1]
    s = _scores(_heads_first(q, 1), _heads_first(k, groups), scale, causal)
    lse = torch.logsumexp(s, dim=-1)  # (H, c)
    out = torch.matmul(torch.exp(s - lse[..., None]), _heads_first(v, groups))
    return out.transpose(0, 1), lse


def _matmul_block_backward(dout, q, k, v, out, lse, scale, causal):
    hkv, c = k.shape[1], k.shape[0]
    groups = q.shape[1] // hkv
    qh, kh, vh = _heads_first(q, 1), _heads_first(k, groups), _heads_first(v, groups)
    doh = dout.transpose(0, 1)
    delta = (dout * out).sum(-1).T  # (H, c): rowsum(dO * O) of the softmax backward
    # probabilities of this block under the final (global) normaliser
    p = torch.exp(_scores(qh, kh, scale, causal) - lse[..., None])
    ds = p * (torch.matmul(doh, vh.transpose(1, 2)) - delta[..., None])
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(1, 2), qh) * scale  # (H, c, D)
    dv = torch.matmul(p.transpose(1, 2), doh)
    # sum the query heads of each GQA group back onto their K/V head
    dk, dv = (x.view(hkv, groups, c, -1).sum(1) for x in (dk, dv))
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def _heads(q, kv):
    """(T, H, D) q and the stacked (2, T, KH, D) K/V as the kernel's (heads, T, D) views."""
    return q.transpose(0, 1), kv[0].transpose(0, 1), kv[1].transpose(0, 1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, group, host, fused):
        ring = _Ring(group, host)
        sp, rank = ring.size, ring.rank
        cdt = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in >= fp32
        q32 = q.to(cdt)
        T, H, _ = q.shape
        if not fused:  # else the kernel's own block makes them
            out = torch.zeros(q.shape, dtype=cdt, device=q.device)
            lse = torch.full((H, T), float("-inf"), dtype=cdt, device=q.device)
        halves = _halves(bounds)
        kv = torch.stack([k, v]).to(cdt)
        for step in range(sp):
            pending = ring.shift(kv) if step < sp - 1 else None  # overlap comm with compute
            (q_lo, q_hi), (k_lo, k_hi), causal = _step_block(rank, (rank - step) % sp)
            if step == 0 and fused:  # the own block: every local sequence, causal, one call
                out, lse = attention_forward(*_heads(q32, kv), list(bounds), scale)
            for start, c in (() if step == 0 and fused else halves):
                qs = slice(start + q_lo * c, start + q_hi * c)
                ks = slice(start + k_lo * c, start + k_hi * c)
                blk_out, blk_lse = _block_forward(q32[qs], kv[0, ks], kv[1, ks], scale, causal)
                if step == 0:  # the first block covers every query (the causal one)
                    out[qs], lse[:, qs] = blk_out, blk_lse
                    continue
                # log-sum-exp merge of the running result with this block
                new_lse = torch.logaddexp(lse[:, qs], blk_lse)
                w_old = torch.exp(lse[:, qs] - new_lse).T[..., None]
                w_blk = torch.exp(blk_lse - new_lse).T[..., None]
                out[qs] = out[qs] * w_old + blk_out * w_blk
                lse[:, qs] = new_lse
            if pending is not None:
                kv = pending()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.scale, ctx.group, ctx.host, ctx.fused = bounds, scale, group, host, fused
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale = ctx.scale
        ring = _Ring(ctx.group, ctx.host)
        sp, rank = ring.size, ring.rank
        cdt = out.dtype
        dout, q32 = dout.to(cdt), q.to(cdt)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        halves = _halves(ctx.bounds)
        kv = torch.stack([k, v]).to(cdt)
        incoming = None  # pending receipt of the dK/dV summed so far for the block held next
        for step in range(sp):
            pending = ring.shift(kv) if step < sp - 1 else None
            (q_lo, q_hi), (k_lo, k_hi), causal = _step_block(rank, (rank - step) % sp)
            dkv = torch.zeros((2, *k.shape), dtype=cdt, device=k.device)  # this rank's share
            if step == 0 and ctx.fused:
                dq_b, dk_b, dv_b = attention_backward(dout, *_heads(q32, kv), out, lse,
                                                      list(ctx.bounds), scale)
                dq += dq_b
                dkv[0] += dk_b
                dkv[1] += dv_b
            for start, c in (() if step == 0 and ctx.fused else halves):
                qs = slice(start + q_lo * c, start + q_hi * c)
                ks = slice(start + k_lo * c, start + k_hi * c)
                dq_b, dk_b, dv_b = _block_backward(dout[qs], q32[qs], kv[0, ks], kv[1, ks],
                                                   out[qs], lse[:, qs], scale, causal)
                dq[qs] += dq_b
                dkv[0, ks] += dk_b
                dkv[1, ks] += dv_b
            if pending is not None:
                kv = pending()
            # the block's dK/dV travels with it: add what the ranks that held it before sent
            # (received while this step computed) and pass the sum on; after the last step it
            # goes back to the block's owner, and this rank receives its own block's total
            if incoming is not None:
                dkv += incoming()
            incoming = ring.shift(dkv)
        dkv = incoming()
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None)
