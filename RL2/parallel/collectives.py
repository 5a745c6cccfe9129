"""Autograd-aware helpers for per-sequence quantities under sequence parallelism.

With sp > 1 every sequence is split (zig-zag) over the sp group, so a per-sequence quantity (the
summed log-prob of a DPO response, the value at the last token of a reward-model input) is a SUM
of partial results held by different sp ranks. `segment_sum` computes this rank's partial per
sequence; `all_reduce_sum` adds the partials over the group and, in backward, all-reduces the
gradient, so every rank's partial receives the full gradient of a loss that every rank computed.
"""
import torch
import torch.distributed as dist
from torch import Tensor


def segment_sum(x: Tensor, cu_seqlens: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Per-sequence sums of a packed 1-D tensor: out[j] = x[cu[j]:cu[j+1]].sum() (differentiable).

    `dtype` (e.g. float64) accumulates in higher precision than `x`.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(x.device)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
    if seg.numel() != x.numel():
        raise ValueError(f"cu_seqlens cover {seg.numel()} tokens but x has {x.numel()}")
    x = x if dtype is None else x.to(dtype)
    return torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add(0, seg, x)


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over the group. Backward: sum of the gradients over the group.

    The backward is right when every rank goes on to compute the same loss from the reduced
    value (d total / d partial_r = sum over ranks of d loss_k / d reduced); callers that want one
    copy of that loss scale it by 1 / group size.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.detach().clone().contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """Differentiable sum of `x` over `group`; identity when the group is None or of size 1."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def sequence_sums(x: Tensor, cu_seqlens: Tensor, sp_group=None,
                  dtype: torch.dtype | None = None) -> Tensor:
    """Whole-sequence sums of a per-token tensor of one packed micro-batch, identical on every
    rank of the sp group (one entry per packed sequence, in micro-batch order)."""
    return all_reduce_sum(segment_sum(x, cu_seqlens, dtype), sp_group)
