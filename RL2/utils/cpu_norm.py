"""Training RMSNorms on the CPU through RL2's C kernel (RL2/utils/small_gemm.c).

Why: HF's RMSNorm module is ~6 PyTorch ops forward and, through autograd, ~12 backward, most of
them a pass over the rows; on the 25.7M benchmark model (1020 tokens, 2 threads) one norm took
0.45 ms forward and 4.5 ms backward, ~8% of an SFT step over its 17 norms. `rms_norm` is one
pass forward and two backward (`rl2_rms_norm_fwd` / `_bwd`), within fp32 rounding of the module
(its mean sums in another order). fp32 CPU tensors only: anything else (bf16, fp64, DTensor
activations of tensor / sequence parallelism, CUDA) runs the module's own forward.
"""
from __future__ import annotations

import types

import torch

from RL2.utils import small_gemm

# RMSNorm classes of the Llama family: y = weight * (x * rsqrt(mean(x^2) + variance_epsilon)).
# Each class is also checked against its own forward once before any of its modules switch.
CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2MoeRMSNorm",
           "Qwen3MoeRMSNorm")


def _plain(t: torch.Tensor) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32
            and t.device.type == "cpu")


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_plain(x) and _plain(weight) and weight.dim() == 1 and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and x.numel() > 0 and small_gemm.available())


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        lib = small_gemm.load()[0]
        k = x.shape[-1]
        rows = x.detach().contiguous().view(-1, k)
        y, rstd = torch.empty_like(rows), rows.new_empty(rows.shape[0])
        w = weight.detach().contiguous()
        lib.rl2_rms_norm_fwd(rows.data_ptr(), rows.shape[0], k, w.data_ptr(), float(eps), y.data_ptr(),
                             rstd.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(rows, w, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, w, rstd = ctx.saved_tensors
        lib = small_gemm.load()[0]
        m, k = rows.shape
        g = grad.contiguous().view(m, k)
        threads = torch.get_num_threads()
        dx = torch.empty_like(rows)
        dw = part = None
        if ctx.needs_input_grad[1]:
            dw, part = w.new_empty(k), w.new_zeros(threads * k)
        lib.rl2_rms_norm_bwd(rows.data_ptr(), g.data_ptr(), w.data_ptr(), rstd.data_ptr(), m, k,
                             dx.data_ptr(), None if dw is None else dw.data_ptr(),
                             None if part is None else part.data_ptr(), threads)
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) through the kernel (`eligible` tensors only)."""
    return RMSNormFunction.apply(x, weight, eps)


def _forward(self, x):
    if eligible(x, self.weight):
        return rms_norm(x, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def _agrees(cls, module) -> bool:
    """The class's own forward and `rms_norm` agree on a random input (values and gradients)."""
    g = torch.Generator().manual_seed(0)
    k = module.weight.shape[0]
    probe = cls.__new__(cls)
    torch.nn.Module.__init__(probe)
    probe.weight = torch.nn.Parameter(torch.rand(k, generator=g) + 0.5)
    probe.variance_epsilon = module.variance_epsilon
    x = torch.randn(3, k, generator=g) * 3
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ws = [probe.weight, torch.nn.Parameter(probe.weight.detach().clone())]
    outs = [cls.forward(probe, xs[0]), rms_norm(xs[1], ws[1], module.variance_epsilon)]
    grad = torch.randn(3, k, generator=g)
    for out in outs:
        out.backward(grad)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    return (close(outs[0], outs[1]) and close(xs[0].grad, xs[1].grad)
            and close(ws[0].grad, ws[1].grad))


def use_for_norms(model: torch.nn.Module) -> int:
    """Route the Llama-family RMSNorms of `model` through `rms_norm` (instance forward; FSDP2's
    hooks still run around it), each class after a check against its own forward. Returns how
    many modules were switched."""
    if not small_gemm.available():
        return 0
    n, verdict = 0, {}
    for module in model.modules():
        cls = type(module)
        if cls.__name__ not in CLASSES or not hasattr(module, "variance_epsilon"):
            continue
        if cls not in verdict:
            verdict[cls] = _agrees(cls, module)
        if verdict[cls]:
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n
