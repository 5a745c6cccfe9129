"""Stopping a job stops it: killing torchrun's process group leaves no trainer worker (they run in
their own sessions, so the group kill does not reach them) and no env worker process."""
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.dist_utils import free_port


def pids_with(needle: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `needle`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out.append(int(pid))
    return out


@pytest.mark.slow
def test_killing_the_torchrun_group_leaves_no_worker(assets, tmp_path):
    # A long SFT run on 2 ranks; the run directory in the command line identifies its processes.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "RL2.trainer.sft", f"actor.model_name={assets['model']}",
           f"data.train.path={assets['data']}/sft_train.jsonl", "data.train.batch_size=8",
           "trainer.total_steps=100000", f"trainer.save_dir={tmp_path}", "trainer.device=cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    agent = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # the workers are training
            assert agent.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        workers = [p for p in pids_with(f"trainer.save_dir={tmp_path}") if p != agent.pid]
        assert len(workers) == 2
        os.killpg(agent.pid, signal.SIGKILL)  # what a scheduler or `kill -9 -PGID` does
        agent.wait()
        deadline = time.monotonic() + 10
        while pids_with(f"trainer.save_dir={tmp_path}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids_with(f"trainer.save_dir={tmp_path}") == []
        assert not (tmp_path / "run" / "final").exists()
    finally:
        for pid in pids_with(f"trainer.save_dir={tmp_path}"):
            os.kill(pid, signal.SIGKILL)


def test_vllm_shm_cleanup_keeps_files_a_live_process_maps(tmp_path):
    """tests/vllm/vllm_utils.py removes a stopped server's orphaned /dev/shm files while other
    test files' servers may be running: a semaphore or queue that a live process maps must stay.
    A multiprocessing semaphore is the hard case: glibc's sem_open maps a temporary file and
    links it to the name afterwards, so /proc/PID/maps never shows the name."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    from tests.vllm.vllm_utils import SHM, _remove_orphans, _shm_files

    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm here")
    before = _shm_files()
    lock = mp.get_context("spawn").Lock()  # sem.mp-*, mapped under a temporary name
    sem = "sem" + lock._semlock.name.replace("/", ".")
    queue = shared_memory.SharedMemory(name=f"psm_rl2test{os.getpid()}", create=True, size=4096)
    orphan = f"sem.mp-rl2orphan{os.getpid()}"
    with open(os.path.join(SHM, orphan), "wb") as f:  # made and left, as by a SIGKILLed server
        f.write(b"\0" * 32)
    try:
        assert {sem, queue.name, orphan} <= _shm_files() - before
        _remove_orphans(before)
        left = _shm_files()
        assert sem in left and queue.name in left, "a live process's file was removed"
        assert orphan not in left
        with lock:  # still usable
            pass
    finally:
        queue.close()
        queue.unlink()
        if os.path.exists(os.path.join(SHM, orphan)):
            os.unlink(os.path.join(SHM, orphan))


def test_test_ports_lie_below_the_ephemeral_range_in_the_workers_own_slice(monkeypatch):
    """A port the OS picked (bind to 0) lies in the ephemeral range, where another worker's gloo
    connection took it before torchrun bound it (CI: EADDRINUSE on --master_port). Test ports
    come from below that range, each xdist worker from its own slice."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for worker in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        ports = {free_port() for _ in range(20)}
        assert all(10000 + 4000 * worker <= p < 14000 + 4000 * worker < ephemeral_low for p in ports)
        assert len(ports) > 1  # drawn at random, not the same port each call


def test_keep_freed_memory_reuses_freed_blocks_without_new_page_faults():
    # a fresh process (the setting is process-wide): ~280 MB of 4-16 MB blocks, freed, then asked
    # for again, as each step's activations are. The reference is glibc's malloc with its
    # initial thresholds pinned (128 KB; its dynamic ones depend on what was freed before, so
    # the default's faults vary: ~115k a round in a 2-thread update-like loop, 4k in another):
    # every round maps and faults its pages anew; kept, they are reused
    code = textwrap.dedent("""
        import ctypes, resource, torch
        from RL2.utils.process import keep_freed_memory

        def faults():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(2):
                blocks = [torch.ones(1 << (20 + i % 3)) for i in range(30)]
                del blocks
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        libc = ctypes.CDLL(None)
        assert libc.mallopt(-3, 128 << 10) and libc.mallopt(-1, 128 << 10)  # mmap, trim thresholds
        faults()
        default = faults()
        assert keep_freed_memory() and keep_freed_memory()
        faults(), faults()  # the heap grows to the blocks' peak (from mapped blocks: two rounds)
        print(default, faults())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    default, kept = map(int, out.stdout.split())
    assert default > 50000 and kept < 500, (default, kept)


_CACHE_KEYS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _glibc_mallinfo2() -> bool:
    try:
        import ctypes
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or platform.machine() != "x86_64"
                    or not _glibc_mallinfo2(),
                    reason="measured with x86 oneDNN and glibc's mallinfo2")
def test_cap_onednn_caches_bounds_the_memory_new_shapes_keep():
    # a fresh process each (the caches read their capacity once): products of 80 token counts,
    # each new to oneDNN; the memory malloc hands out grows with every new shape by default and
    # stops growing once the capped caches are full
    code = textwrap.dedent("""
        import ctypes, sys, torch
        from RL2.utils.process import cap_onednn_caches

        class Info(ctypes.Structure):  # glibc's struct mallinfo2
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                        "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = Info
        if sys.argv[1] == "capped":
            cap_onednn_caches(8)
        torch.set_num_threads(1)
        w = torch.randn(256, 128)
        for t in range(40, 80):
            torch.ops.mkldnn._linear_pointwise(torch.randn(t, 128), w, None, "none", [], "")
        before = libc.mallinfo2().uordblks
        for t in range(80, 120):
            torch.ops.mkldnn._linear_pointwise(torch.randn(t, 128), w, None, "none", [], "")
        print(libc.mallinfo2().uordblks - before)
    """)
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_KEYS}
    grown = {}
    for mode in ("default", "capped"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        grown[mode] = int(out.stdout)
    assert grown["default"] > 40 * 50_000 and grown["capped"] < 1_000_000, grown


@pytest.mark.parametrize("user", [{"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32"},
                                  {"DNNL_PRIMITIVE_CACHE_CAPACITY": "32"}, {"LRU_CACHE_CAPACITY": "32"}])
def test_init_distributed_caps_onednn_caches_on_the_cpu_keeping_a_users_value(user):
    code = ("import os\nfrom RL2.parallel.mesh import init_distributed\ninit_distributed('cpu')\n"
            "print(*(os.environ.get(k, '-') for k in %r))" % (_CACHE_KEYS,))
    # a fresh single process: none of a launcher's rendezvous variables
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_KEYS + (
        "MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, **user})
    assert out.returncode == 0, out.stderr[-2000:]
    expected = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "DNNL_PRIMITIVE_CACHE_CAPACITY": "-",
                "LRU_CACHE_CAPACITY": "256", **user}
    if "DNNL_PRIMITIVE_CACHE_CAPACITY" in user:  # oneDNN's older name: honoured, not overridden
        expected["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "-"
    assert out.stdout.split() == [expected[k] for k in _CACHE_KEYS]
    from RL2.utils.process import cap_onednn_caches
    with pytest.raises(ValueError, match=">= 1"):
        cap_onednn_caches(0)
