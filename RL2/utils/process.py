"""Processes that stop with their parent: when torchrun's agent (or the trainer, for env workers)
dies, its children must not run on, finish the job and write `final/` after the user stopped it.
torch-elastic starts each worker in its own session, so killing the agent's process group does
not reach them. Also: a free port for a process to listen on (`free_port`,
`port_below_ephemeral`)."""
import os
import random
import signal
import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now (bound to port 0 and released: another process
    may take it before the caller binds it, so callers that can retry do)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_below_ephemeral(slot: int = 0, slots: int = 1, low: int = 22000, high: int = 29999,
                         host: str = "0.0.0.0") -> int:
    """A port that bound free just now, drawn from slice `slot` of `slots` of [low, high].
    A port from `free_port` lies in the kernel's ephemeral range (32768-60999 by default), where
    any outgoing connection (a gloo pair, a TCPStore client) may take it before the caller
    binds; below that range only explicit binds compete, and callers given disjoint slices
    (engines of one host, test workers) never draw the same port (others draw at random from
    the whole range). `free_port` when the whole sample of the slice is busy."""
    slots = max(1, slots)
    width = (high - low + 1) // slots
    start = low + min(max(slot, 0), slots - 1) * width
    for port in random.Random().sample(range(start, start + width), min(width, 64)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port("127.0.0.1" if host == "0.0.0.0" else host)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl
    PR_SET_PDEATHSIG); elsewhere a daemon thread polls the parent pid. Exits at once if the
    parent is already gone."""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError):
        import threading

        def watch():
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), sig)

        threading.Thread(target=watch, daemon=True, name="rl2-parent-watch").start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


def die_with_torchrun_agent() -> None:
    """In a process started by torchrun (TORCHELASTIC_RUN_ID is set), exit when the agent dies."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(signal.SIGKILL)


_KEEP_FREED = False
# glibc's mmap threshold as keep_freed_memory sets it: malloc blocks below it are reused
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed blocks for reuse instead of handing them back to the OS.

    By default glibc maps blocks above its threshold (128 KB, raised as mapped blocks are freed)
    and unmaps them on free, and trims the heap's free top, so every step's activations and
    gradients (hundreds of MB) come back as fresh pages: ~77k page faults, ~0.15-0.2 s of system
    time in a 1.3 s policy update of the 25.7M model with 2 threads (benchmarks/README.md, fix
    38). Each malloc arena of the process (and of children forked after) keeps its peak instead,
    as PyTorch's CUDA caching allocator does on a GPU. True when applied (glibc only); once a
    process."""
    global _KEEP_FREED
    if _KEEP_FREED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    # 32 MB, the ceiling of glibc's own dynamic threshold on 64-bit. Bigger blocks (a large
    # vocabulary's logits) still fault anew: here a 64 MB block did so with a 1 GB threshold too.
    _KEEP_FREED = bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, 2 ** 31 - 1))
    return _KEEP_FREED


# Entries of oneDNN's primitive cache and of ideep's (PyTorch's oneDNN wrapper) descriptor cache:
# a few shapes' worth (one micro-batch's token count T makes ~25 entries: each linear shape's
# forward, input- and weight-gradient products)
ONEDNN_CACHE_ENTRIES = 256


def cap_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> None:
    """Bound the memory that oneDNN's caches keep. On the CPU every new token count of a
    micro-batch makes new entries for every linear product (~0.65 MB an entry here, ideep's and
    oneDNN's together) and both caches hold 1024 by default: a GRPO run, whose micro-batches vary
    in length, grew its resident memory by ~15 MB a step, towards ~0.65 GB more
    (benchmarks/README.md, fix 49). Its steps were as fast with 64 entries. Read when oneDNN
    first runs: call before any oneDNN op; a value set in the environment is kept (oneDNN also
    reads its older name, DNNL_PRIMITIVE_CACHE_CAPACITY)."""
    if entries < 1:  # ideep crashes on its first product with LRU_CACHE_CAPACITY=0
        raise ValueError(f"cap_onednn_caches: entries must be >= 1, got {entries}")
    if "DNNL_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))
