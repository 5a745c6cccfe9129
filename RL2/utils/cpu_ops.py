"""Training RMSNorms and SiLU(gate) * up on the CPU through RL2's C kernel (small_gemm.c).

Why: HF's RMSNorm module is ~6 PyTorch ops forward and, through autograd, ~12 backward, most of
them a pass over the rows; on the 25.7M benchmark model (1020 tokens, 2 threads) one norm took
0.45 ms forward and 4.5 ms backward, ~8% of an SFT step over its 17 norms. The MLP's
SiLU(gate) * up is likewise 2 ops forward and 4 backward over the widest activations (~5%).
Here each is one pass forward and one (the MLP) or two (the norm) backward, within fp32
rounding of HF's modules (the norm's mean sums in another order; exp is the kernel's).
fp32 CPU tensors only: anything else (bf16, fp64, DTensor activations of tensor or sequence
parallelism, CUDA) runs the module's own forward. `use_for_model` switches a model's modules,
each class after a check against its own forward.
"""
from __future__ import annotations

import types

import torch

from RL2.utils import small_gemm

# Llama-family classes. RMSNorm: weight * (x * rsqrt(mean(x^2) + variance_epsilon)); MLP:
# down_proj(act_fn(gate_proj(x)) * up_proj(x)) with act_fn SiLU.
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2MoeRMSNorm",
         "Qwen3MoeRMSNorm")
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


def _plain(*tensors: torch.Tensor) -> bool:
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32
               and t.device.type == "cpu" for t in tensors)


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
    @torch.autograd.function.once_differentiable  # C: no graph of its own to differentiate
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


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        lib = small_gemm.load()[0]
        g, u = gate.detach().contiguous(), up.detach().contiguous()
        h = torch.empty_like(g)
        lib.rl2_glu_fwd(g.data_ptr(), u.data_ptr(), g.numel(), h.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(g, u)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        lib = small_gemm.load()[0]
        dh = grad.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        lib.rl2_glu_bwd(g.data_ptr(), u.data_ptr(), dh.data_ptr(), g.numel(), dg.data_ptr(),
                        du.data_ptr(), torch.get_num_threads())
        return dg, du


def norm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_plain(x, weight) and weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0]
            and x.numel() > 0 and small_gemm.available())


def glu_takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return _plain(gate, up) and gate.shape == up.shape and gate.numel() > 0 and small_gemm.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) through the kernel (`norm_takes` tensors)."""
    if not norm_takes(x, weight):
        raise ValueError(f"rms_norm: fp32 CPU tensors, x [..., K] and weight [K], and the kernel "
                         f"(got {x.dtype} {tuple(x.shape)}, {weight.dtype} {tuple(weight.shape)})")
    return RMSNormFunction.apply(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up through the kernel (`glu_takes` tensors: fp32 CPU, one shape)."""
    if not glu_takes(gate, up):
        raise ValueError(f"silu_mul: fp32 CPU tensors of one shape, and the kernel (got "
                         f"{gate.dtype} {tuple(gate.shape)}, {up.dtype} {tuple(up.shape)})")
    return GLUFunction.apply(gate, up)


def _norm_forward(self, x):
    if norm_takes(x, self.weight):
        return rms_norm(x, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def _mlp_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    if glu_takes(gate, up):
        return self.down_proj(silu_mul(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _agrees(eager, fused, inputs: list[torch.Tensor], params: list[torch.nn.Parameter]) -> bool:
    """eager(*inputs) and fused(*inputs) agree in value and in the gradients of the inputs and
    of `params` (fused runs on copies of the inputs; params' grads are compared per call)."""
    grads, outs = [], []
    for fn in (eager, fused):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        for p in params:
            p.grad = None
        out = fn(*xs)
        out.backward(torch.ones_like(out) + out.detach())
        outs.append(out.detach())
        grads.append([x.grad for x in xs] + [p.grad.clone() for p in params])
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    return close(*outs) and all(close(a, b) for a, b in zip(*grads))


def _norm_agrees(module) -> bool:
    cls, k = type(module), module.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    probe = cls.__new__(cls)
    torch.nn.Module.__init__(probe)
    probe.weight = torch.nn.Parameter(torch.rand(k, generator=g) + 0.5)
    probe.variance_epsilon = module.variance_epsilon
    x = torch.randn(3, k, generator=g) * 3
    return _agrees(lambda t: cls.forward(probe, t),
                   lambda t: rms_norm(t, probe.weight, probe.variance_epsilon), [x], [probe.weight])


def _mlp_agrees(module) -> bool:
    """SiLU(g) * u of the module's own act_fn against the kernel's, on values past exp's
    clamps; the module's class forward is then checked to be down(act(gate) * up)."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(4, 40, generator=g) * 6, torch.randn(4, 40, generator=g)
    if not _agrees(lambda a, b: module.act_fn(a) * b, silu_mul, [gate, up], []):
        return False
    cls, probe = type(module), torch.nn.Module()
    probe.gate_proj, probe.up_proj = torch.nn.Linear(8, 6), torch.nn.Linear(8, 6)
    probe.down_proj, probe.act_fn = torch.nn.Linear(6, 8), torch.nn.SiLU()
    x = torch.randn(5, 8, generator=g)
    params = list(probe.parameters())
    return _agrees(lambda t: cls.forward(probe, t), lambda t: _mlp_forward(probe, t), [x], params)


def use_for_model(model: torch.nn.Module) -> tuple[int, int]:
    """Route the Llama-family RMSNorms and MLPs of `model` through `rms_norm` and `silu_mul`
    (instance forward; FSDP2's and PEFT's hooks still run around it), each class (MLPs: each
    activation) after a check against its own forward. Returns (norms, MLPs) switched."""
    if not small_gemm.available():
        return 0, 0
    counts, verdict = [0, 0], {}
    for module in model.modules():
        name = type(module).__name__
        if name in NORMS and hasattr(module, "variance_epsilon"):
            kind, key, check, forward = 0, type(module), _norm_agrees, _norm_forward
        elif name in MLPS and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj",
                                                                   "act_fn")):
            kind, key, check, forward = 1, (type(module), type(module.act_fn)), _mlp_agrees, _mlp_forward
        else:
            continue
        if key not in verdict:
            # the probes' nn.Linear draw from the global generator: a seeded run's later
            # draws (dropout, LoRA init) must not depend on this option or the CPU
            with torch.random.fork_rng(devices=[]):
                try:
                    verdict[key] = check(module)
                except (AttributeError, TypeError, RuntimeError):  # a forward of another shape
                    verdict[key] = False
        if verdict[key]:
            module.forward = types.MethodType(forward, module)
            counts[kind] += 1
    return counts[0], counts[1]
