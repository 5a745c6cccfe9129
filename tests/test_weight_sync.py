"""Weight sync from every training layout: after an update, the engine samples with exactly the
trainer's weights (engine log-probs == trainer log-probs of the same tokens)."""
import asyncio

import pytest
import torch

from tests.dist_utils import run_dist
from tests.run_utils import layout as layout_of

TEMPERATURE = 0.7
NAMES = ["serial", "fsdp2", "tp2", "sp2", "ddp2xtp2"]  # of tests/run_utils.LAYOUTS


def layouts(fast: set[str]):
    """Every layout in the full suite; those in `fast` also in the fast subset."""
    return pytest.mark.parametrize("world,layout", [
        pytest.param(*layout_of(name), marks=() if name in fast else pytest.mark.slow) for name in NAMES],
        ids=NAMES)


LAYOUTS = layouts({"fsdp2", "tp2"})


def _sync_and_compare(rank, world, model_dir, data_path, layout):
    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows
    from RL2.rollout.engine import SamplingParams
    from RL2.rollout.torch_engine import TorchEngine
    from RL2.rollout.weight_sync import WeightSync
    from RL2.algorithms.sft import sft_update
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor
    from transformers import AutoTokenizer

    cfg = load_config("sft", [f"actor.model_name={model_dir}", f"data.train.path={data_path}",
                              "actor.lr=1e-2", *layout])
    tok = AutoTokenizer.from_pretrained(model_dir)
    actor = Actor(cfg.actor, "cpu", total_steps=1)
    rows = load_rows(data_path)
    batch = [tokenize_sft(rows[i], tok, max_length=256, row_index=i, source="x") for i in range(8)]
    sft_update(actor, batch)  # weights now differ from the checkpoint on disk

    engine = TorchEngine(model_dir, tok)
    stale = {n: p.clone() for n, p in engine.model.state_dict().items()}
    metrics = WeightSync(actor.model, "auto", 512)(engine)
    changed = any(not torch.equal(stale[n], p) for n, p in engine.model.state_dict().items())

    prompts = [tok.apply_chat_template([{"role": "user", "content": rows[i]["prompt"]}],
                                       add_generation_prompt=True, tokenize=False) for i in range(4)]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]

    async def gen():
        return await asyncio.gather(*[
            engine.generate(ids, SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, seed=i))
            for i, ids in enumerate(prompt_ids)])

    outs = asyncio.new_event_loop().run_until_complete(gen())
    samples = []
    for ids, (out,) in zip(prompt_ids, outs):
        full = ids + out.token_ids
        mask = torch.zeros(len(full) - 1)
        mask[len(ids) - 1:] = 1
        samples.append({"input_ids": torch.tensor(full[:-1]), "labels": torch.tensor(full[1:]),
                        "action_mask": mask})
    trainer_logps = actor.compute_logps(samples, temperature=TEMPERATURE)
    max_err = 0.0
    for ids, (out,), lp in zip(prompt_ids, outs, trainer_logps):
        got = lp[len(ids) - 1:]
        max_err = max(max_err, (got - torch.tensor(out.logprobs)).abs().max().item())
    return {"changed": changed, "max_err": max_err, "bytes": metrics["sync_bytes"]}


@LAYOUTS
def test_engine_logps_match_trainer_after_sync(assets, world, layout):
    results = run_dist(_sync_and_compare, world, assets["model"],
                       f"{assets['data']}/sft_train.jsonl", layout)
    for r in results:
        assert r["changed"]
        assert r["max_err"] < 1e-5, r
        assert r["bytes"] > 0


def full_tensors(model):
    """The reference: DTensor's own all-gather, one per parameter and buffer."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _transports_agree(rank, world, model_dir, data_path, layout):
    """Every transport yields exactly DTensor's all-gathered tensors, over several buckets and
    across consecutive syncs (the shared buckets alternate)."""
    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows
    from RL2.rollout.torch_engine import TorchEngine
    from RL2.rollout.weight_sync import WeightSync
    from RL2.algorithms.sft import sft_update
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor
    from transformers import AutoTokenizer

    cfg = load_config("sft", [f"actor.model_name={model_dir}", f"data.train.path={data_path}",
                              "actor.lr=1e-2", *layout])
    tok = AutoTokenizer.from_pretrained(model_dir)
    actor = Actor(cfg.actor, "cpu", total_steps=2)
    rows = load_rows(data_path)
    batch = [tokenize_sft(rows[i], tok, max_length=256, row_index=i, source="x") for i in range(8)]
    expected_transport = "local" if world == 1 else "shm"
    syncs = {t: WeightSync(actor.model, t, bucket_mb=0.05)
             for t in ("auto", "gather", "shm" if world > 1 else "local")}
    assert syncs["auto"].transport == expected_transport
    engine, engine_sync = TorchEngine(model_dir, tok), WeightSync(actor.model)
    report = {"buckets": None, "mismatch": [], "bf16_ok": True}
    for step in range(2):
        sft_update(actor, batch)  # new weights before each sync
        ref = {n: t.clone() for n, t in full_tensors(actor.model)}
        for name, sync in syncs.items():
            got = {n: t.clone() for n, t in sync.stream()}
            if list(got) != list(ref) or any(not torch.equal(got[n], ref[n]) for n in ref):
                report["mismatch"].append((step, name))
        engine_sync(engine)  # multi-rank: the engines use the shared weights themselves
        got = engine.model.state_dict()
        if any(not torch.equal(got[n], ref[n]) for n in ref):
            report["mismatch"].append((step, "engine"))
        if world > 1:
            report["buckets"] = syncs["shm"]._regions[-1].bucket + 1
    report["mode"] = engine_sync.mode
    report["gather_buckets"] = len(syncs["gather"]._pieces)
    # Writing into a sharing engine gives it its own copy: the trainer's weights (aliased on one
    # rank) stay intact, and the next sync shares again.
    engine.update_weights((n, torch.zeros_like(t)) for n, t in ref.items())
    intact = all(torch.equal(t, ref[n]) for n, t in full_tensors(actor.model))
    engine_sync(engine)
    got = engine.model.state_dict()
    report["unshared_ok"] = intact and all(torch.equal(got[n], ref[n]) for n in ref)
    half = WeightSync(actor.model, dtype=torch.bfloat16)
    got = dict(half.stream())
    report["bf16_ok"] = all(got[n].dtype == (torch.bfloat16 if ref[n].is_floating_point() else ref[n].dtype)
                            and torch.equal(got[n], ref[n].to(got[n].dtype)) for n in ref)
    # a bf16 engine (actor.rollout.torch.dtype): it gets the cast weights (one rank: copied; more:
    # it uses the cast shared buckets), and the trainer's fp32 weights stay as they were
    engine16, half = TorchEngine(model_dir, tok, dtype="bfloat16"), WeightSync(actor.model, dtype=torch.bfloat16)
    half(engine16)  # as the trainer does it: the first call decides the mode
    got = engine16.model.state_dict()
    report["bf16_engine_ok"] = all(torch.equal(got[n], ref[n].to(got[n].dtype)) for n in ref) and all(
        torch.equal(t, ref[n]) for n, t in full_tensors(actor.model))
    report["bf16_mode"] = half.mode
    return report


@layouts({"fsdp2"})  # tp2's shards reach the engine in the fast set's log-prob test
def test_weight_sync_transports_agree(assets, world, layout):
    results = run_dist(_transports_agree, world, assets["model"],
                       f"{assets['data']}/sft_train.jsonl", layout)
    for r in results:
        assert r["mismatch"] == [], r
        assert r["bf16_ok"], r
        assert r["bf16_engine_ok"], r
        assert r["bf16_mode"] == ("shared" if world > 1 else None), r  # one rank: a cast copy
        assert r["mode"] == ("shared" if world > 1 else "aliased"), r
        assert r["unshared_ok"], r
        assert r["gather_buckets"] > 1, r
        if world > 1:
            assert r["buckets"] > 1, r  # the small bucket size really split the model


def _shm_setup_fails(rank, world):
    """Rank 0 cannot create the pipes: every rank gets the error (no hang), nothing is left."""
    import glob
    import os

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from RL2.parallel.fsdp import parallelize
    from RL2.parallel.mesh import ParallelDims
    from RL2.rollout.weight_sync import WeightSync

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    parallelize(model, ParallelDims(world, 1, 1, 1, "cpu"), param_dtype=torch.float32)
    sync = WeightSync(model, "shm")
    if rank == 0:
        def broken(*args, **kwargs):
            raise OSError("no pipes here")
        os.mkfifo = broken
    try:
        list(sync.stream())
        error = None
    except RuntimeError as e:
        error = str(e)
    import torch.distributed as dist
    dist.barrier()
    pid = [os.getpid()]
    dist.broadcast_object_list(pid, src=0)
    return {"error": error, "left": glob.glob(f"/dev/shm/rl2-weight-sync-{pid[0]}-*")}


def test_shm_setup_failure_reaches_every_rank_and_cleans_up():
    for r in run_dist(_shm_setup_fails, 2):
        assert r["error"] and "no pipes here" in r["error"], r
        assert r["left"] == [], r
