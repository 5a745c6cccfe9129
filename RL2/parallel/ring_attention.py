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
at exit after P2P otherwise). Per block it materialises a (heads, c, c) score matrix: this path is
for CPU and tests; GPUs should use ring-flash-attn.

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

logger = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def _ring_flash_varlen():
    """ring-flash-attn's zigzag varlen function, or None when it (or flash_attn) is missing."""
    try:
        from ring_flash_attn import zigzag_ring_flash_attn_varlen_func
    except ImportError:
        logger.warning("ring_flash_attn is not installed: ring attention on GPU runs in pure torch")
        return None
    return zigzag_ring_flash_attn_varlen_func


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    max_seqlen: int,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    use_flash: bool | None = None,
) -> torch.Tensor:
    """Causal attention of zig-zag sharded packed sequences over the ranks of `group`.

    q: (T, Hq, D); k, v: (T, Hkv, D) with Hq a multiple of Hkv (GQA); T = this rank's tokens.
    cu_seqlens: local boundaries (n_seqs + 1,), each local sequence 2c long; max_seqlen: local max.
    use_flash: None = ring-flash-attn when on CUDA with fp16/bf16 and installed; False = pure torch.
    Returns (T, Hq, D) in q's dtype.
    """
    if group is None:
        group = dist.group.WORLD
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_flash is None:
        use_flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if use_flash:
        fn = _ring_flash_varlen()
        if fn is not None:
            cu = torch.as_tensor(cu_seqlens, dtype=torch.int32, device=q.device)
            return fn(q, k, v, cu, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=True,
                      group=group)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens end at {bounds[-1]} but the shard has {q.shape[0]} tokens")
    for s, e in zip(bounds[:-1], bounds[1:]):
        if (e - s) % 2:
            raise ValueError(f"local sequence [{s}, {e}) has odd length: not a zig-zag shard")
    return _RingAttention.apply(q, k, v, tuple(int(b) for b in bounds), float(scale), group)


class _Ring:
    """Send to the next rank of the group and receive from the previous one."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def shift(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start passing `t` on; the returned callable waits and gives the tensor received."""
        if self.size == 1:
            return lambda: t
        t = t.contiguous()
        buf = torch.empty_like(t)
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


def _block_pairs(rank: int, src: int, sp: int) -> list[tuple[int, int, bool]]:
    """(query half, key half, causal) pairs to compute when K/V of rank `src` visit `rank`.

    Half 0/1 is the first/second local chunk; its global chunk index decides the block type.
    """
    q_chunks, k_chunks = (rank, 2 * sp - 1 - rank), (src, 2 * sp - 1 - src)
    pairs = []
    for qh, qc in enumerate(q_chunks):
        for kh, kc in enumerate(k_chunks):
            if kc <= qc:
                pairs.append((qh, kh, kc == qc))
    return pairs


def _halves(bounds: tuple[int, ...]):
    """(start, chunk length) of every non-empty local sequence."""
    return [(s, (e - s) // 2) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def _heads_first(x: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(L, H, D) -> (H * groups, L, D), repeating each K/V head for its query-head group."""
    x = x.to(dtype).transpose(0, 1)
    return x.repeat_interleave(groups, dim=0) if groups > 1 else x


def _scores(qh, kh, scale, causal):
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale  # (H, Lq, Lk)
    if causal:  # diagonal block: same chunk, equal lengths, plain lower triangle
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, group):
        ring = _Ring(group)
        sp, rank = ring.size, ring.rank
        groups = q.shape[1] // k.shape[1]
        cdt = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in >= fp32
        T, H, _ = q.shape
        out = torch.zeros(q.shape, dtype=cdt, device=q.device)
        lse = torch.full((H, T), float("-inf"), dtype=cdt, device=q.device)
        halves = _halves(bounds)
        kv = torch.stack([k, v])
        for step in range(sp):
            pending = ring.shift(kv) if step < sp - 1 else None  # overlap comm with compute
            for qh_idx, kh_idx, causal in _block_pairs(rank, (rank - step) % sp, sp):
                for start, c in halves:
                    qs = slice(start + qh_idx * c, start + (qh_idx + 1) * c)
                    ks = slice(start + kh_idx * c, start + (kh_idx + 1) * c)
                    qh = _heads_first(q[qs], 1, cdt)
                    s = _scores(qh, _heads_first(kv[0, ks], groups, cdt), scale, causal)
                    blk_lse = torch.logsumexp(s, dim=-1)  # (H, c)
                    blk_out = torch.matmul(torch.exp(s - blk_lse[..., None]),
                                           _heads_first(kv[1, ks], groups, cdt))
                    # log-sum-exp merge of the running result with this block
                    new_lse = torch.logaddexp(lse[:, qs], blk_lse)
                    w_old = torch.exp(lse[:, qs] - new_lse).T[..., None]
                    w_blk = torch.exp(blk_lse - new_lse).T[..., None]
                    out[qs] = out[qs] * w_old + blk_out.transpose(0, 1) * w_blk
                    lse[:, qs] = new_lse
            if pending is not None:
                kv = pending()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.scale, ctx.group = bounds, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale = ctx.scale
        ring = _Ring(ctx.group)
        sp, rank = ring.size, ring.rank
        hkv = k.shape[1]
        groups = q.shape[1] // hkv
        cdt = out.dtype
        dout = dout.to(cdt)
        delta = (dout * out).sum(-1).T  # (H, T): rowsum(dO * O) of the softmax backward
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=cdt, device=k.device)  # travels with its K/V block
        halves = _halves(ctx.bounds)
        kv = torch.stack([k, v])
        for step in range(sp):
            pending = ring.shift(kv) if step < sp - 1 else None
            for qh_idx, kh_idx, causal in _block_pairs(rank, (rank - step) % sp, sp):
                for start, c in halves:
                    qs = slice(start + qh_idx * c, start + (qh_idx + 1) * c)
                    ks = slice(start + kh_idx * c, start + (kh_idx + 1) * c)
                    qh = _heads_first(q[qs], 1, cdt)
                    kh = _heads_first(kv[0, ks], groups, cdt)
                    vh = _heads_first(kv[1, ks], groups, cdt)
                    doh = dout[qs].transpose(0, 1)
                    # probabilities of this block under the final (global) normaliser
                    p = torch.exp(_scores(qh, kh, scale, causal) - lse[:, qs, None])
                    ds = p * (torch.matmul(doh, vh.transpose(1, 2)) - delta[:, qs, None])
                    dq[qs] += (torch.matmul(ds, kh) * scale).transpose(0, 1)
                    dk = torch.matmul(ds.transpose(1, 2), qh) * scale  # (H, c, D)
                    dv = torch.matmul(p.transpose(1, 2), doh)
                    # sum the query heads of each GQA group back onto their K/V head
                    dkv[0, ks] += dk.view(hkv, groups, c, -1).sum(1).transpose(0, 1)
                    dkv[1, ks] += dv.view(hkv, groups, c, -1).sum(1).transpose(0, 1)
            if pending is not None:
                kv = pending()
            # hand the accumulator to the rank that holds this K/V block next; after sp hops it
            # is back at the block's owner with every rank's contribution
            dkv = ring.shift(dkv)()
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None)
