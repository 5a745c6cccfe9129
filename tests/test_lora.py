"""LoRA (`actor.lora.*`): the worker's adapters == a PEFT reference model; a bf16 frozen base
under fp32 adapters trains; merged weights == PEFT's merge_and_unload; parallel == serial for
SFT and DPO; DPO's reference is the adapter-free actor (step-0 loss log 2); exact resume; PEFT
export (and its tokenizer) reloads to the trained model; merged weight sync keeps the engine
on-policy; the PPO critic trains its adapters and value head only (`critic.lora.*`)."""
import math
import os

import pytest
import torch

from tests.dist_utils import run_dist
from tests.run_utils import (LENGTH_ENV, assert_close, dpo_args, hf_test_loss, layout, read_metrics,
                             run_trainer, sft_args, train_rows)

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _full(t):
    """The whole tensor: FSDP's DTensor gathered, or a one-rank plain parameter as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _worker_vs_peft(rank, world, model_dir, data_dir):
    from omegaconf import OmegaConf
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import RL2
    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows
    from RL2.utils.checkpoint import full_state_dict
    from RL2.workers.actor import Actor

    cfg = OmegaConf.load(os.path.join(os.path.dirname(RL2.__file__), "config/worker/default.yaml"))
    cfg.model_name, cfg.dtype, cfg.lora.rank, cfg.lora.alpha = model_dir, "float32", 4, 8
    actor = Actor(cfg, "cpu", total_steps=1, seed=0)
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in actor.model.named_parameters() if n in trainable)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at 0 (the adapter is a no-op): make it count
        for n, p in actor.model.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))  # one rank: a plain parameter
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(f"{data_dir}/sft_train.jsonl")
    samples = [tokenize_sft(rows[i], tok, max_length=64, row_index=i, source="t") for i in range(6)]
    (mb,) = actor.plan(samples)
    logps = actor.forward(mb)["logps"]
    (-(logps * mb.data["action_mask"]).sum()).backward()
    grads = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
    state = full_state_dict(actor.model)

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    missing = ref.load_state_dict({f"base_model.model.{k}": v for k, v in state.items()}, strict=False)
    assert not missing.unexpected_keys
    ref_logps = []
    for s in samples:
        out = ref(input_ids=s["input_ids"][None]).logits[0].log_softmax(-1)
        lp = out.gather(-1, s["labels"][:, None])[:, 0]
        ref_logps.append(lp)
        (-(lp * s["action_mask"]).sum()).backward()
    ref_grads = {n.removeprefix("base_model.model."): p.grad for n, p in ref.named_parameters()
                 if p.grad is not None}
    acts = mb.data["action_mask"].bool()  # the log-probs any loss reads (the rest are 0)
    assert torch.allclose(logps.detach()[acts], torch.cat(ref_logps).detach()[acts], atol=1e-5, rtol=1e-5)
    assert not logps[~acts].any()
    assert set(grads) == set(ref_grads) == trainable
    for n, g in grads.items():
        assert (g - ref_grads[n]).norm() <= 1e-5 * ref_grads[n].norm(), n
    return True


def test_forward_backward_equal_a_peft_reference(assets):
    assert run_dist(_worker_vs_peft, 1, assets["model"], assets["data"]) == [True]


def _bf16_base_sft(rank, world, model_dir, data_dir):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    import RL2
    from RL2.algorithms.sft import sft_update
    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows
    from RL2.workers import lora
    from RL2.workers.actor import Actor

    cfg = OmegaConf.load(os.path.join(os.path.dirname(RL2.__file__), "config/worker/default.yaml"))
    cfg.model_name, cfg.dtype, cfg.lr = model_dir, "float32", 1e-2
    cfg.lora.rank, cfg.lora.alpha = 4, 8
    # auto keeps the master dtype on CPU; the explicit key must still give a bf16 base here
    assert lora.base_dtype(cfg.lora, "cpu", torch.float32) == torch.float32
    assert lora.base_dtype(cfg.lora, "cuda", torch.float32) == torch.bfloat16
    cfg.lora.base_dtype = "bfloat16"
    assert lora.base_dtype(cfg.lora, "cpu", torch.float32) == torch.bfloat16
    actor = Actor(cfg, "cpu", total_steps=3, seed=0)

    params = dict(actor.model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    frozen = set(params) - trainable
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {params[n].dtype for n in frozen} == {torch.bfloat16}
    assert {params[n].dtype for n in trainable} == {torch.float32}  # the master dtype
    in_opt = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(params[n]) for n in trainable}
    before = {n: _full(p.detach()).clone() for n, p in params.items()}

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(f"{data_dir}/sft_train.jsonl")
    samples = [tokenize_sft(rows[i], tok, max_length=64, row_index=i, source="t") for i in range(16)]
    losses = [sft_update(actor, samples)["loss"] for _ in range(3)]  # the same batch each step
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    after = {n: _full(p.detach()) for n, p in params.items()}
    assert all(after[n].dtype == torch.bfloat16 and torch.equal(after[n], before[n]) for n in frozen)
    assert all(not torch.equal(after[n], before[n]) for n in trainable if ".lora_B." in n)
    return losses


def test_bf16_frozen_base_under_fp32_adapters_trains(assets):
    """lora.base_dtype=bfloat16 on CPU: the frozen base is stored in bf16 (half the memory), the
    adapters and their AdamW state stay fp32, and SFT steps on it lower the loss."""
    (losses,) = run_dist(_bf16_base_sft, 1, assets["model"], assets["data"])
    assert len(losses) == 3


def test_merged_weights_equal_peft_merge_and_unload(assets):
    """merged_items (engine sync, merged export) == PEFT's merge_and_unload on the same adapters,
    for a causal LM and a value model (whose trained `score` copy must replace the original)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from RL2.workers import lora

    gen = torch.Generator().manual_seed(0)
    for cls, extra in ((AutoModelForCausalLM, {}), (AutoModelForTokenClassification, {"num_labels": 1})):
        model = cls.from_pretrained(assets["model"], dtype=torch.float32, **extra)
        head = ["score"] if cls is AutoModelForTokenClassification else None
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                modules_to_save=head))
        with torch.no_grad():  # B = 0 would make the merge a no-op; the head copy must differ
            for n, p in model.named_parameters():
                if ".lora_" in n or ".modules_to_save." in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        got = dict(lora.merged_items(model.state_dict().items(), lora.scalings(model)))
        want = copy.deepcopy(peft).merge_and_unload().state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        for n, w in want.items():
            assert got[n].dtype == w.dtype == torch.float32, n
            assert torch.allclose(got[n], w, atol=1e-6, rtol=0), n
        # the adapters changed something, so the comparison is not base == base
        base = cls.from_pretrained(assets["model"], dtype=torch.float32, **extra).state_dict()
        assert not torch.allclose(want["model.layers.0.self_attn.q_proj.weight"],
                                  base["model.layers.0.self_attn.q_proj.weight"])


class AdapterSink:
    """Records `Engine.update_adapter` calls by writing each adapter the way the vLLM engines do
    (RL2.workers.lora.write_adapter) into `out_dir/v{n}`."""

    def __init__(self, out_dir):
        self.out_dir, self.paths = out_dir, []

    def update_adapter(self, named_tensors, config):
        from RL2.workers.lora import write_adapter

        self.paths.append(os.path.join(self.out_dir, f"v{len(self.paths) + 1}"))
        write_adapter(self.paths[-1], named_tensors, config)

    def update_weights(self, named_tensors):
        raise AssertionError("adapter-only sync sent full weights")

    def resume_memory(self, tags=None):
        pass


def _adapter_sync(rank, world, model_dir, out_dir):
    """Adapter-only WeightSync from an FSDP2 actor: the written adapter loads with PEFT onto the
    base model and gives the actor's log-probs; only adapter bytes move."""
    from omegaconf import OmegaConf
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import RL2
    from RL2.rollout.weight_sync import WeightSync
    from RL2.utils.checkpoint import full_state_dict
    from RL2.workers.actor import Actor

    cfg = OmegaConf.load(os.path.join(os.path.dirname(RL2.__file__), "config/worker/default.yaml"))
    cfg.model_name, cfg.dtype, cfg.lora.rank, cfg.lora.alpha = model_dir, "float32", 4, 8
    actor = Actor(cfg, "cpu", total_steps=1, seed=0)
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(1)  # the same full tensors on every rank
    with torch.no_grad():
        for n, p in actor.model.named_parameters():
            if ".lora_B." in n:
                full = 0.1 * torch.randn(p.shape, generator=gen)
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements)
                        if hasattr(p, "device_mesh") else full)  # one rank: a plain parameter
    sink = AdapterSink(out_dir) if rank == 0 else None
    sync = WeightSync(actor.model, adapter_only=True)
    metrics = sync(sink)
    state = full_state_dict(actor.model)
    if rank:
        return None
    ids = torch.tensor([[5, 17, 42, 9, 30, 11]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_logits = model(ids).logits
    loaded = PeftModel.from_pretrained(model, sink.paths[0])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    ref.load_state_dict({f"base_model.model.{k}": v for k, v in state.items()}, strict=False)
    adapter_bytes = sum(v.numel() * v.element_size() for k, v in state.items() if ".lora_" in k)
    with torch.no_grad():
        got, want = loaded(ids).logits, ref(ids).logits
    return {"err": (got - want).abs().max().item(), "moved": (got - base_logits).abs().max().item(),
            "bytes": metrics["sync_bytes"], "adapter_bytes": adapter_bytes,
            "model_bytes": sum(v.numel() * v.element_size() for v in state.values())}


@pytest.mark.parametrize("world", [1, 2])
def test_adapter_only_sync_reloads_with_peft_to_the_actor(assets, tmp_path, world):
    res = run_dist(_adapter_sync, world, assets["model"], str(tmp_path))[0]
    assert res["err"] < 1e-5 and res["moved"] > 1e-3, res
    assert res["bytes"] == res["adapter_bytes"] < res["model_bytes"] / 5, res


def test_tensor_parallel_is_refused_at_start_up(assets, tmp_path):
    proc = run_trainer("sft", 2, sft_args(assets, *LORA, "actor.tp_size=2"), tmp_path, check=False)
    assert proc.returncode != 0
    assert "actor.lora.rank > 0 does not compose with actor.tp_size=2" in proc.stderr


def test_lora_sync_mode_and_its_start_up_checks():
    """auto: adapters for an in-process vLLM or SGLang engine, merged weights otherwise (the
    torch engine; servers, which need LoRA flags or are RL2 torch-engine servers); asking
    adapters of an engine that cannot load them, or of remote servers without a shared
    lora_dir, stops the run at start-up, naming the key."""
    from omegaconf import OmegaConf

    from RL2.rollout.rollout import check_lora_sync, lora_sync_mode

    def cfg(**kw):
        return OmegaConf.create({"lora_sync": "auto", "placement": "colocated", "engine": "torch", **kw})

    assert lora_sync_mode(cfg(), "vllm") == lora_sync_mode(cfg(), "sglang") == "adapter"
    # a `vllm serve` needs LoRA flags at start-up: adapters only when asked
    assert lora_sync_mode(cfg(vllm={"server_url": "http://h:1"}), "vllm") == "merged"
    assert lora_sync_mode(cfg(), "torch") == lora_sync_mode(cfg(placement="disaggregated"), "vllm") == "merged"
    assert lora_sync_mode(cfg(lora_sync="adapter", placement="disaggregated"), "vllm") == "adapter"
    assert check_lora_sync(cfg(lora_sync="adapter"), 0, "cpu") == []  # LoRA off: nothing to sync
    (problem,) = check_lora_sync(cfg(lora_sync="adapter"), 4, "cpu")
    assert "actor.rollout.lora_sync=adapter needs an engine that loads LoRA adapters" in problem
    assert check_lora_sync(cfg(lora_sync="adapter", engine="vllm"), 4, "cpu") == []
    assert "use one of" in check_lora_sync(cfg(lora_sync="both"), 4, "cpu")[0]
    remote = cfg(lora_sync="adapter", placement="disaggregated", servers=["10.0.0.7:8000"], lora_dir=None)
    assert "needs actor.rollout.lora_dir" in check_lora_sync(remote, 4, "cpu")[0]
    assert check_lora_sync(cfg(lora_sync="adapter", placement="disaggregated", servers=["127.0.0.1:8000"],
                               lora_dir=None), 4, "cpu") == []


# ----- parallel == serial (the layout grid of tests/run_utils.py, tp excluded) -----
SFT_BUDGETS = {"fsdp2": 64, "sp2": 40, "fsdp4": 64, "ddp2xfsdp2": 96, "dp2xsp2": 40}
DPO_BUDGETS = {"fsdp2": 80, "sp2": 48, "fsdp4": 80, "ddp2xfsdp2": 160, "dp2xsp2": 64}


def cases(budgets):
    """float32 on fsdp2 (fast set); float64 on the other layouts (slow)."""
    return [pytest.param("fsdp2", "float32", 1e-5, id="fsdp2-float32")] + [
        pytest.param(n, "float64", 1e-9, id=f"{n}-float64", marks=pytest.mark.slow)
        for n in budgets if n != "fsdp2"]


@pytest.fixture(scope="module")
def serial(assets, tmp_path_factory):
    runs = {}

    def get(trainer, dtype, unshared=False):
        """unshared: DPO with actor.share_prompt=false, the setting sp layouts run with."""
        if (trainer, dtype, unshared) not in runs:
            d = tmp_path_factory.mktemp(f"lora_{trainer}_{dtype}")
            make = sft_args if trainer == "sft" else dpo_args
            proc = run_trainer(trainer, 1, make(assets, *LORA, f"actor.dtype={dtype}",
                                                "actor.max_length_per_device=4096",
                                                *(["actor.share_prompt=false"] if unshared else [])), d)
            runs[trainer, dtype, unshared] = d
            get.stderr[d] = proc.stderr
        return runs[trainer, dtype, unshared]
    get.stderr = {}
    return get


@pytest.mark.parametrize("name,dtype,rtol", cases(SFT_BUDGETS))
def test_sft_parallel_equals_serial(assets, serial, tmp_path, name, dtype, rtol):
    nproc, extra = layout(name, SFT_BUDGETS[name])
    run_trainer("sft", nproc, sft_args(assets, *LORA, f"actor.dtype={dtype}", *extra), tmp_path)
    ref = serial("sft", dtype)
    for key in ("train/loss", "train/grad_norm", "test/loss"):
        assert_close(train_rows(tmp_path, key), train_rows(ref, key), rtol, key)
    losses = train_rows(ref, "train/loss")
    assert losses[-1] < losses[0]


@pytest.mark.slow  # the fast set keeps LoRA's SFT parallel == serial
@pytest.mark.parametrize("name,dtype,rtol", cases(DPO_BUDGETS))
def test_dpo_parallel_equals_serial(assets, serial, tmp_path, name, dtype, rtol):
    nproc, extra = layout(name, DPO_BUDGETS[name])
    run_trainer("dpo", nproc, dpo_args(assets, *LORA, f"actor.dtype={dtype}", *extra), tmp_path)
    for key in ("train/loss", "train/dpo_loss", "train/rewards/margin", "train/grad_norm", "test/loss"):
        ref = serial("dpo", dtype, unshared="sp" in name)  # auto: no shared prompts with sp
        assert_close(train_rows(tmp_path, key), train_rows(ref, key), rtol, key,
                     atol=rtol / 10 if "margin" in key else 0.0)


def test_dpo_reference_is_the_adapter_free_actor(assets, serial):
    """lora_B starts at 0, so policy == base == reference: the step-0 loss is log 2 exactly, and
    the margin grows after; one model is built (no second copy for the reference)."""
    d = serial("dpo", "float32")
    rows = read_metrics(d)
    first = next(r for r in rows if "train/dpo_loss" in r)
    assert first["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert rows[0]["test/loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert train_rows(d, "train/rewards/margin")[-1] > 0
    assert serial.stderr[d].count("Applied FSDP") == 1  # the actor only


@pytest.mark.slow
def test_resume_is_exact_and_the_adapter_reloads_with_peft(assets, tmp_path):
    """A run killed after step 2 and resumed == the straight run (float64, adapters + AdamW
    state restored); the saved PEFT adapter on the base model == the merged export, whose test
    loss under plain HF is the trainer's."""
    args = sft_args(assets, *LORA, "actor.dtype=float64", "trainer.total_steps=4",
                    "actor.lora.save_merged=true", "actor.max_length_per_device=64")
    run_trainer("sft", 2, args, tmp_path / "straight")
    run_trainer("sft", 2, args + ["trainer.save_freq=2"], tmp_path / "resumed", crash_after_step=2, check=False)
    assert (tmp_path / "resumed" / "run" / "latest").read_text() == "step2"
    run_trainer("sft", 2, args + ["trainer.load_ckpt_from=latest"], tmp_path / "resumed")
    for key in ("train/loss", "train/grad_norm"):
        want = train_rows(tmp_path / "straight", key)
        got = {r["step"]: r[key] for r in read_metrics(tmp_path / "resumed") if key in r}
        assert_close([got[s] for s in (1, 2, 3, 4)], want, 1e-12, key)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = tmp_path / "straight" / "run" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64).eval()
    base = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float64)
    peft = PeftModel.from_pretrained(base, final / "adapter").eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want, got = merged(input_ids=ids).logits, peft(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-10)
    test_loss = train_rows(tmp_path / "straight", "test/loss")[-1]
    assert math.isclose(hf_test_loss(str(final), assets["data"]), test_loss, rel_tol=1e-5)

    # The tokenizer written beside the adapter (users load it from there) splits text as the
    # training tokenizer did: the chat-rendered test rows and a probe of digits, spaces, tabs, non-ASCII.
    from transformers import AutoTokenizer

    from RL2.data.io import load_rows

    saved, tok = AutoTokenizer.from_pretrained(final / "adapter"), assets["tokenizer"]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]},
                                      {"role": "assistant", "content": r["response"]}], tokenize=False)
             for r in load_rows(f"{assets['data']}/sft_test.jsonl")]
    texts.append("Sum 12 + 3,456 =  3468\t\tdone.  Ünïcode ñ 日本語 — ok?\n")
    for t in texts:
        assert saved.encode(t) == tok.encode(t), t


@pytest.mark.slow
def test_ppo_engine_logps_equal_trainer_logps_after_merged_syncs(assets, tmp_path):
    """The adapters move every step (lr 1e-2); the torch engine, fed merged weights, samples
    with the trainer's log-probs (strict_on_policy at 1e-5); the KL to the adapter-free
    reference (the actor with adapters off) is 0 at the first update (B = 0) and grows after."""
    env = tmp_path / "env.py"
    env.write_text(LENGTH_ENV)
    args = [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={env}", *LORA, "actor.lr=1e-2", "actor.strict_on_policy=true",
            "actor.on_policy_tol=1e-5", "kl.coef=0.1", "kl.type=loss",
            "actor.rollout.prompts_per_rollout=4", "actor.rollout.responses_per_prompt=2",
            "actor.rollout.train_sampling_params.max_new_tokens=4", "trainer.total_steps=3"]
    run_trainer("ppo", 2, args, tmp_path / "run")
    kl = train_rows(tmp_path / "run", "actor/kl_loss")
    assert len(kl) == 3 and kl[0] == pytest.approx(0.0, abs=1e-12) and kl[-1] > 0
    assert all(abs(v) < 1e-6 for v in train_rows(tmp_path / "run", "rollout/engine_kl"))


@pytest.mark.slow
def test_reward_model_trains_adapters_and_head_and_exports_them(assets, tmp_path):
    """RM with LoRA: the margin grows; the PEFT adapter (with the trained `score` head) on the
    base value model gives the merged export's rewards."""
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    run_trainer("rm", 1, [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/pref_train.jsonl",
                          "data.train.batch_size=16", "actor.lr=1e-2", "trainer.total_steps=4", *LORA,
                          "actor.lora.save_merged=true"], tmp_path)
    margins = train_rows(tmp_path, "train/margin")
    assert margins[-1] > margins[0] + 0.1
    final = tmp_path / "run" / "final"
    merged = AutoModelForTokenClassification.from_pretrained(final, num_labels=1).eval()
    base = AutoModelForTokenClassification.from_pretrained(assets["model"], num_labels=1)
    peft = PeftModel.from_pretrained(base, final / "adapter").eval()
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        want, got = merged(input_ids=ids).logits, peft(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5) and want.abs().max() > 0.1


def _critic_lora_updates(rank, world, model_dir):
    from RL2.algorithms.ppo import critic_update
    from RL2.trainer.ppo import check_config
    from RL2.utils.config import load_config
    from RL2.workers import lora
    from RL2.workers.critic import Critic
    from tests.run_utils import fixed_batch

    cfg = load_config("ppo", [f"actor.model_name={model_dir}", "data.train.path=unused",
                              "actor.rollout.env_path=unused", "adv.estimator=gae", "critic.lora.rank=4",
                              "critic.lora.alpha=8", "critic.lr=1e-2", "critic.clip=null",
                              "critic.dtype=float32"])
    # start-up: the PPO checks and the LoRA checks Trainer.validate_layouts runs per worker
    check_config(cfg)
    assert lora.check_config(cfg.critic, "critic") == [] and not lora.enabled(cfg.actor)
    tp = load_config("ppo", [f"actor.model_name={model_dir}", "data.train.path=unused",
                             "actor.rollout.env_path=unused", "critic.lora.rank=4", "critic.tp_size=2"])
    assert any("critic.lora.rank > 0 does not compose with critic.tp_size=2" in p
               for p in lora.check_config(tp.critic, "critic"))
    critic = Critic(cfg.critic, "cpu", total_steps=3, seed=0)
    params = dict(critic.model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    frozen = set(params) - trainable
    head = {n for n in trainable if n.startswith(f"{lora.VALUE_HEAD}.")}
    assert head and all(".modules_to_save.default." in n for n in head)  # the trained head copy
    assert trainable - head and all(".lora_A." in n or ".lora_B." in n for n in trainable - head)
    in_opt = {id(p) for g in critic.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(params[n]) for n in trainable}
    before = {n: _full(p.detach()).clone() for n, p in params.items()}
    samples = fixed_batch(critic.config.vocab_size)
    losses = [critic_update(critic, samples, cfg.critic, seed=1)["value_loss"] for _ in range(3)]
    after = {n: _full(p.detach()) for n, p in params.items()}
    assert all(torch.equal(after[n], before[n]) for n in frozen)
    assert all(not torch.equal(after[n], before[n]) for n in head | {n for n in trainable if ".lora_B." in n})
    return losses


def test_critic_lora_trains_only_adapters_and_the_value_head(assets):
    """critic.lora.rank=4 (PPO with GAE): the critic's trainable parameters are its adapters and
    the value head, nothing frozen moves, and three value updates on one batch lower the loss."""
    (losses,) = run_dist(_critic_lora_updates, 1, assets["model"])
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_missing_peft_is_named_at_start_up(monkeypatch):
    import importlib.util

    from omegaconf import OmegaConf

    from RL2.workers import lora

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "peft" else real(n, *a))
    cfg = OmegaConf.create({"tp_size": 1, "lora": {"rank": 4, "alpha": 8, "dropout": 0.0,
                                                  "target_modules": ["q_proj"]}})
    assert any("pip install -e '.[peft]'" in p for p in lora.check_config(cfg, "actor"))
