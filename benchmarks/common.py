"""Shared pieces of the benchmark scripts: device/threads set-up, the seeded length workload,
matmul peak, model configs, medians and markdown tables."""
import os
import platform
import statistics
import time

import torch

from RL2.utils import onednn

# Model sizes used across benchmarks (hidden, layers, heads, kv_heads, intermediate), with the
# 512-token byte-level BPE of RL2.tools.make_assets: ~1M and ~25M parameters (tied embeddings).
MODEL_SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    "1M": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512),
    "4M": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768),
    "25M": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
}


def setup_threads(threads: int | None, device: str) -> int:
    """One intra-op thread per process on CPU by default: on a shared 2-core machine two OpenMP
    threads were measured *slower* than one (they spin on each other under load)."""
    if threads is None:
        threads = 1 if device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def pick_device(name: str = "auto") -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def sample_lengths(n: int, seed: int = 0, lo: int = 20, hi: int = 1000, median_len: float = 150.0,
                   sigma: float = 0.9) -> list[int]:
    """Realistic SFT/RL length spread: log-normal (most sequences short, a long tail) clipped to
    [lo, hi]. With the defaults: median ~150, mean ~220, ~3% at the 1000 cap."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * sigma) * median_len
    return [int(min(hi, max(lo, round(x)))) for x in raw.tolist()]


def matmul_peak(device: str, dtype: torch.dtype, size: int | None = None, repeats: int = 5,
                clock=time.perf_counter) -> float:
    """FLOP/s of a square matmul on this device/dtype/thread count (median of `repeats`), timed
    with `clock` (time.process_time measures it without other tenants' load on a shared CPU).
    On the CPU the faster of PyTorch's BLAS (MKL on x86) and oneDNN: on AMD CPUs MKL's fp32
    sgemm runs without AVX-512, at ~40% of what the cores do through oneDNN."""
    size = size or (4096 if device == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    inner = 10 if device == "cuda" else 3
    products = [lambda: a @ b]
    if device == "cpu" and onednn.available() and dtype in (torch.float32, torch.bfloat16):
        products.append(lambda: onednn.linear(a, b))
    rates = []
    for product in products:
        product()
        sync(device)
        times = []
        for _ in range(repeats):
            start = clock()
            for _ in range(inner):
                product()
            sync(device)
            times.append((clock() - start) / inner)
        rates.append(2 * size ** 3 / median(times))
    return max(rates)


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats get a sensible number of digits."""
    def fmt(v):
        if isinstance(v, float):
            if v != v:
                return "n/a"
            if abs(v) >= 1000:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            if abs(v) >= 0.01 or v == 0:
                return f"{v:.3f}"
            return f"{v:.2e}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_description(device: str, threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f}"
    gpu = f", GPU {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (f"{os.cpu_count()} CPU cores ({cpu}){gpu}{load}; torch {torch.__version__}; "
            f"device {device}, {threads} intra-op thread(s) per process")


def params_of(model) -> int:
    """Parameter count with tied weights counted once."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n
