"""Linear layers on the CPU through oneDNN instead of PyTorch's default BLAS.

Why: on x86 PyTorch sends fp32 matmuls to MKL's sgemm, and on AMD CPUs MKL does not run its
AVX-512 kernels; oneDNN (bundled with PyTorch, `torch.ops.mkldnn`) JITs its own. Measured on the
2-core AMD EPYC of benchmarks/README.md: a [1024, 512] x [512, 1536] fp32 matmul at 172 GFLOP/s
through MKL and 468 through oneDNN, an SFT step of the 25.7M-param model 1.5x faster. Results are
fp32 (not reduced precision, unless `torch.backends.mkldnn.matmul.fp32_precision` is changed),
rounded differently from MKL's.

- `use_for_linears(model)`: every `nn.Linear` of a training model computes forward and backward
  with oneDNN (`OneDNNLinear`); DTensor (tensor-parallel) weights, non-CPU tensors and dtypes
  oneDNN lacks (float64) keep `F.linear`. Only where it pays (`resolve("auto")`): on Intel
  CPUs MKL runs its AVX-512 kernels and was faster than oneDNN for training shapes
  (benchmarks/README.md, fix 19).
- `PackedLinears`: inference only (the torch rollout engine): weights reordered once into
  oneDNN's blocked layout and reused every decode step; a decode step at 16 rows multiplies
  ~2.8x faster than through MKL, which re-packs every weight on every call.
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from RL2.utils import small_gemm

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)
CHOICES = ("auto", "onednn", "aten")


def cpu_vendor() -> str:
    """The x86 vendor string of this machine's CPU ("AuthenticAMD", "GenuineIntel"), else ""."""
    return small_gemm.cpuinfo("vendor_id")


def resolve(choice: str, training: bool = True) -> str:
    """"auto" -> "onednn" or "aten". Training linears (forward, input and weight gradients at
    hundreds of rows): oneDNN only on AMD, where MKL's sgemm takes its AVX2 path (oneDNN 1.5x
    faster steps there); on an Intel Xeon MKL was 1.2-1.9x faster than oneDNN on the same
    products, the weight gradient most. Inference (the engine's decode, a few rows against
    weights packed once): oneDNN on both (1.15x on the Intel Xeon, ~2.8x on AMD)."""
    if choice != "auto":
        return choice
    return "onednn" if not training or cpu_vendor() == "AuthenticAMD" else "aten"


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x [..., in] @ weight[out, in].T (+ bias); weight may be dense or `_reorder_linear_weight`'s
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _dense(t: torch.Tensor) -> bool:
    """A 2-D operand oneDNN's product takes as it is: row- or column-major without gaps. Any
    other strides (a slice, an expanded tensor) send the product to oneDNN's reference kernel,
    ~1000x slower (seen at [512, 256] x [768, 256])."""
    return t.is_contiguous() or t.t().is_contiguous()


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _DTYPES and weight.dtype == x.dtype
            and type(weight) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor / subclass
            and type(x) is torch.Tensor and weight.dim() == 2 and _dense(weight))


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """x.t().contiguous(), for a product's first operand: `_linear_pointwise` makes its input
    contiguous with PyTorch's strided copy, which RL2's kernel beats ~4x on a [1376, 1536] fp32
    matrix (15% of a 2-thread policy update; benchmarks/README.md, fix 37). The weight operand
    needs no copy when dense (`_dense`): ATen wraps it with its strides and oneDNN's product
    takes a transposed one as it is (fix 48)."""
    y = small_gemm.transpose(x) if x.dtype == torch.float32 else None
    return x.t().contiguous() if y is None else y


class OneDNNLinear(torch.autograd.Function):
    """y = x @ W.T + b with all three matmuls (forward, input and weight gradients) in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # g @ W: W.T [in, out] is the "weight" of this product
            grad_x = _mm(g, weight.t(), None).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:  # g.T @ x: rows are output features, contraction over tokens
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = _mm(_transposed(g), x2.t() if _dense(x2) else _transposed(x2), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _eligible(x, weight) or x.numel() == 0:
        return F.linear(x, weight, bias)
    return OneDNNLinear.apply(x, weight, bias)


def _forward(self, x):
    return linear(x, self.weight, self.bias)


def use_for_linears(model: torch.nn.Module) -> int:
    """Route every nn.Linear of `model` through `linear` (instance forward; FSDP2 and PEFT hooks
    still run around it). Returns how many layers were switched."""
    if not available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:  # subclasses (e.g. quantized) keep their forward
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n


class PackedLinears:
    """Inference copies of linear weights in oneDNN's blocked layout, made on first use, and
    with `small` in RL2's kernel's layout for products of a few rows (which `fused` and
    `attention` extend to the ops around them in a decode step). The owner calls `clear()`
    whenever weights change (in place or replaced): a copy is only keyed by its module and the
    weight's storage, which an in-place copy does not change."""

    def __init__(self, enabled: bool = True, small: bool = False):
        self.enabled = enabled and available()
        self._packed: dict = {}  # module (or tuple of modules) -> (weight addresses, packed[, bias])
        # `small`: products of <= small_gemm.MAX_ROWS fp32 rows through RL2's AVX-512 kernel,
        # where it builds (RL2/utils/small_gemm.py)
        self.small = False
        if self.enabled and small:
            lib, why = small_gemm.load()
            self.small = lib is not None
            if why:
                logger.info("small_gemm: %s; decode-step linear layers stay on oneDNN", why)
        self._strips: dict = {}  # as _packed, in the kernel's layout (small_gemm.pack)
        self._layers = None  # (a model's decoder layers, their small_gemm.DecodeLayers or None)

    def clear(self) -> None:
        self._packed.clear()
        self._strips.clear()
        self._layers = None

    def __call__(self, x: torch.Tensor, proj: torch.nn.Linear) -> torch.Tensor:
        w = proj.weight
        if not self.enabled or not _eligible(x, w) or x.numel() == 0:
            return F.linear(x, w, proj.bias)
        kernel = self._kernel_weights(x, (proj,))
        if kernel is not None:
            return small_gemm.linear(x, *kernel)
        entry = self._packed.get(proj)
        if entry is None or entry[0] != w.data_ptr():
            entry = (w.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
            self._packed[proj] = entry
        return _mm(x, entry[1], proj.bias)

    def fused(self, x: torch.Tensor, projs: tuple, norm: tuple | None = None,
              res: torch.Tensor | None = None, glu: bool = False,
              rope: tuple | None = None) -> torch.Tensor | None:
        """res + stacked(RMSNorm(x), projs) in one call of RL2's kernel (norm: (weight, eps), or
        None for x itself; res: None or a tensor shaped like the output); with glu and projs =
        (gate, up) SiLU(gate) * up; with rope = (cos, sin, heads) the first `heads` heads of
        the output rotated (`small_gemm.linear`). None when the kernel does not take this
        product: the caller then runs the norm, the add, the activation or the rotation itself."""
        if not self.enabled:
            return None
        order = None
        if rope is not None:
            n = sum(p.weight.shape[0] for p in projs)
            if rope[0].shape[-1] % 32 or rope[2] * rope[0].shape[-1] > n:
                return None
            order = (n, rope[2], rope[0].shape[-1])
        kernel = self._kernel_weights(x, projs, glu, order)
        if kernel is None:
            return self._many_rows(x, projs, norm, res, glu, rope)
        return small_gemm.linear(x, *kernel, res=res, norm=norm, glu=glu, rope=rope)

    def _many_rows(self, x: torch.Tensor, projs: tuple, norm: tuple | None, res: torch.Tensor | None,
                   glu: bool, rope: tuple | None) -> torch.Tensor | None:
        """`fused` for more rows than the kernel's product takes (a prefill): oneDNN's product,
        the norm, SiLU(gate) * up and the rotation each one pass of the kernel's C (PyTorch's
        eager ops make 5 passes of a norm, 5 of a rotation); a 32-prompt prefill of SmolLM2-135M
        1.21 -> 1.05 s (benchmarks/README.md, fix 28). None where it does not apply."""
        if not (self.small and x.dim() == 2 and x.shape[0] > small_gemm.MAX_ROWS
                and small_gemm._plain(x)):
            return None
        d = rope[0].shape[-1] if rope is not None else 0
        if rope is not None and (d % 32 or rope[0].shape != (x.shape[0], d)
                                 or rope[1].shape != rope[0].shape or not small_gemm._plain(*rope[:2])):
            return None
        if res is not None and (glu or rope is not None):  # as the kernel: no add after those
            raise ValueError("fused: res goes with neither glu nor rope")
        if glu and (len(projs) != 2 or projs[0].weight.shape != projs[1].weight.shape):
            return None
        if norm is not None:
            x = small_gemm.rms_norm(x, *norm)
            if x is None:
                return None
        y = self.stacked(x, projs)
        if glu:
            return small_gemm.silu_mul(y, projs[0].weight.shape[0])
        if rope is not None:
            return small_gemm.rope_(y, *rope)
        return y if res is None else res + y

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  bias: torch.Tensor, scale: float) -> torch.Tensor | None:
        """A decode step's attention through RL2's kernel (`small_gemm.attention`) when this
        object sends products there and the kernel takes these tensors, else None."""
        return small_gemm.attention(q, keys, values, bias, scale) if self.small else None

    def decode_layers(self, layers, x: torch.Tensor, rope: tuple, cache: tuple,
                      bias: torch.Tensor) -> torch.Tensor | None:
        """A decode step's decoder layers (`layers`, the model's) in one call of RL2's kernel
        (`small_gemm.DecodeLayers`; x, rope, cache, bias as its call takes them), or None where
        the kernel does not take them (all layers or none: the caller then runs them op by op).
        Laid out on first use with the weights, biases and norms as they are then, and kept
        until `clear`, which the owner calls whenever weights change."""
        if not self.small or x.dtype != torch.float32:
            return None
        cached = self._layers
        if cached is None or cached[0] is not layers:
            if not 0 < x.shape[0] <= small_gemm.MAX_ROWS:  # a step's size: not kept as a refusal
                return None
            cached = self._layers = (layers, self._decode_layers(layers, x))
        return cached[1](x, rope, cache, bias) if cached[1] is not None else None

    def _decode_layers(self, layers, x: torch.Tensor):
        if not len(layers):
            return None
        first = layers[0].self_attn
        d = getattr(first, "head_dim", 0)
        if d <= 0 or d % 32:
            return None
        args = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (getattr(attn, "head_dim", 0) != d or attn.scaling != first.scaling
                    or attn.k_proj.weight.shape != first.k_proj.weight.shape):
                return None  # one head size, scale and K/V width for all layers
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            qk = None
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorms before the rotation
                qk = ((attn.q_norm.weight, attn.q_norm.variance_epsilon),
                      (attn.k_norm.weight, attn.k_norm.variance_epsilon))
            n = sum(p.weight.shape[0] for p in qkv)
            # the rotation inside the product, except after Qwen3's head norms
            order = None if qk else (n, (qkv[0].weight.shape[0] + qkv[1].weight.shape[0]) // d, d)
            packed = (self._kernel_weights(x, qkv, order=order), self._kernel_weights(x, (attn.o_proj,)),
                      self._kernel_weights(x, (mlp.gate_proj, mlp.up_proj), glu=True),
                      self._kernel_weights(x, (mlp.down_proj,)))
            if any(p is None for p in packed):
                return None
            args.append(dict(norm1=(n1.weight, n1.variance_epsilon), qkv=packed[0], o=packed[1],
                             norm2=(n2.weight, n2.variance_epsilon), glu=packed[2], down=packed[3],
                             qk_norm=qk))
        return small_gemm.DecodeLayers.make(args, first.k_proj.weight.shape[0] // d, d, first.scaling)

    def _kernel_weights(self, x: torch.Tensor, projs: tuple, glu: bool = False,
                        order: tuple | None = None) -> tuple | None:
        """(strips, output features, bias) of `projs` stacked (glu: a gate and an up projection
        in alternating strips; order: (n, heads, head_dim), rows in `small_gemm.rope_order`),
        packed for RL2's kernel on first use, or None when the kernel does not take x @ these
        weights."""
        ws = [p.weight for p in projs]
        if not (self.small and small_gemm.eligible(x, ws[0])):
            return None
        if len(projs) == 1 and order is None:  # keyed by the module, its bias read live
            entry = self._strips.get(projs[0])
            if entry is None or entry[0] != ws[0].data_ptr():
                if not _eligible(x, ws[0]):
                    return None
                entry = (ws[0].data_ptr(), small_gemm.pack_many(ws))
                self._strips[projs[0]] = entry
            return entry[1], ws[0].shape[0], projs[0].bias
        key = tuple(w.data_ptr() for w in ws)
        slot = ("glu", *projs) if glu else ("rope", order, *projs) if order else projs
        entry = self._strips.get(slot)
        if entry is None or entry[0] != key:
            if not all(_eligible(x, w) for w in ws) or glu and (
                    len(ws) != 2 or ws[0].shape != ws[1].shape):
                return None
            if glu:
                entry = (key, small_gemm.pack_many(ws, glu=True), ws[0].shape[0],
                         small_gemm.pack_glu_bias(projs[0].bias, projs[1].bias))
            else:
                bias = _stack_bias(projs)
                rows = small_gemm.rope_order(*order) if order is not None else None
                if rows is not None and bias is not None:
                    bias = bias[rows]
                entry = (key, small_gemm.pack_many(ws, order=rows), sum(w.shape[0] for w in ws), bias)
            self._strips[slot] = entry
        return entry[1:]

    def many(self, x: torch.Tensor, projs: tuple) -> list[torch.Tensor]:
        """[proj(x) for proj in projs] as ONE product with the weights stacked (q/k/v, gate/up):
        at a decode step's few rows a wider matmul runs closer to the peak (16 rows, 25.7M
        model: q/k/v 135 -> 95 us, gate/up 265 -> 245 us; benchmarks/README.md, fix 14)."""
        if not self.enabled or x.numel() == 0 or not all(_eligible(x, p.weight) for p in projs):
            return [self(x, p) for p in projs]
        return list(self.stacked(x, projs).split([p.weight.shape[0] for p in projs], dim=-1))

    def stacked(self, x: torch.Tensor, projs: tuple) -> torch.Tensor:
        """torch.cat([proj(x) for proj in projs], -1), computed as one product when it can be."""
        if len(projs) == 1:  # one packed copy per module, shared with __call__ (bias read live)
            return self(x, projs[0])
        ws = [p.weight for p in projs]
        key = tuple(w.data_ptr() for w in ws)
        kernel = self._kernel_weights(x, projs)
        if kernel is not None:
            return small_gemm.linear(x, *kernel)
        entry = self._packed.get(projs)
        # a decode step calls this ~30 times: when these very weights are packed, only x is
        # checked (what _eligible checks of the weights held when they were packed)
        if (entry is not None and entry[0] == key and type(x) is torch.Tensor
                and x.dtype == entry[1].dtype and x.device.type == "cpu" and x.numel()):
            return _mm(x, entry[1], entry[2])
        if not self.enabled or x.numel() == 0 or not all(_eligible(x, w) for w in ws):
            return torch.cat([self(x, p) for p in projs], dim=-1)
        if entry is None or entry[0] != key:  # not packed yet, or the weights were replaced
            stacked, bias = _stack(projs)
            entry = (key, torch.ops.mkldnn._reorder_linear_weight(stacked, None), bias)
            self._packed[projs] = entry
        return _mm(x, entry[1], entry[2])


def _stack_bias(projs: tuple) -> torch.Tensor | None:
    """The biases of `projs` stacked along the output dimension (zeros for a layer without
    one; None when none has a bias)."""
    if all(p.bias is None for p in projs):
        return None
    return torch.cat([p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.weight.shape[0])
                      for p in projs])


def _stack(projs: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of `projs` stacked along the output dimension, and their biases
    (`_stack_bias`)."""
    return torch.cat([p.weight.detach() for p in projs]), _stack_bias(projs)
