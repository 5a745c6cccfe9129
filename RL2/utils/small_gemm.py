"""The CPU engine's decode-step linear layers (<= MAX_ROWS rows) through RL2's AVX-512 kernel.

Why a kernel of our own: at a decode step's few rows a linear layer is bound by reading its
weights, and the libraries at hand (oneDNN, MKL, inductor's GEMM templates) do not stream them
at the machine's rate there. On the 2-core Intel Xeon of benchmarks/README.md (fix 25) the
25.7M model's linear layers at 16 rows took 7.95 ms through `small_gemm.c` against 11.08 ms
through oneDNN's packed weights (1.15-1.67x at 1-64 rows, 1.06-1.11x at 96-128), and the
small ops after each product ran faster too (the kernel drags less through the caches). It
also takes the RMSNorm before a product, the rotary embedding, residual add or SiLU(gate) * up
after it, and the decode step's attention (`attention`), each with HF's arithmetic (fix 26): as
eager ops they cost a decode step more than their arithmetic. `DecodeLayers` runs a decode
step's decoder layers (those ops and the KV cache writes) in one call, the same bits as op by
op without the Python between them (fixes 27, 36). Products of more rows (prefill) stay on
oneDNN, so the engine holds both packed copies of its weights; the norm, rotation and SiLU(gate)
* up around them run as one C pass each (`rms_norm`, `rope_`, `silu_mul`; fix 28). Built with
-ffp-contract=off: otherwise the compiler fuses a multiply and an add the eager ops round
apart (the rotation's, found by a bit-equality test).

The C source ships with the package and is compiled on first use with the system's C compiler
(`$CC`, else gcc / cc; about a second) into `$RL2_CACHE_DIR` (default `~/.cache/rl2`), keyed by
the source, compiler and flags, and linked against the OpenMP runtime PyTorch already loaded,
so that both share one thread pool. Where that cannot be done (no x86 AVX-512, no compiler,
PyTorch not on GNU OpenMP, a failed build or self-check) `load()` says why and callers keep
oneDNN. Results are fp32, summed in order over the inner dimension (rounded differently from
a blocked BLAS, like oneDNN vs MKL).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from functools import lru_cache

import torch
import torch.nn.functional as F

MAX_ROWS = 128  # at most this many rows per product; more go to oneDNN (crossover ~160-190, fix 26)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_gemm.c")
CFLAGS = ["-O3", "-mavx512f", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC"]


def cpuinfo(key: str) -> str:
    """The value of the first `key` line of /proc/cpuinfo ("vendor_id", "flags"), else ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    return set(cpuinfo("flags").split())


def openmp_libraries(maps: str | None = None) -> set[str]:
    """Paths of the GNU OpenMP runtimes mapped into this process (/proc/self/maps text)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return set()
    paths = set()
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) >= 6 and os.path.basename(parts[5]).startswith("libgomp"):
            paths.add(parts[5])
    return paths


def cache_dir() -> str:
    return os.environ.get("RL2_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl2")


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else (shutil.which("gcc") or shutil.which("cc"))


def _build(cc: str, gomp: str, out: str) -> None:
    """Compile SOURCE into `out` atomically (ranks of one host may build at once)."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
        obj, lib = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
        # linked to PyTorch's libgomp by path (not -lgomp): one OpenMP thread pool in the process
        for cmd in ([cc, *CFLAGS, "-c", SOURCE, "-o", obj],
                    [cc, "-shared", obj, gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}", "-lm", "-o", lib]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-400:]}")
        os.replace(lib, out)


def _self_check(lib) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 33, generator=g), torch.randn(40, generator=g)
    x, res = torch.randn(5, 33, generator=g), torch.randn(5, 40, generator=g)
    nw = torch.randn(33, generator=g)
    want = res + F.linear(F.rms_norm(x, (33,), nw, 1e-6), w, b)
    y = _call(lib, x, pack(w), 40, b, res, (nw, 1e-6))
    u = torch.randn(40, 33, generator=g)
    glu = _call(lib, x, pack_glu(w, u), 40, pack_glu_bias(b, None), norm=(nw, 1e-6), glu=True)
    h = F.rms_norm(x, (33,), nw, 1e-6)
    if not (torch.allclose(y, want, rtol=1e-4, atol=1e-4)
            and torch.allclose(glu, F.silu(F.linear(h, w, b)) * F.linear(h, u), rtol=1e-4, atol=1e-4)
            and torch.allclose(_call(lib, x, pack(w), 40, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)):
        raise RuntimeError("the built kernel's products differ from torch's")
    q, kv = torch.randn(3, 2, 3, 32, generator=g), torch.randn(2, 3, 2, 7, 32, generator=g)
    bias = torch.zeros(3, 1, 1, 7)
    bias[1, ..., :4] = float("-inf")
    from RL2.rollout.llama_forward import _attend_step  # its eager ops: what the kernel replaces

    if not torch.allclose(_attend(lib, q, kv[0], kv[1], bias, 0.2),
                          _attend_step(q, kv[0], kv[1], bias, 0.2), rtol=1e-4, atol=1e-5):
        raise RuntimeError("the built kernel's attention differs from torch's")


@lru_cache(maxsize=None)
def load():
    """(the loaded library, None), or (None, why it cannot be used here)."""
    if "avx512f" not in cpu_flags():
        return None, "this CPU has no AVX-512"
    gomp = openmp_libraries()
    if len(gomp) != 1:
        return None, f"PyTorch's OpenMP runtime not found as one libgomp (mapped: {sorted(gomp)})"
    gomp = gomp.pop()
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install gcc)"
    if not os.path.exists(SOURCE):
        return None, f"{SOURCE} is missing from the installed package"
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + repr((cc, CFLAGS, gomp)).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"small_gemm-{key}.so")
    try:
        if not os.path.exists(path):
            _build(cc, gomp, path)
        lib = ctypes.CDLL(path)
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.rl2_small_gemm.argtypes = [p, i, i, p, i, p, p, p, ctypes.c_float, p, p, ctypes.c_int,
                                       i, i, p, p, ctypes.c_int]
        lib.rl2_small_gemm.restype = None
        lib.rl2_decode_attention.argtypes = [p, i, i, i, i, i, i, p, p, i, i, i, p, ctypes.c_float,
                                             p, p, ctypes.c_int]
        lib.rl2_decode_attention.restype = None
        f = ctypes.c_float
        lib.rl2_decode_layers.argtypes = [ctypes.POINTER(_Layer), i, p, i, i, i, i, i, i, p, p, i,
                                          i, i, i, p, f, p, p, p, p, p, p, p, p, ctypes.c_int]
        lib.rl2_decode_layers.restype = None
        lib.rl2_rms_norm.argtypes = [p, i, i, p, f, p, ctypes.c_int]
        lib.rl2_silu_mul.argtypes = [p, i, i, p, ctypes.c_int]
        lib.rl2_rope.argtypes = [p, i, i, p, i, i, i, i, p, p, ctypes.c_int, ctypes.c_int]
        lib.rl2_rms_norm_fwd.argtypes = [p, i, i, p, f, p, p, ctypes.c_int]
        lib.rl2_rms_norm_bwd.argtypes = [p, p, p, p, i, i, p, p, p, ctypes.c_int]
        lib.rl2_glu_fwd.argtypes = [p, p, i, p, ctypes.c_int]
        lib.rl2_glu_bwd.argtypes = [p, p, p, i, p, p, ctypes.c_int]
        lib.rl2_attn_fwd.argtypes = [p, i, i, p, p, i, i, i, i, i, i, p, p, p, i, f, p, i, p, p,
                                     ctypes.c_int]
        lib.rl2_attn_bwd.argtypes = [p, i, i, p, p, i, i, p, p, p, i, i, i, i, i, p, p, p, i, f, p,
                                     i, p, p, p, ctypes.c_int]
        lib.rl2_attn_sum.argtypes = [p, i, i, p, ctypes.c_int]
        lib.rl2_transpose.argtypes = [p, i, i, i, p, i, ctypes.c_int]
        lib.rl2_pack_strips.argtypes = [p, p, i, i, i, p, ctypes.c_int]
        for fn in (lib.rl2_rms_norm, lib.rl2_silu_mul, lib.rl2_rope, lib.rl2_rms_norm_fwd,
                   lib.rl2_rms_norm_bwd, lib.rl2_glu_fwd, lib.rl2_glu_bwd, lib.rl2_attn_fwd,
                   lib.rl2_attn_bwd, lib.rl2_attn_sum, lib.rl2_transpose, lib.rl2_pack_strips):
            fn.restype = None
        if len(openmp_libraries()) != 1:
            return None, "loading the kernel brought a second OpenMP runtime"
        _self_check(lib)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"could not build or load {path}: {e}"
    return lib, None


def available() -> bool:
    return load()[0] is not None


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` goes to the kernel: fp32 CPU tensors, a few rows."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and type(x) is torch.Tensor and 0 < x.numel() <= MAX_ROWS * x.shape[-1])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> strips [ceil(N / 16), K, 16] (zero columns past N), as the kernel reads it."""
    n, k = weight.shape
    w = weight.detach()
    if n % 16:
        w = torch.cat([w, w.new_zeros(16 - n % 16, k)])
    return w.reshape(-1, 16, k).transpose(1, 2).contiguous()


def pack_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Two weights [N, K] -> their strips alternating, [2 * ceil(N / 16), K, 16] (`linear`'s glu)."""
    return torch.stack([pack(gate), pack(up)], 1).flatten(0, 1)


def strip_sources(weights: list, order: torch.Tensor | None = None,
                  glu: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where each strip of `pack(torch.cat(weights)[order])` (glu: `pack_glu(*weights)`) takes
    its rows: (addresses [S] int64, rows [S] int32), every strip 16 consecutive rows of one
    weight, or fewer at a weight's end (zero columns after them). None when a strip would mix
    two weights' rows or rows out of order, or a weight is not a dense row-major fp32 CPU [N, K]
    of one K: then only the general copy (`pack` of the stacked rows) makes the layout."""
    k = weights[0].shape[-1] if weights else 0
    if not weights or any(
            type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 2 or w.shape[1] != k
            or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
            or w.is_neg() or w.is_conj() or not w.shape[0] for w in weights):
        return None
    if glu:
        if len(weights) != 2 or weights[0].shape != weights[1].shape:
            return None
        parts = [strip_sources([w]) for w in weights]
        if None in parts:
            return None
        return tuple(torch.stack([a, b], 1).flatten() for a, b in zip(*parts))
    if order is None:  # each weight's strips in turn
        if any(w.shape[0] % 16 for w in weights[:-1]):
            return None
        firsts = [torch.arange(0, w.shape[0], 16) for w in weights]
        return (torch.cat([w.data_ptr() + f * (4 * k) for w, f in zip(weights, firsts)]),
                torch.cat([(w.shape[0] - f).clamp(max=16) for w, f in zip(weights, firsts)])
                .to(torch.int32))
    sizes = torch.tensor([w.shape[0] for w in weights])
    ends = sizes.cumsum(0)
    rows = order.to(torch.int64)
    if rows.dim() != 1 or (rows < 0).any() or (rows >= ends[-1]).any():
        return None
    blocks = F.pad(rows, (0, -rows.numel() % 16), value=-1).view(-1, 16)
    count = (blocks >= 0).sum(1)
    lane = torch.arange(16)
    first = blocks[:, 0].contiguous()
    want = torch.where(lane < count[:, None], first[:, None] + lane, -1)
    which = torch.searchsorted(ends, first, right=True)
    if (not torch.equal(blocks, want)
            or not torch.equal(torch.searchsorted(ends, first + count - 1, right=True), which)):
        return None
    starts = ends - sizes
    ptrs = torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64)
    return ptrs[which] + (first - starts[which]) * (4 * k), count.to(torch.int32)


def pack_many(weights: list, order: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """`pack(torch.cat(weights)[order])`, or with glu `pack_glu(*weights)`, bit for bit: one
    multi-threaded copy in C where `strip_sources` describes it (fix 53), else torch's ops."""
    lib = load()[0]
    ws = [w.detach() for w in weights]
    src = strip_sources(ws, order, glu) if lib is not None else None
    if src is None:
        if glu:
            return pack_glu(*ws)
        stacked = torch.cat(ws) if len(ws) > 1 else ws[0]
        return pack(stacked if order is None else stacked[order])
    addresses, rows = src
    k = ws[0].shape[1]
    out = torch.empty(addresses.numel(), k, 16, dtype=torch.float32, device="cpu")
    lib.rl2_pack_strips(addresses.data_ptr(), rows.data_ptr(), addresses.numel(), k, k,
                        out.data_ptr(), torch.get_num_threads())
    return out


def pack_glu_bias(gate: torch.Tensor | None, up: torch.Tensor | None) -> torch.Tensor | None:
    """The biases of `pack_glu`'s two projections (None: zeros), 16 of each in turn, or None."""
    if gate is None and up is None:
        return None
    n = (gate if gate is not None else up).shape[0]
    halves = [torch.zeros(-(-n // 16) * 16) if b is None else F.pad(b.detach(), (0, -n % 16))
              for b in (gate, up)]
    return torch.stack([t.view(-1, 16) for t in halves], 1).flatten()


def rope_order(n: int, heads: int, head_dim: int) -> torch.Tensor:
    """The row order `linear`'s rope wants of a weight [n, K] whose first heads * head_dim rows
    are heads to rotate: per head, 16 rows of its first half then the matching 16 of its second
    half, in turn; the other rows after them as they are."""
    if head_dim % 32 or heads * head_dim > n:
        raise ValueError(f"rope over {heads} heads of {head_dim} (a multiple of 32) in {n} rows")
    half = head_dim // 2
    c = torch.arange(0, half, 16)
    starts = torch.stack([c, c + half], 1).flatten()  # one head's 16-row blocks, in order
    rows = (torch.arange(heads)[:, None, None] * head_dim + starts[None, :, None]
            + torch.arange(16)[None, None, :]).flatten()
    return torch.cat([rows, torch.arange(heads * head_dim, n)])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _call(lib, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
          res: torch.Tensor | None = None, norm: tuple | None = None, glu: bool = False,
          rope: tuple | None = None) -> torch.Tensor:
    k = x.shape[-1]
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    if bias is not None:
        bias = bias.detach().contiguous()
    if res is not None:
        res = res.contiguous()
        if res.shape != y.shape or res.dtype != y.dtype:
            raise ValueError(f"residual {tuple(res.shape)} {res.dtype}: expected {tuple(y.shape)} {y.dtype}")
    norm_w, eps, h = None, 0.0, None
    if norm is not None:
        norm_w, eps = norm[0].detach().contiguous(), float(norm[1])
        if norm_w.shape != (k,) or norm_w.dtype != x.dtype:
            raise ValueError(f"norm weight {tuple(norm_w.shape)} {norm_w.dtype}: expected ({k},) {x.dtype}")
        h = torch.empty_like(x)  # the normalised rows, read by every panel
    if (glu or rope) and res is not None or glu and rope:
        raise ValueError("glu and rope take no residual, and not each other")
    cos = sin = None
    heads = head_dim = 0
    if rope is not None:
        cos, sin, heads = rope
        head_dim = cos.shape[-1]
        cos, sin = cos.reshape(-1, head_dim).contiguous(), sin.reshape(-1, head_dim).contiguous()
        if (head_dim % 32 or heads * head_dim > n or cos.shape != (x.numel() // k, head_dim)
                or sin.shape != cos.shape or cos.dtype != x.dtype or sin.dtype != x.dtype):
            raise ValueError(f"rope: cos / sin {tuple(cos.shape)} {cos.dtype} for {heads} heads of "
                             f"{n} columns and {x.numel() // k} rows of {x.dtype}")
    lib.rl2_small_gemm(x.data_ptr(), x.numel() // k, k, packed.data_ptr(), n, _ptr(bias), _ptr(res),
                       _ptr(norm_w), eps, _ptr(h), y.data_ptr(), int(glu), heads, head_dim, _ptr(cos),
                       _ptr(sin), torch.get_num_threads())
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           res: torch.Tensor | None = None, norm: tuple | None = None, glu: bool = False,
           rope: tuple | None = None) -> torch.Tensor:
    """res + (x' [..., K] @ W.T + bias) -> [..., n], W given as `pack(W)` (n rows); x' is x, or with
    norm = (weight [K], eps) x RMS-normalised as HF's fp32 RMSNorm does. With glu, `packed` and
    `bias` come from `pack_glu` / `pack_glu_bias` of a gate and an up projection (n rows each)
    and the result is SiLU(gate) * up (no res). With rope = (cos, sin, heads) (cos / sin [rows,
    head_dim], one row per row of x), W and bias come with their rows in `rope_order(n, heads,
    head_dim)` and the first heads * head_dim output columns are rotated as HF's
    apply_rotary_pos_emb rotates a head (no res). Needs `available()`."""
    return _call(load()[0], x, packed, n, bias, res, norm, glu, rope)


def _attend(lib, q, keys, values, bias, scale):
    b, kh, g, d = q.shape
    w = keys.shape[2]
    out = torch.empty(b, kh, g, d, dtype=q.dtype)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * g * w, dtype=torch.float32)
    lib.rl2_decode_attention(q.data_ptr(), b, kh, g, d, q.stride(0), q.stride(1), keys.data_ptr(),
                             values.data_ptr(), keys.stride(0), keys.stride(1), w, bias.data_ptr(),
                             float(scale), scratch.data_ptr(), out.data_ptr(), threads)
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
              scale: float) -> torch.Tensor | None:
    """A decode step's attention through the kernel: q [B, kv_heads, G, D] (the G query heads of
    each KV head) over keys / values [B, kv_heads, W, D] (a window of the cache, rows of D
    contiguous floats), bias [B, 1, 1, W] additive (0 / -inf): llama_forward's eager
    `_attend_step` within fp32 rounding, [B, kv_heads, G, D]. None when the kernel does not
    take these tensors (not fp32 CPU tensors, another layout, D not a multiple of 16 up to
    256, G > 8, or no kernel)."""
    lib = load()[0]
    if lib is None or q.dim() != 4 or keys.shape != values.shape or keys.stride() != values.stride():
        return None
    b, kh, g, d = q.shape
    w = keys.shape[2]
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or type(t) is not torch.Tensor
            for t in (q, keys, values, bias))
            or d % 16 or d > 256 or g > 8 or not b * w or keys.shape[:2] != (b, kh)
            or keys.shape[3] != d or keys.stride()[2:] != (d, 1) or q.stride()[2:] != (d, 1)
            or bias.shape != (b, 1, 1, w) or not bias.is_contiguous()):
        return None
    return _attend(lib, q, keys, values, bias, scale)


class _Layer(ctypes.Structure):
    """A layer's own arguments of `rl2_decode_layers` (its layer_args)."""
    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "norm1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b", "norm2", "gu_w", "gu_b",
        "down_w", "down_b", "kbuf", "vbuf")]
        + [(name, ctypes.c_float) for name in ("eps1", "eps_q", "eps_k", "eps2")])


class DecodeLayers:
    """A model's decoder layers laid out once for `rl2_decode_layers`, which runs all of a
    decode step's layers in one call: what llama_forward's fused ops compute op by op, bit for
    bit (Qwen3's head norms sum in another order), and the KV cache writes, without Python
    between the layers (fixes 27, 36: one call a layer cost ~0.2 ms of argument checks).

    layers: per layer a dict of norm1 / norm2: (weight, eps) of the input and post-attention
    RMSNorms; qkv, o, glu, down: (packed, output features, bias) as `linear` takes them (qkv
    in `rope_order` over the query and key heads, glu from `pack_glu`); qk_norm: Qwen3's
    per-head RMSNorms ((q weight [D], eps), (k weight [D], eps)) or None, qkv then in its
    natural order. `make` returns None where the kernel does not take them; the object holds
    the tensors it points to."""

    def __init__(self, lib, table, tensors, dims, scale):
        self.lib, self.table, self.tensors, self.scale = lib, table, tensors, scale
        self.hidden, self.heads, self.kv_heads, self.d, self.inter = dims
        self.kv = None  # weak references to the cache buffers the table points to

    @classmethod
    def make(cls, layers: list[dict], kv_heads: int, head_dim: int, scale: float):
        lib = load()[0]
        if lib is None or not layers:
            return None
        d, hidden = head_dim, layers[0]["norm1"][0].shape[-1]
        heads = (layers[0]["qkv"][1] - 2 * kv_heads * d) // d
        inter = layers[0]["glu"][1]
        if (d <= 0 or d % 32 or d > 256 or kv_heads <= 0 or heads <= 0 or heads % kv_heads
                or heads // kv_heads > 8):
            return None
        strips = lambda n: (n + 15) // 16  # noqa: E731
        table, tensors = (_Layer * len(layers))(), []
        for entry, a in zip(table, layers):
            qkv, o, glu, down, qk = a["qkv"], a["o"], a["glu"], a["down"], a["qk_norm"]
            qn, kn = qk if qk is not None else ((None, 0.0), (None, 0.0))
            own = [t for t in (a["norm1"][0], a["norm2"][0], qkv[0], o[0], glu[0], down[0], qkv[2],
                               o[2], glu[2], down[2], qn[0], kn[0]) if t is not None]
            if (not _plain(*own) or (heads + 2 * kv_heads) * d != qkv[1] or o[1] != hidden
                    or down[1] != hidden or glu[1] != inter
                    or a["norm1"][0].shape != (hidden,) or a["norm2"][0].shape != (hidden,)
                    or qk is not None and (qn[0].shape != (d,) or kn[0].shape != (d,))
                    or qkv[0].shape != (strips(qkv[1]), hidden, 16)  # each product's K and N
                    or o[0].shape != (strips(hidden), heads * d, 16)
                    or glu[0].shape != (2 * strips(inter), hidden, 16)
                    or down[0].shape != (strips(hidden), inter, 16)
                    or any(b is not None and b.shape != (size,) for b, size in (
                        (qkv[2], qkv[1]), (o[2], hidden), (glu[2], 32 * strips(inter)),
                        (down[2], hidden)))):
                return None
            for name, t in (("norm1", a["norm1"][0]), ("qkv_w", qkv[0]), ("qkv_b", qkv[2]),
                            ("q_norm", qn[0]), ("k_norm", kn[0]), ("o_w", o[0]), ("o_b", o[2]),
                            ("norm2", a["norm2"][0]), ("gu_w", glu[0]), ("gu_b", glu[2]),
                            ("down_w", down[0]), ("down_b", down[2])):
                setattr(entry, name, _ptr(t))
            entry.eps1, entry.eps2 = float(a["norm1"][1]), float(a["norm2"][1])
            entry.eps_q, entry.eps_k = float(qn[1]), float(kn[1])
            tensors += own
        return cls(lib, table, tensors, (hidden, heads, kv_heads, d, inter), float(scale))

    def _point_at(self, keys: list, values: list) -> bool:
        """Point the table at these cache buffers, checked when they are other tensors than
        last time (weak references: a dropped cache is not kept alive here)."""
        bufs = list(keys) + list(values)
        if self.kv is not None and len(bufs) == len(self.kv) and all(
                ref() is t for ref, t in zip(self.kv, bufs)):
            return True
        self.kv = None
        shape = bufs[0].shape if bufs else None
        if (len(keys) != len(self.table) or len(values) != len(self.table) or len(shape) != 4
                or shape[1] != self.kv_heads or shape[3] != self.d
                or any(t.shape != shape for t in bufs) or not _plain(*bufs)):
            return False
        for entry, k, v in zip(self.table, keys, values):
            entry.kbuf, entry.vbuf = k.data_ptr(), v.data_ptr()
        self.kv = [weakref.ref(t) for t in bufs]
        return True

    def __call__(self, x: torch.Tensor, rope: tuple, cache: tuple,
                 bias: torch.Tensor) -> torch.Tensor | None:
        """The last layer's output [M, hidden] for x [M, hidden] (a decode step's embeddings),
        or None where the kernel does not take these tensors (the caller then runs the layers
        op by op). rope: (cos, sin) [M, D]; cache: (keys, values, start, column): per layer the
        cache buffers [rows >= M, kv_heads, L, D], this step's keys and values written at
        `column`, attention over [start, column]; bias [M, 1, 1, column + 1 - start] (0 / -inf)."""
        keys, values, start, column = cache
        cos, sin = rope
        if x.dim() != 2 or not _plain(x, cos, sin, bias) or not self._point_at(keys, values):
            return None
        m, d = x.shape[0], self.d
        w = column + 1 - start
        if (not 0 < m <= MAX_ROWS or x.shape[1] != self.hidden or keys[0].shape[0] < m
                or not 0 <= start <= column < keys[0].shape[2] or cos.shape != (m, d)
                or sin.shape != (m, d) or bias.shape != (m, 1, 1, w)):
            return None
        hidden, heads, kv_heads = self.hidden, self.heads, self.kv_heads
        out, y, x2, h = (torch.empty_like(x) for _ in range(4))
        q = torch.empty(m, (heads + 2 * kv_heads) * d)
        att, act = torch.empty(m, heads * d), torch.empty(m, self.inter)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * (heads // kv_heads) * w)
        self.lib.rl2_decode_layers(
            self.table, len(self.table), x.data_ptr(), m, hidden, heads, kv_heads, d, self.inter,
            cos.data_ptr(), sin.data_ptr(), keys[0].stride(0), keys[0].stride(1), start, column,
            bias.data_ptr(), self.scale, scratch.data_ptr(), h.data_ptr(), q.data_ptr(),
            att.data_ptr(), x2.data_ptr(), act.data_ptr(), y.data_ptr(), out.data_ptr(), threads)
        return out


def _plain(*tensors: torch.Tensor) -> bool:
    # inference only (raw pointers: no autograd graph, no version bump of what rope_ rotates)
    grad = torch.is_grad_enabled()
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32
               and t.device.type == "cpu" and t.is_contiguous() and not (grad and t.requires_grad)
               for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of the rows of x [M, K] as the kernel's fused norm computes it (HF's fp32
    RMSNorm summed in another order) in one pass, for rows the kernel's product does not take;
    None where the kernel does not take these tensors."""
    lib = load()[0]
    if lib is None or x.dim() != 2 or not _plain(x, weight) or weight.shape != x.shape[1:]:
        return None
    h = torch.empty_like(x)
    lib.rl2_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), float(eps), h.data_ptr(),
                     torch.get_num_threads())
    return h


def silu_mul(gu: torch.Tensor, n: int) -> torch.Tensor | None:
    """SiLU(gu[:, :n]) * gu[:, n:] of gu [M, 2n] (a stacked gate and up projection) in one pass,
    as the kernel's glu epilogue computes it; None where the kernel does not take it."""
    lib = load()[0]
    if lib is None or gu.dim() != 2 or gu.shape[1] != 2 * n or not _plain(gu):
        return None
    y = gu.new_empty(gu.shape[0], n)
    lib.rl2_silu_mul(gu.data_ptr(), gu.shape[0], n, y.data_ptr(), torch.get_num_threads())
    return y


def rope_(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The first `heads` heads of y [M, N] rotated in place, as HF's apply_rotary_pos_emb rotates
    a head (the same arithmetic, bit for bit; cos, sin [M, head_dim], head_dim a multiple of
    32); y, or None (y untouched) where the kernel does not take these tensors."""
    lib = load()[0]
    d = cos.shape[-1]
    if (lib is None or y.dim() != 2 or cos.shape != (y.shape[0], d) or sin.shape != cos.shape
            or d % 32 or heads * d > y.shape[1] or not _plain(y, cos, sin)):
        return None
    ld = y.shape[1]
    lib.rl2_rope(y.data_ptr(), ld, d, y.data_ptr(), ld, y.shape[0], heads, d, cos.data_ptr(),
                 sin.data_ptr(), 0, torch.get_num_threads())
    return y


def transpose(x: torch.Tensor) -> torch.Tensor | None:
    """x.t().contiguous() of a 2-d fp32 x whose rows are contiguous (any row stride), in one
    blocked pass; None where the kernel does not take it."""
    lib = load()[0]
    if (lib is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu"
            or (x.shape[1] > 1 and x.stride(1) != 1) or x.is_neg()  # the bytes are copied as they are
            or type(x) not in (torch.Tensor, torch.nn.Parameter)):  # not a DTensor / subclass
        return None
    y = x.new_empty(x.shape[1], x.shape[0])
    if x.numel():
        lib.rl2_transpose(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), y.data_ptr(),
                          x.shape[0], torch.get_num_threads())
    return y
