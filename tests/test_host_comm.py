"""FSDP's CPU collectives through shared memory (RL2/parallel/host_comm.py) against gloo's: the
same bytes for all-gathers, the same sums for reduce-scatters, the same gradients for an FSDP
model, and the fallbacks (other reductions, inputs over the size cap) go to gloo."""
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_dist


def _collectives(rank, world):
    from RL2.parallel.host_comm import HostAllGather, HostReduceScatter

    group = dist.new_group(list(range(world)))  # a subgroup, as FSDP's mesh groups are
    gather, scatter = HostAllGather(max_bytes=1 << 20), HostReduceScatter(max_bytes=1 << 20)
    torch.manual_seed(rank)
    results = []
    for n in (5, 1000, 7):  # the file grows at the second size; odd sizes
        x = torch.randn(n)
        out, ref = torch.empty(n * world), torch.empty(n * world)
        assert gather(out, x, group) is None  # done on return: FSDP waits only on a Work
        dist.all_gather_into_tensor(ref, x, group=group)
        results.append(torch.equal(out, ref))
        full = torch.randn(n * world, dtype=torch.float64)
        got, want = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        scatter(got, full, group, op=dist.ReduceOp.SUM)
        dist.reduce_scatter_tensor(want, full, group=group)
        # the sum in rank order, from every rank's input
        inputs = [torch.empty_like(full) for _ in range(world)]
        dist.all_gather(inputs, full, group=group)
        ordered = inputs[0].view(world, n)[rank].clone()
        for r in range(1, world):
            ordered += inputs[r].view(world, n)[rank]
        results.append((torch.equal(got, ordered), torch.allclose(got, want, rtol=1e-12)))
    host = gather.groups[group.group_name]
    shared = host is scatter.groups[group.group_name]  # one file for both collectives of a group
    served = gather.calls + scatter.calls
    # MAX is not summed in shared memory: gloo's result, nothing served
    full = torch.arange(4.0 * world) * (rank + 1)
    got, want = torch.empty(4), torch.empty(4)
    scatter(got, full, group, op=dist.ReduceOp.MAX)
    dist.reduce_scatter_tensor(want, full, op=dist.ReduceOp.MAX, group=group)
    results.append(torch.equal(got, want))
    # over the size cap (1 MiB for every rank's slot): gloo's collective
    big = torch.full((1 << 18,), float(rank))
    out = torch.empty(big.numel() * world)
    gather(out, big, group)
    results.append(torch.equal(out, torch.arange(world).float().repeat_interleave(big.numel())))
    return results + [shared], served, gather.calls + scatter.calls


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_shared_memory_collectives_equal_gloo(world):
    for results, served, after in run_dist(_collectives, world):
        assert all(r is True or r == (True, True) for r in results), results
        assert served == 6 and after == served  # every call of the first loop; no fallback served


def _buffers(rank, world):
    from RL2.parallel.host_comm import HostAllGather, HostReduceScatter

    gather = HostAllGather()
    a = gather.allocate((4, 3), dtype=torch.float32, device=torch.device("cpu"))
    b = gather.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    held_apart = a.data_ptr() != b.data_ptr()  # a is still held
    ptr, view = b.data_ptr(), b[2:]
    del a, b
    c = gather.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    d = gather.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    # the first buffer is free again; the second is still held through a view of it
    reused = c.data_ptr() != ptr and d.data_ptr() not in (ptr, c.data_ptr())
    del view
    e = gather.allocate((3, 4), dtype=torch.float32, device=torch.device("cpu"))
    reused = reused and e.data_ptr() == ptr and e.shape == (3, 4)
    del c, d, e
    gather.trim()  # after a step: nothing kept (held buffers live on with their holders)
    reused = reused and gather.pool == {}

    # the reduce-scatter's input is this rank's slot once the group is known; its output never
    scatter, group, sums = HostReduceScatter(), dist.new_group(list(range(world))), []
    for step in range(2):
        full = scatter.allocate((2 * world,), dtype=torch.float32, device=torch.device("cpu"))
        out = scatter.allocate((2,), dtype=torch.float32, device=torch.device("cpu"))
        full.copy_(torch.arange(2.0 * world) + 10 * rank)
        scatter(out, full, group)
        sums.append(out.tolist())
    host = scatter.groups[group.group_name]
    in_file = full.data_ptr() == host.file.buffer[rank * 8 * world:].data_ptr()
    in_slot = scatter.in_slot  # the second call's input only
    # an output in the file (allocations out of the order FSDP keeps) is refused, not used
    bad = scatter.allocate((2 * world,), dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="reduce-scatter output in the shared file"):
        scatter(bad[:2], full, group)
    return held_apart, reused, sums, in_slot, in_file


def test_collective_buffers_are_reused_once_free_and_gradients_go_into_the_slot():
    """Fresh buffers cost page faults at every first touch: FSDP's buffers come from a pool,
    handed out again only when nothing (no view either) holds them. The reduce-scatter input
    is this rank's slot of the shared file from the second call on (the group is known)."""
    for rank, (held_apart, reused, sums, in_slot, in_file) in enumerate(run_dist(_buffers, 2)):
        want = [2 * rank + 10 + 2 * rank, 2 * rank + 1 + 10 + 2 * rank + 1]
        assert held_apart and reused and in_slot == 1 and in_file
        assert sums == [want, want]


def _reuse_agreed(rank, world):
    from RL2.parallel.host_comm import shared_group

    group = dist.new_group(list(range(world)))
    host = shared_group(group, "test comm")
    host.publish(torch.ones(4))  # its file exists: a rank left on it would wait at its barrier
    host.release()
    # rank 0 still holds the old group (its last holder not yet collected), the others do not
    keep = host if rank == 0 else None
    del host
    again = shared_group(group, "test comm")
    slots = again.publish(torch.full((4,), float(rank)))
    got = slots.view(torch.float32).view(world, 4)[:, 0].tolist()
    again.release()
    return again is not keep, got


def test_a_shared_group_freed_on_some_ranks_only_is_made_anew_on_all():
    """Whether a rank still has the shared group depends on when its garbage collector ran:
    reuse is decided by all ranks together (else rank 0 waited at the old file's barrier while
    rank 1 built a new group)."""
    for fresh, got in run_dist(_reuse_agreed, 2, timeout=120):
        assert fresh and got == [0.0, 1.0]


def _sharded_model(world, **kw):
    """A 2-layer Qwen2 (3 FSDP units: the layers and the root) sharded over `world` ranks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from RL2.parallel.fsdp import parallelize
    from RL2.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    kw.setdefault("param_dtype", torch.float32)
    parallelize(model, ParallelDims(world), **kw)
    return model


def _gathers(model) -> int:
    """All-gathers served through shared memory so far (this rank)."""
    return model._rl2_host_comms[0].calls


def _fsdp_grads(rank, world, cpu_comm, reshard_after_forward=True):
    from RL2.parallel import host_comm

    model = _sharded_model(world, cpu_comm=cpu_comm, reshard_after_forward=reshard_after_forward)
    torch.manual_seed(1 + rank)  # each rank its own batch, as data parallelism has it
    ids = torch.randint(0, 96, (2, 12))
    for _ in range(2):  # a second step reuses the file
        model.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}  # by value
    if cpu_comm == "shm":
        # gradients went straight into the shared file from the second reduce-scatter on (the
        # first one tells its group): 3 units x 2 steps - 1
        assert model._rl2_host_comms[1].in_slot == 5
        # all-gather outputs in the gather regions from the second all-gather on (FSDP holds
        # the last forward output until the next copy-out: the two regions take turns)
        gather = model._rl2_host_comms[0]
        assert gather.region.taken == _gathers(model) - 1
        # trimmed after a step the regions stay; a second trim with no all-gather between
        # (a frozen model, gathered once) lets them go
        host_comm.trim(model)
        kept = gather.region is not None
        host_comm.trim(model)
        assert kept and gather.region is None
    return grads, host_comm.served(model), _gathers(model) if cpu_comm == "shm" else 0


def test_fsdp_gradients_through_shared_memory_equal_gloo():
    shm = run_dist(_fsdp_grads, 2, "shm")
    gloo = run_dist(_fsdp_grads, 2, "gloo")
    for (g_shm, served, _), (g_gloo, none, _) in zip(shm, gloo):
        assert served > 0 and none == 0  # a silent fallback to gloo would pass the comparison
        for name in g_gloo:
            assert g_shm[name] == g_gloo[name], name


def _units(rank, world, dtype):
    from torch.distributed.tensor import DTensor

    from RL2.parallel.fsdp import fsdp_units

    from RL2.utils.checkpoint import full_state_dict

    model = _sharded_model(world, param_dtype=dtype)
    live = {p.to_local().data_ptr() if isinstance(p, DTensor) else p.data_ptr()
            for p in model.parameters()}
    state = full_state_dict(model)  # a copy to export, never the live parameters
    assert state if rank == 0 else not state
    assert not any(v.data_ptr() in live for v in state.values())
    return len(fsdp_units(model)), any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.slow  # three launches
def test_one_cpu_rank_in_its_compute_dtype_skips_fsdp():
    """FSDP on a one-rank CPU mesh only copies (every parameter before the forward, every
    gradient twice after the backward): such a model stays plain. A second rank, or a compute
    dtype other than the parameters' (FSDP's mixed-precision cast), keeps FSDP's 3 units. The
    numbers are the same either way: the parallel == serial tests compare one-process runs
    (plain) with multi-process ones (FSDP)."""
    assert run_dist(_units, 1, torch.float32) == [(0, False)]
    assert run_dist(_units, 1, torch.bfloat16) == [(3, True)]
    assert run_dist(_units, 2, torch.float32) == [(3, True), (3, True)]


def _frozen_gathers(rank, world, reshard_after_forward):
    model = _sharded_model(world, reshard_after_forward=reshard_after_forward).eval()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        logits = [model(input_ids=ids, use_cache=False).logits for _ in range(3)]
    assert all(torch.equal(lg, logits[0]) for lg in logits)
    return _gathers(model)


@pytest.mark.slow
def test_frozen_model_kept_gathered_is_gathered_once():
    """The DPO/PPO reference inherits the actor's reshard_after_forward: with False its no-grad
    forwards gather each unit once for the run (3 forwards: 9 all-gathers -> 3)."""
    assert run_dist(_frozen_gathers, 2, True) == [9, 9]
    assert run_dist(_frozen_gathers, 2, False) == [3, 3]


@pytest.mark.slow  # two launches; the shm == gloo gradients test stays fast
def test_weights_kept_after_forward_save_the_backward_all_gathers():
    """reshard_after_forward=False (actor.reshard_after_forward): the same gradients with only
    the forward's all-gathers (3 FSDP units: 2 layers + the root, each gathered again in
    backward by default): 2 steps x (3 + 3) -> 2 x 3."""
    again = run_dist(_fsdp_grads, 2, "shm", True)
    kept = run_dist(_fsdp_grads, 2, "shm", False)
    for (g_again, _, n_again), (g_kept, _, n_kept) in zip(again, kept):
        assert (n_again, n_kept) == (12, 6)
        for name in g_again:
            assert g_kept[name] == g_again[name], name


def _regions(rank, world):
    from RL2.parallel.host_comm import GatherRegions

    group = dist.new_group(list(range(world)))
    regions = GatherRegions(group)
    a = regions.take((4, 3), torch.float32)
    b = regions.take((12,), torch.float32)  # a still held: the other region
    first = [a is not None and b is not None, a.data_ptr() != b.data_ptr()]
    none = regions.take((12,), torch.float32)  # both held on every rank
    del a
    c = regions.take((12,), torch.float32)  # a's region is free again
    first += [none is None, c is not None and c.data_ptr() == regions.regions[0].data_ptr()]
    # the all-gather in a region: every rank's copy-in, one barrier, no copy
    c.view(world, -1)[rank] = torch.arange(12 // world, dtype=torch.float32) + 100 * rank
    regions.file.collective()
    gathered = c.tolist()
    del b, c
    # rank 0 alone still holds an output: every rank is told none is free (the flags go
    # through the file), so all take the copying path together and no barrier is missed
    keep = [regions.take((6,), torch.float32), regions.take((6,), torch.float32)]
    if rank != 0:
        keep.clear()
    alike = regions.take((6,), torch.float32) is None
    keep.clear()
    # a bigger unit: a new file; an output still held in the old one stays readable
    old = regions.take((2 * world,), torch.float32)
    old.view(world, -1)[rank] = rank + 1
    dist.barrier(group)
    grown = regions.take((1 << 12,), torch.float32)
    still = old.tolist() == [float(1 + r // 2) for r in range(2 * world)]
    return first, gathered, alike, grown is not None and still, regions.taken


def test_gather_regions_are_handed_out_only_when_no_rank_holds_them():
    """The all-gather output in a shared region (no copy into or out of the comm file) is
    safe only while no rank still reads the region's last output: each take asks every rank
    through the file and all decide alike (a rank that took the copying path alone would
    meet the others at another barrier)."""
    for first, gathered, alike, grown, taken in run_dist(_regions, 2, timeout=120):
        assert first == [True, True, True, True]
        assert gathered == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
        assert alike and grown and taken == 7


def _back_to_back(rank, world):
    from RL2.parallel.host_comm import GatherRegions

    regions, picks = GatherRegions(dist.new_group(list(range(world)))), []

    def pick(t):
        return None if t is None else [r.data_ptr() for r in regions.regions].index(t.data_ptr())
    for _ in range(40):  # takes with no collective between them; each rank holds its own
        a = regions.take((6,), torch.float32)
        b = regions.take((6,), torch.float32)
        picks += [pick(a), pick(b)]
        keep = [a] if rank == 0 else [b] if rank == 1 else []
        del a, b
        picks.append(pick(regions.take((6,), torch.float32)))  # ranks hold different regions
        keep.clear()
    return picks


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gather_regions_agree_on_every_rank_without_a_collective_between_takes(world):
    """FSDP puts a collective between two all-gather allocations, but `take` must not rely on
    it: with one set of flags, a rank that left the barrier first could write its next flags
    before a slower rank had read these, and the ranks then took different regions (a review
    saw 39 of 150 such takes disagree with 2 ranks)."""
    picks = run_dist(_back_to_back, world, timeout=120)
    assert all(len(set(p)) == 1 for p in zip(*picks))
    assert picks[0][:3] == [0, 1, None]


def _foreign_region(rank, world):
    from RL2.parallel.host_comm import HostAllGather

    gather, group, cpu = HostAllGather(), dist.new_group(list(range(world))), torch.device("cpu")
    first = gather.allocate((2 * world,), dtype=torch.float32, device=cpu)  # group unknown: pool
    gather(first, torch.full((2,), float(rank)), group)
    out = gather.allocate((2 * world,), dtype=torch.float32, device=cpu)  # a region now
    out.view(world, 2)[rank] = rank
    gather(out, out.view(world, 2)[rank], group)
    ok = out.tolist() == [float(r // 2) for r in range(2 * world)] and gather.region.taken == 1
    other = gather.allocate((2 * world,), dtype=torch.float32, device=cpu)
    with pytest.raises(RuntimeError, match="shared region that is not this call's"):
        gather(other, torch.zeros(2), group)  # not its chunk: every rank would write it all
    return ok


def test_an_all_gather_into_a_region_it_was_not_given_is_refused():
    assert run_dist(_foreign_region, 2, timeout=120) == [True, True]


def test_reshard_after_forward_auto_keeps_weights_on_cpu_only():
    from RL2.parallel.fsdp import resolve_reshard

    assert [resolve_reshard("auto", d) for d in ("cpu", "cuda")] == [False, True]
    assert [resolve_reshard(v, "cpu") for v in (True, False)] == [True, False]
    with pytest.raises(ValueError, match="reshard_after_forward='no'"):
        resolve_reshard("no", "cpu")


def test_bad_cpu_comm_is_refused_by_name(assets, tmp_path):
    from tests.run_utils import run_trainer, sft_args

    proc = run_trainer("sft", 1, sft_args(assets, "actor.cpu_comm=tcp"), tmp_path, check=False)
    assert proc.returncode != 0 and "cpu_comm='tcp'" in proc.stderr + proc.stdout


def _small_shm(rank, world, shm_dir):
    from RL2.parallel.host_comm import HostAllGather
    from RL2.rollout import shm

    shm.SHM_DIR = shm_dir  # a 1 MiB tmpfs: smaller than the 2 x 1 MiB of slots asked for
    gather = HostAllGather()
    x = torch.full((1 << 18,), float(rank))  # 1 MiB per rank
    out = torch.empty(x.numel() * world)
    gather(out, x, dist.group.WORLD)
    return torch.equal(out, torch.arange(world).float().repeat_interleave(x.numel())), gather.calls


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only: skipped where it cannot be mounted)."""
    import subprocess

    mount = tmp_path / "shm"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                          capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield str(mount)
    subprocess.run(["umount", str(mount)])


def test_a_full_dev_shm_falls_back_to_gloo_instead_of_killing_the_run(small_tmpfs):
    """A shared file bigger than the space left on its tmpfs (Docker's /dev/shm is 64 MB by
    default) used to be created sparse, and the first copy into it killed the process with
    SIGBUS. Its pages are reserved at creation now: creation fails and gloo takes over."""
    for equal, served in run_dist(_small_shm, 2, small_tmpfs):
        assert equal and served == 0


def _growth_in_small_shm(rank, world, shm_dir):
    from RL2.parallel.host_comm import HostAllGather
    from RL2.rollout import shm

    shm.SHM_DIR = shm_dir  # a 1 MiB tmpfs
    gather, results = HostAllGather(), []
    # KiB per rank: a 600 KiB file; the doubled 1200 fails, the 800 needed fits; 2 x 1 MiB
    # fails (gloo), the 800 KiB file is made again; the next 300 KiB are served from it
    for kib in (300, 400, 1024, 300):
        x = torch.full((kib * 256,), float(rank))
        out = torch.empty(x.numel() * world)
        gather(out, x, dist.group.WORLD)
        results.append(torch.equal(out, torch.arange(world).float().repeat_interleave(x.numel())))
    host = gather.groups[dist.group.WORLD.group_name]
    return results, gather.calls, host.file.size >> 10, host.max_bytes >> 10


def test_growth_past_a_small_dev_shm_keeps_the_file_that_fitted(small_tmpfs):
    """With one shared file per set of ranks for every FSDP collective, one input too big for
    /dev/shm must not send all later (smaller) ones to gloo: the file grows only as far as it
    can (the doubling is given up first) and inputs over that size alone go to gloo."""
    for results, served, size, cap in run_dist(_growth_in_small_shm, 2, small_tmpfs):
        assert all(results) and served == 3 and size == cap == 800


def _regions_in_small_shm(rank, world, shm_dir):
    from RL2.parallel.host_comm import HostAllGather
    from RL2.rollout import shm

    shm.SHM_DIR = shm_dir  # a 1 MiB tmpfs: two regions of a 512 KiB unit do not fit
    gather, group, cpu = HostAllGather(), dist.new_group(list(range(world))), torch.device("cpu")
    results = []
    for step in range(3):
        out = gather.allocate((1 << 17,), dtype=torch.float32, device=cpu)
        x = torch.full((out.numel() // world,), float(rank + step))
        out.view(world, -1)[rank] = x
        gather(out, out.view(world, -1)[rank], group)
        results.append(torch.equal(out, (torch.arange(world).float() + step).repeat_interleave(x.numel())))
        del out
        gather.trim()
    return results, gather.region is not None and not gather.region.usable, gather.calls


def test_regions_without_room_in_dev_shm_fall_back_to_the_copying_path(small_tmpfs):
    for results, kept_unusable, served in run_dist(_regions_in_small_shm, 2, small_tmpfs):
        assert all(results) and kept_unusable and served == 3
