"""Collective helpers: tensors on the device a group's backend serves, and autograd-aware
per-sequence sums under sequence parallelism, and the gradient norm (and clipping) over any mix of
meshes.

Device rule: NCCL serves only CUDA tensors ("No backend type associated with device type cpu"),
gloo only CPU ones. Every tensor RL2 hands to a collective goes through `group_device` (metrics,
grad norms, flags) or comes from the model's forward on the compute device.

With sp > 1 every sequence is split (zig-zag) over the sp group, so a per-sequence quantity (the
summed log-prob of a DPO response, the value at the last token of a reward-model input) is a SUM
of partial results held by different sp ranks. `segment_sum` computes this rank's partial per
sequence; `all_reduce_sum` adds the partials over the group and, in backward, all-reduces the
gradient, so every rank's partial receives the full gradient of a loss that every rank computed.
"""
import copyreg
import io
import math
import pickle

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate


def group_device(group=None) -> torch.device:
    """The device whose tensors `group`'s backend reduces: CUDA for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(tensor: Tensor, group=None) -> Tensor:
    """`tensor`, after checking that `group`'s backend serves its device (a clear error instead
    of NCCL's)."""
    want = group_device(group)
    if tensor.device.type != want.type:
        raise RuntimeError(f"collective on a {tensor.device.type} tensor, but the group's backend "
                           f"({dist.get_backend(group)}) serves {want.type} tensors")
    return tensor


def all_reduce_floats(values: list[float], op=dist.ReduceOp.SUM, group=None) -> list[float]:
    """All-reduce Python floats (float64) on the device the group's backend serves."""
    t = torch.tensor(values, dtype=torch.float64, device=group_device(group))
    dist.all_reduce(check_device(t, group), op=op, group=group)
    return t.tolist()


def gather_objects(obj, group=None) -> list:
    """`dist.all_gather_object` (every rank's `obj`, in rank order), without a collective on a
    one-rank group. Why skip it: a gloo collective on a tensor of more than 32K elements copies
    it on gloo's worker thread with OpenMP, which creates a second OpenMP team; libgomp then
    has more threads than cores and cuts its spin-wait for the rest of the process, so every
    later multi-threaded op waits on a futex (the engine's decode measured 20-25% slower with
    2 threads, benchmarks/README.md)."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, _dumps(obj), group=group)  # a bytes object pickles as such
    return [pickle.loads(b) for b in out]


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return flat.reshape(shape)


def _reduce_tensor(t: Tensor):
    """A plain CPU tensor (exactly `Tensor`: the dispatch table matches the type) pickled as its
    bytes, dtype and shape, received contiguous: PyTorch's own reduction goes through torch.save
    (~0.1 ms a tensor each way), 40 ms of the trajectory gather of a 2-process GRPO step of
    16 x 5 small tensors (benchmarks/README.md, fix 39). Anything else (autograd, complex,
    quantized, negative-bit, nested, Python attributes): PyTorch's reduction."""
    if (t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
            and not (t.is_quantized or t.is_complex() or t.is_neg() or t.is_nested or t.__dict__)):
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return _tensor_from_bytes, (data, t.dtype, tuple(t.shape))
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _dumps(obj) -> bytes:
    f = io.BytesIO()
    pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, Tensor: _reduce_tensor}
    pickler.dump(obj)
    return f.getvalue()


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


@torch.no_grad()
def grad_norm_and_clip(params, max_norm: float | None) -> float:
    """Total L2 norm of the gradients of `params` (`grad_norm`), then clip: if max_norm > 0 and
    the norm is finite, scale every gradient by `clip_coefficient`. A non-finite norm leaves
    gradients untouched; callers should skip the optimizer step."""
    norm = grad_norm(params)
    coef = clip_coefficient(norm, max_norm)
    if coef is not None:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def clip_coefficient(norm: float, max_norm: float | None) -> float | None:
    """max_norm / norm where clipping by the global norm scales the gradients (a finite norm
    over max_norm > 0), else None."""
    if max_norm is None or max_norm <= 0 or not math.isfinite(norm):
        return None
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else None


@torch.no_grad()
def grad_norm(params) -> float:
    """Total L2 norm of the gradients of `params` (any mix of meshes / placements):
    1. per gradient, the squared L2 norm of the local shard (Partial grads are first reduced);
    2. sum these per set of process groups the gradient is sharded over (replicated mesh dims
       hold copies and are not reduced; plain tensors are treated as replicated);
    3. all-reduce each sum over its groups, add up: every rank gets the same total.
    """
    grads = [p.grad for p in params if p.grad is not None]
    buckets: dict[tuple, torch.Tensor] = {}
    for g in grads:
        groups = ()
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                               for pl in g.placements])
            mesh = g.device_mesh
            # Any non-Replicate dim is sharded (FSDP x TP uses _StridedShard, not a Shard).
            groups = tuple(mesh.get_group(d) for d, pl in enumerate(g.placements)
                           if not pl.is_replicate() and mesh.size(d) > 1)
            g = g.to_local()
        # a dot product reads the gradient once; pow(2).sum() wrote a squared copy first (25.7M
        # fp32 gradients: 7.1 -> 2.6 ms with 2 threads, 46 -> 7.7 ms with 1; benchmarks/README fix 50)
        flat = g.reshape(-1).to(torch.promote_types(g.dtype, torch.float32))
        sq = torch.dot(flat, flat).to(torch.float64)
        # Insertion order is the parameter order, the same on every rank: collectives line up.
        buckets[groups] = buckets.get(groups, 0) + sq
    total = 0.0
    for groups, sq in buckets.items():
        for group in groups:
            # grads may live on the CPU (offload_params) while NCCL serves CUDA only
            sq = sq.to(group_device(group))
            dist.all_reduce(check_device(sq, group), group=group)
        total += sq.item()
    return math.sqrt(total)
