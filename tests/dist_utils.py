"""Run a function in N real gloo processes (no mocked process groups)."""
import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from RL2.utils.process import port_below_ephemeral


def free_port() -> int:
    """A port for a test's server or rendezvous: below the ephemeral range (an OS-chosen free
    port can be taken by another worker's gloo connection before torchrun binds it: CI saw
    EADDRINUSE), in this xdist worker's own slice of 10000-21999."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    slot = int(worker[2:]) if worker[2:].isdigit() else 0
    slots = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return port_below_ephemeral(slot, slots, low=10000, high=21999, host="127.0.0.1")


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # A barrier before teardown avoids aborts at exit after P2P on gloo.
        dist.barrier()
        queue.put((rank, True, result))
    except Exception:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_dist(fn, world_size: int, *args, timeout: float = 300.0):
    """Run module-level `fn(rank, world_size, *args)` on `world_size` gloo ranks.

    Returns the per-rank return values (ordered by rank); re-raises the first failure with the
    remote traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.02)
            continue
        rank, ok, value = queue.get()
        if ok:
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    for p in procs:
        p.join(timeout=5 if errors else max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    if len(results) < world_size:
        raise RuntimeError(f"distributed test: only ranks {sorted(results)} of {world_size} finished")
    return [results[r] for r in range(world_size)]
