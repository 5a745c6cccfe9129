"""Training RMSNorms, SiLU(gate) * up, packed causal attention and the rotary embedding on the
CPU through RL2's C kernel (small_gemm.c).

Why: HF's RMSNorm module is ~6 PyTorch ops forward and, through autograd, ~12 backward, most of
them a pass over the rows; on the 25.7M benchmark model (1020 tokens, 2 threads) one norm took
0.45 ms forward and 4.5 ms backward, ~8% of an SFT step over its 17 norms. The MLP's
SiLU(gate) * up is likewise 2 ops forward and 4 backward over the widest activations (~5%).
Here each is one pass forward and one (the MLP) or two (the norm) backward, within fp32
rounding of HF's modules (the norm's mean sums in another order; exp is the kernel's).
Attention: ATen's CPU flash-attention kernel splits keys in blocks of 512, so causal sequences
under ~1000 tokens cost it a full square, forward and backward (~14% of that SFT step); the
kernel's blocked causal attention skips the upper triangle (fix 31 in benchmarks/README.md).
The rotary embedding is 5 ops forward and 5 backward per layer in HF (~3% of that step); here one
pass each, with HF's arithmetic (the same bits).
fp32 CPU tensors only: anything else (bf16, fp64, DTensor activations of tensor or sequence
parallelism, CUDA) runs the module's own forward or SDPA. `use_for_model` switches a model's
norms and MLPs, each class after a check against its own forward; `use_attention` marks its
attention modules for RL2's packed attention after a check against SDPA; `use_rope` replaces the
model family's apply_rotary_pos_emb after a check against it.
"""
from __future__ import annotations

import types
from functools import lru_cache

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


# ----- attention -----
def _attention_items(bounds: list[int], kbounds: list[int], heads: int) -> torch.Tensor:
    """The kernel's work items (query head, sequence), the most work (query x key pairs)
    first: the dynamic schedule then ends on small items, whichever thread takes them."""
    n = len(bounds) - 1
    work = [(bounds[s + 1] - bounds[s]) * (2 * (kbounds[s + 1] - kbounds[s]) - bounds[s + 1] + bounds[s])
            for s in range(n)]
    order = sorted(range(n), key=lambda s: -work[s])
    return torch.tensor([h * n + s for s in order for h in range(heads)], dtype=torch.int64)


def _panel_floats(kbounds: list[int], d: int) -> int:
    """Floats of one sequence's packed keys: the most keys, rounded up to the kernel's 32-key panels."""
    longest = max(b - a for a, b in zip(kbounds, kbounds[1:]))
    return -(-longest // 32) * 32 * d


def _schedule(bounds: list[int], kbounds: list[int] | None, heads: int, d: int):
    """(bounds, key bounds as int64 tensors, work items, scratch floats per thread) of one call."""
    kbounds = bounds if kbounds is None else kbounds
    return (torch.tensor(bounds, dtype=torch.int64), torch.tensor(kbounds, dtype=torch.int64),
            _attention_items(bounds, kbounds, heads), _panel_floats(kbounds, d))


def _kernel_views(q3, k3, v3):
    """(heads, T, D) views as the kernel reads them: D contiguous, k and v one set of strides."""
    q3 = q3 if q3.stride(-1) == 1 else q3.contiguous()
    if k3.stride(-1) != 1 or k3.stride() != v3.stride():
        k3, v3 = k3.contiguous(), v3.contiguous()
    return q3, k3, v3


def attention_forward(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, bounds: list[int],
                      scale: float, kbounds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's causal attention inside each [start, end) of `bounds` (0 to T): q3 (H, T, D),
    k3 and v3 (KH, TK, D) views with D contiguous -> out (T, H, D) and its log-sum-exp (H, T).
    `kbounds` (0 to TK; default `bounds`): each sequence's keys, at least as many as its queries;
    with more, the causal mask is aligned to the bottom right (a shared prompt's gathered keys)."""
    lib = small_gemm.load()[0]
    q3, k3, v3 = _kernel_views(q3, k3, v3)
    (heads, T, D), kv_heads = q3.shape, k3.shape[0]
    b, kb, items, cap = _schedule(bounds, kbounds, heads, D)
    out, lse = q3.new_empty(T, heads, D), q3.new_empty(heads, T)
    # no more threads than work items: each thread gets scratch for the longest sequence
    threads = min(torch.get_num_threads(), items.numel())
    scratch = q3.new_empty(threads * cap)
    lib.rl2_attn_fwd(q3.data_ptr(), q3.stride(0), q3.stride(1), k3.data_ptr(), v3.data_ptr(),
                     k3.stride(0), k3.stride(1), heads, kv_heads, D, T, b.data_ptr(), kb.data_ptr(),
                     items.data_ptr(), items.numel(), float(scale), scratch.data_ptr(), cap,
                     out.data_ptr(), lse.data_ptr(), threads)
    return out, lse


def attention_backward(dout: torch.Tensor, q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, bounds: list[int], scale: float,
                       kbounds: list[int] | None = None):
    """dq (T, H, D), dk and dv (TK, KH, D) of `attention_forward`'s inputs for dout (T, H, D),
    given the out and lse the softmax is normalised with: its own, or a ring's final ones (then
    these are this block's shares, as in flash-attention's backward)."""
    lib = small_gemm.load()[0]
    q3, k3, v3 = _kernel_views(q3, k3, v3)
    (heads, T, D), (kv_heads, TK) = q3.shape, k3.shape[:2]
    b, kb, items, cap = _schedule(bounds, kbounds, heads, D)
    groups, threads = heads // kv_heads, min(torch.get_num_threads(), items.numel())
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    dq = q3.new_empty(T, heads, D)
    dk_part, dv_part = (q3.new_empty(groups, TK, kv_heads, D) for _ in range(2))
    scratch = q3.new_empty(threads * 4 * cap)
    lib.rl2_attn_bwd(q3.data_ptr(), q3.stride(0), q3.stride(1), k3.data_ptr(), v3.data_ptr(),
                     k3.stride(0), k3.stride(1), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
                     heads, kv_heads, D, T, TK, b.data_ptr(), kb.data_ptr(), items.data_ptr(),
                     items.numel(), float(scale), scratch.data_ptr(), cap, dq.data_ptr(),
                     dk_part.data_ptr(), dv_part.data_ptr(), threads)
    if groups == 1:
        return dq, dk_part[0], dv_part[0]
    # each query head of a group added its share: sum them in head order
    dk, dv = (q3.new_empty(TK, kv_heads, D) for _ in range(2))
    for part, dst in ((dk_part, dk), (dv_part, dv)):
        lib.rl2_attn_sum(part.data_ptr(), groups, dst.numel(), dst.data_ptr(), threads)
    return dq, dk, dv


class CausalAttentionFunction(torch.autograd.Function):
    """softmax(scale q k^T) v, causal inside each [start, end) of `bounds` (keys: `kbounds`,
    bottom-right aligned), in the kernel (rl2_attn_fwd / rl2_attn_bwd); q (1, H, T, D), k and v
    (1, KH, TK, D) -> (1, T, H, D)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, kbounds=None):
        # the views the kernel reads, made once: the backward reuses them
        q3, k3, v3 = _kernel_views(*(t[0].detach() for t in (q, k, v)))
        out, lse = attention_forward(q3, k3, v3, bounds, scale, kbounds)
        ctx.save_for_backward(q3, k3, v3, out, lse)
        ctx.bounds, ctx.scale, ctx.kbounds = bounds, float(scale), kbounds
        return out[None]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        q3, k3, v3, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad[0], q3, k3, v3, out, lse, ctx.bounds, ctx.scale,
                                        ctx.kbounds)
        return (dq.transpose(0, 1)[None], dk.transpose(0, 1)[None], dv.transpose(0, 1)[None],
                None, None, None)


def attention_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gathered: bool = False) -> bool:
    """fp32 CPU (1, H, T, D) / (1, KH, T, D) tensors with D 64 or 128 and H a multiple of KH
    (`gathered`: keys and values of any length TK)."""
    return (_plain(q, k, v) and q.dim() == 4 and q.shape[0] == 1 and k.shape == v.shape
            and k.dim() == 4 and k.shape[0] == 1 and (gathered or k.shape[2] == q.shape[2])
            and q.shape[3] == k.shape[3] in (64, 128) and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0 and q.shape[2] > 0 and small_gemm.available())


def _rising(bounds: list[int], end: int) -> bool:
    return bounds[0] == 0 and bounds[-1] == end and all(a <= b for a, b in zip(bounds, bounds[1:]))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                     scale: float, kbounds: list[int] | None = None) -> torch.Tensor:
    """Causal attention inside each [bounds[i], bounds[i + 1]) of a packed row through the
    kernel (`attention_takes` tensors); returns (1, T, H, D) as HF's attention functions do.
    `kbounds`: k and v are gathered keys (`PackedContext.keys`), sequence i's in
    [kbounds[i], kbounds[i + 1]), no fewer than its queries; its mask is aligned bottom-right."""
    if not attention_takes(q, k, v, gathered=kbounds is not None):
        raise ValueError(f"causal_attention: fp32 CPU q (1, H, T, D) and k, v (1, KH, T, D), D 64 "
                         f"or 128, H a multiple of KH, and the kernel (got {q.dtype} "
                         f"{tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, {tuple(v.shape)})")
    if not _rising(bounds, q.shape[2]):
        raise ValueError(f"causal_attention: bounds must rise from 0 to {q.shape[2]}, got {bounds}")
    if kbounds is not None:
        # a sequence without queries gets no key gradients from the kernel: it has no keys either
        if len(kbounds) != len(bounds) or not _rising(kbounds, k.shape[2]) or any(
                kb - ka < b - a or (b == a and kb > ka)
                for a, b, ka, kb in zip(bounds, bounds[1:], kbounds, kbounds[1:])):
            raise ValueError(f"causal_attention: key bounds must rise from 0 to {k.shape[2]} with "
                             f"no fewer keys than queries per sequence (none without queries), "
                             f"got {kbounds} for {bounds}")
        kbounds = list(kbounds)
    return CausalAttentionFunction.apply(q, k, v, list(bounds), scale, kbounds)


@lru_cache(maxsize=None)
def _attention_agrees() -> bool:
    """The kernel against SDPA per sequence (the path it replaces) once per process: values and
    gradients, GQA, both head sizes."""
    from RL2.parallel.attention import _causal_per_sequence

    g = torch.Generator().manual_seed(0)
    # the last case: gathered keys of a shared prompt (a tail seeing 15 more keys than queries)
    for heads, kv_heads, d, bounds, kbounds in ((4, 2, 64, [0, 1, 20, 57], None),
                                               (2, 2, 128, [0, 40], None),
                                               (4, 2, 64, [0, 20, 37], [0, 20, 52])):
        kb = kbounds or bounds
        q = torch.randn(1, heads, bounds[-1], d, generator=g)
        k, v = (torch.randn(1, kv_heads, kb[-1], d, generator=g) for _ in range(2))

        def sdpa(q, k, v):
            return _causal_per_sequence(q, k, v, bounds, 0.1, 0.0, kbounds)

        def kernel(q, k, v):
            return causal_attention(q, k, v, bounds, 0.1, kbounds)

        if not _agrees(sdpa, kernel, [q, k, v], []):
            return False
    return True


def _is_attention(module: torch.nn.Module) -> bool:
    """An HF attention module (Llama family and kin)."""
    return all(hasattr(module, a) for a in ("is_causal", "head_dim", "num_key_value_groups"))


def use_attention(model: torch.nn.Module) -> int:
    """Let RL2's packed attention (RL2/parallel/attention.py) run the causal attention of
    `model`'s attention modules through the kernel (marked `rl2_fused_attention`; inputs the
    kernel does not take still go to SDPA). After one check against SDPA. Returns how many."""
    if not small_gemm.available():
        return 0
    with torch.random.fork_rng(devices=[]):
        if not _attention_agrees():
            return 0
    n = 0
    for module in model.modules():
        if _is_attention(module):
            module.rl2_fused_attention = True
            n += 1
    return n


# ----- rotary embedding -----

def rope_takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """fp32 CPU q (B, H, T, D) and k (B, KH, T, D), cos and sin (B, T, D), D a multiple of 32."""
    return (_plain(q, k, cos, sin) and not (cos.requires_grad or sin.requires_grad)
            and q.dim() == k.dim() == 4 and cos.dim() == 3
            and cos.shape == sin.shape == (q.shape[0], q.shape[2], q.shape[3])
            and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
            and q.shape[3] % 32 == 0 and q.shape[3] > 0 and small_gemm.available())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: int) -> torch.Tensor:
    """x (B, H, T, D) rotated (or, inverse, rotated back: the backward) -> (B, H, T, D) laid
    out as (B, T, H, D), HF's projections' layout (attention reads it as is); not a view, so
    callers may write into it as into HF's result."""
    rows = x.transpose(1, 2)  # (B, T, H, D): token rows, evenly spaced if the kernel reads them
    b, t, h, d = rows.shape
    # row b * T + t at that many times ldx (a size-1 dim's stride is anything: not read)
    ldx = rows.stride(1) if t > 1 else rows.stride(0)
    if not (rows.stride(3) == 1 and (b == 1 or t == 1 or rows.stride(0) == t * ldx)):
        rows, ldx = rows.contiguous(), h * d
    y = torch.empty_strided((b, h, t, d), (t * h * d, d, h * d, 1), dtype=x.dtype)
    small_gemm.load()[0].rl2_rope(
        rows.data_ptr(), ldx, rows.stride(2), y.data_ptr(), h * d, b * t, h, d,
        cos.data_ptr(), sin.data_ptr(), inverse, torch.get_num_threads())
    return y


class RopeFunction(torch.autograd.Function):
    """HF's apply_rotary_pos_emb (x cos + rotate_half(x) sin) of q and k in the kernel
    (rl2_rope): one pass per tensor forward and backward instead of five ops each."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.detach().contiguous(), sin.detach().contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(q.detach(), cos, sin, 0), _rotate(k.detach(), cos, sin, 0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dq, cos, sin, 1), _rotate(dk, cos, sin, 1), None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated as HF's apply_rotary_pos_emb(q, k, cos, sin) does (`rope_takes` tensors)."""
    if not rope_takes(q, k, cos, sin):
        raise ValueError(f"rope: fp32 CPU q (B, H, T, D), k (B, KH, T, D), cos and sin (B, T, D), "
                         f"D a multiple of 32, and the kernel (got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {cos.dtype} {tuple(cos.shape)}, {tuple(sin.shape)})")
    return RopeFunction.apply(q, k, cos, sin)


def _dispatching(original):
    """HF's apply_rotary_pos_emb, through the kernel for the tensors it takes."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and rope_takes(q, k, cos, sin):
            return RopeFunction.apply(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.rl2_original = original
    return apply_rotary_pos_emb


def _rope_agrees(original) -> bool:
    g = torch.Generator().manual_seed(0)
    t, d = 9, 64
    pos = torch.arange(t, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(d // 2) / (d // 2))
    emb = torch.cat([pos, pos], -1)[None]  # (1, T, D) as HF's rotary modules build it
    cos, sin = emb.cos(), emb.sin()
    q, k = torch.randn(1, 4, t, d, generator=g), torch.randn(1, 2, t, d, generator=g)
    flat = lambda pair: torch.cat([x.reshape(-1) for x in pair])
    return _agrees(lambda q, k: flat(original(q, k, cos, sin)),
                   lambda q, k: flat(rope(q, k, cos, sin)), [q, k], [])


def use_rope(model: torch.nn.Module) -> int:
    """Route the rotary embedding of `model`'s attention modules through `rope`: HF's modeling
    modules call their module-level apply_rotary_pos_emb, which is replaced (as Liger-Kernel
    patches it) by one that sends the tensors the kernel takes to it and the rest to HF's, after
    a check against HF's. Process-wide for that model family, so the same arithmetic matters:
    the kernel's is HF's (x1 cos - x2 sin, x2 cos + x1 sin). Returns the modules covered."""
    import inspect

    if not small_gemm.available():
        return 0
    n = 0
    for module in model.modules():
        if not _is_attention(module):
            continue
        # the globals its forward reads (an inherited forward's module; FSDP's wrapper class
        # keeps the model's forward; HF's decorators wrap it)
        family = getattr(inspect.unwrap(type(module).forward), "__globals__", {})
        fn = family.get("apply_rotary_pos_emb")
        if fn is None:
            continue
        if not hasattr(fn, "rl2_original"):
            # HF's signature of today (older families took position_ids before unsqueeze_dim)
            if list(inspect.signature(fn).parameters) != ["q", "k", "cos", "sin", "unsqueeze_dim"]:
                continue
            if not _rope_agrees(fn):
                continue
            family["apply_rotary_pos_emb"] = fn = _dispatching(fn)
        n += 1
    return n
