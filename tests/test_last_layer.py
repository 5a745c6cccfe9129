"""The last decoder layer only at kept rows (RL2/workers/last_layer.py) == HF's whole layer."""
import re

import pytest
import torch
from omegaconf import OmegaConf

from RL2.parallel.attention import PackedContext, packed_kwargs, register
from RL2.tools.make_assets import ARCHS, build_tokenizer, tiny_config
from RL2.utils import cpu_ops, small_gemm
from RL2.workers import last_layer
from tests.run_utils import assert_close, dpo_args, run_trainer, sft_args, train_rows

# a GRPO-like group (a prefix-only root that keeps nothing, a response continuing 12 of its
# tokens) and a DPO-like pair (a chosen side with kept rows, a rejected side continuing 10)
BOUNDS, PREFIX = [0, 20, 50, 75, 100], [0, 12, 0, 10]
KEEP = list(range(35, 49)) + [52, 55] + list(range(60, 74)) + list(range(85, 99))


def _model(arch: str, dtype, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(build_tokenizer(), arch, **kw)
    cfg._attn_implementation = register()
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def _logits(model, keep, prune: bool):
    """Logits at `keep` of a fixed packed row (BOUNDS, PREFIX), pruning the last layer or not."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (BOUNDS[-1],), generator=g)
    pos = torch.cat([torch.arange(e - s) + p for s, e, p in zip(BOUNDS, BOUNDS[1:], PREFIX)])
    ctx = PackedContext(torch.tensor(BOUNDS, dtype=torch.int32), 30, prefix_lens=PREFIX)
    rows = last_layer.plan(ctx, keep) if prune else keep
    assert (ctx.last_rows is not None) == prune and len(rows) == len(keep)
    return model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                 **packed_kwargs(ctx), logits_to_keep=rows).logits


def _run(model, keep, prune: bool, grad_ckpt: bool = False):
    """Logits at `keep` and every parameter's gradient of a fixed function of them."""
    model.train(grad_ckpt)
    logits = _logits(model, keep, prune)
    up = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=logits.dtype)
    grads = torch.autograd.grad((logits * up).sum(), list(model.parameters()))
    return [logits] + list(grads)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_pruned_last_layer_equals_hfs_whole_layer(arch):
    """Every family listed: logits at the kept rows and all gradients equal HF's own forward
    (float64, to rounding), with shared prompts and a sequence that keeps nothing."""
    assert set(ARCHS) == set(last_layer.FAMILIES)  # a family added to the assets is listed here
    model = _model(arch, torch.float64)
    keep = torch.tensor(sorted(KEEP))
    whole = _run(model, keep, prune=False)
    assert last_layer.install(model)
    pruned = _run(model, keep, prune=True)
    for got, want in zip(pruned, whole):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not small_gemm.available(), reason="RL2's AVX-512 kernel not built here")
def test_pruned_last_layer_through_the_kernel():
    """fp32 with 64-wide heads: the pruned layer's fewer queries than keys go through RL2's C
    attention kernel (bottom-right mask) and match the whole layer to fp32 rounding."""
    model = _model("qwen2", torch.float32, hidden=256, heads=4, kv_heads=2)
    cpu_ops.use_for_model(model)
    assert cpu_ops.use_attention(model) == 2
    keep = torch.tensor(sorted(KEEP))
    whole = _run(model, keep, prune=False)
    assert last_layer.install(model)
    calls = []
    real = cpu_ops.causal_attention

    def counting(q, k, *a):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, *a)

    cpu_ops.causal_attention = counting
    try:
        pruned = _run(model, keep, prune=True)
    finally:
        cpu_ops.causal_attention = real
    # layer 0: every row over the gathered keys (100 + 12 + 10); layer 1: the kept suffixes
    # (from 35, 52 and 85 on: 15 + 23 + 15 rows) over 12 + 30, 25 and 10 + 25 keys, the
    # prefix-only root left out
    assert calls == [(100, 122), (53, 102)]
    for got, want in zip(pruned, whole):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


@pytest.mark.parametrize("keep", [KEEP, [49, 74, 99]], ids=["suffixes", "one-query"])
def test_pruned_last_layer_through_flash_attn(monkeypatch, keep):
    """The CUDA branch: bf16 through a fake of flash-attn 2.8.3's varlen function that enforces
    its kernel's checks (tests/test_attention.py). The pruned layer hands it fewer queries than
    keys; keeping one row per sequence with more query than K/V heads takes flash-attn's
    one-query path, which refuses a sequence without queries (the root is left out)."""
    from RL2.parallel import attention
    from tests.test_attention import fake_flash_varlen

    model = _model("qwen2", torch.bfloat16, hidden=64, heads=4, kv_heads=2)
    keep = torch.tensor(sorted(keep))
    with torch.no_grad():
        whole = _logits(model, keep, prune=False)
        calls = []
        monkeypatch.setattr(attention, "flash_supported", lambda q: True)
        monkeypatch.setattr(attention, "_flash_varlen", lambda: lambda *a, **kw: calls.append(
            (a[0].shape[0], a[5], a[4].tolist())) or fake_flash_varlen(*a, **kw))
        assert last_layer.install(model)
        pruned = _logits(model, keep, prune=True)
    # layer 1's queries: 15 + 23 + 15 rows (or one per sequence), the root without any
    want = (53, 23, [0, 42, 67, 102]) if len(keep) > 3 else (3, 1, [0, 42, 67, 102])
    assert len(calls) == 2 and calls[1] == want
    # bf16 rounding leaves 0.008 here; a query that misses its own key moves logits by 0.02-0.03
    torch.testing.assert_close(pruned, whole, rtol=0, atol=0.015)
    if len(keep) == 3:  # the fake refuses the root's empty query list on this path
        q, kv = torch.zeros(3, 4, 16, dtype=torch.bfloat16), torch.zeros(10, 2, 16, dtype=torch.bfloat16)
        cu = torch.tensor([0, 0, 1, 2, 3], dtype=torch.int32)
        with pytest.raises(AssertionError, match="one-query path"):
            fake_flash_varlen(q, kv, kv, cu, torch.tensor([0, 1, 4, 7, 10], dtype=torch.int32),
                              1, 3, causal=True)


@pytest.mark.parametrize("keep", [KEEP, [49, 74, 99]], ids=["suffixes", "one-query"])
def test_pruned_last_layer_backward_through_flash_attn(monkeypatch, keep):
    """The CUDA branch's backward through the fake of flash-attn 2.8.3, which enforces
    mha_varlen_bwd's checks (no one-query path there: the general causal kernel reads the
    forward's softmax_lse). float64 (the fake's exact mode): logits and every gradient equal the
    whole layer to rounding; bf16 with activation checkpointing (the forward recomputed in the
    backward): both kernels take RL2's calls, the one-query forward included."""
    from RL2.parallel import attention
    from tests.test_attention import FLASH_BACKWARDS, fake_flash_varlen

    model = _model("qwen2", torch.float64, hidden=64, heads=4, kv_heads=2)
    keep = torch.tensor(sorted(keep))
    whole = _run(model, keep, prune=False)
    assert last_layer.install(model)
    monkeypatch.setattr(attention, "flash_supported", lambda q: True)
    monkeypatch.setattr(attention, "_flash_varlen", lambda: lambda *a, **kw: fake_flash_varlen(*a, **kw, exact=True))
    FLASH_BACKWARDS.clear()
    pruned = _run(model, keep, prune=True)
    queries = 53 if len(keep) > 3 else 3  # layer 1: the kept suffixes, or one row per sequence
    assert FLASH_BACKWARDS == [(queries, 23 if len(keep) > 3 else 1), (BOUNDS[-1], 30)]
    for got, want in zip(pruned, whole):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    forwards = []
    monkeypatch.setattr(attention, "_flash_varlen", lambda: lambda *a, **kw: forwards.append(
        (a[0].shape[0], a[5])) or fake_flash_varlen(*a, **kw))
    FLASH_BACKWARDS.clear()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _run(model.to(torch.bfloat16), keep, prune=True, grad_ckpt=True)
    # layers 0, 1, then in the backward layer 1 again (the pruned one), then layer 0
    assert len(forwards) == 4 and forwards[1] == forwards[2] == (queries, 23 if len(keep) > 3 else 1)
    assert len(FLASH_BACKWARDS) == 2  # each layer's forward ran again in the backward


def test_plan_keeps_each_sequences_suffix_and_skips_when_that_is_all():
    # a ring's context is refused here too, not only by `resolve`: its suffixes would lose the ring
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        last_layer.plan(PackedContext(torch.tensor([0, 4], dtype=torch.int32), 4, sp_group=object()),
                        torch.tensor([3]))
    # an empty sequence, then [0, 4) and [4, 9)
    ctx = PackedContext(torch.tensor([0, 0, 4, 9], dtype=torch.int32), 5)
    assert last_layer.plan(ctx, torch.tensor([2, 3, 6, 8])).tolist() == [0, 1, 2, 4]
    rows, sub = ctx.last_rows
    assert rows.tolist() == [2, 3, 6, 7, 8] and sub.bounds == [0, 2, 5]
    assert sub.keys("cpu")[0].tolist() == list(range(9)) and sub.keys("cpu")[1] == [0, 4, 9]
    ctx = PackedContext(torch.tensor([0, 4, 9], dtype=torch.int32), 5)
    assert last_layer.plan(ctx, torch.tensor([0, 4, 8])) is None and ctx.last_rows is None
    # a padding micro-batch's stand-in row 0: its sequence whole, the other left out
    ctx = PackedContext(torch.tensor([0, 4, 9], dtype=torch.int32), 5)
    assert last_layer.plan(ctx, torch.tensor([0])).tolist() == [0]
    assert ctx.last_rows[0].tolist() == [0, 1, 2, 3] and ctx.last_rows[1].bounds == [0, 4]
    # a tail's keys: its root's first 3 rows, then its own
    ctx = PackedContext(torch.tensor([0, 4, 9], dtype=torch.int32), 5, prefix_lens=[0, 3])
    assert last_layer.plan(ctx, torch.tensor([7, 8])).tolist() == [0, 1]
    assert ctx.last_rows[1].keys("cpu")[0].tolist() == [0, 1, 2, 4, 5, 6, 7, 8]


def test_pruned_last_layer_under_gradient_checkpointing():
    """HF's activation checkpointing wraps the layer's own forward; the pruned one recomputes
    too (the checkpoint function is called for it) and gives the same logits and gradients."""
    model = _model("llama", torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    keep = torch.tensor(sorted(KEEP))
    whole = _run(model, keep, prune=False, grad_ckpt=True)
    assert last_layer.install(model)
    layer = model.model.layers[-1]
    calls, real = [], layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or real(*a, **k)
    pruned = _run(model, keep, prune=True, grad_ckpt=True)
    assert calls == [1]
    for got, want in zip(pruned, whole):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_resolve_and_unknown_models():
    cfg = OmegaConf.create({"prune_last_layer": "auto", "sp_size": 1})
    assert last_layer.resolve(cfg, "cpu") and not last_layer.resolve(cfg, "cuda")
    assert not last_layer.resolve(OmegaConf.create({"prune_last_layer": "auto", "sp_size": 2}), "cpu")
    with pytest.raises(SystemExit, match="sp_size=1"):
        last_layer.resolve(OmegaConf.create({"prune_last_layer": True, "sp_size": 2}), "cpu")
    with pytest.raises(SystemExit, match="true, false or auto"):
        last_layer.resolve(OmegaConf.create({"prune_last_layer": "yes", "sp_size": 1}), "cpu")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert not last_layer.install(gpt2)


@pytest.mark.parametrize("trainer,nproc", [("sft", 1), pytest.param("dpo", 1, marks=pytest.mark.slow),
                                           pytest.param("dpo", 2, marks=pytest.mark.slow),
                                           pytest.param("sft", 2, marks=pytest.mark.slow)])
def test_runs_with_the_pruned_layer_match_runs_without(assets, tmp_path, trainer, nproc):
    """SFT (loss on responses only) and DPO (shared prompts), on one rank (a plain module) and
    on two (FSDP's subclass of the layer; with tp_size=2 for SFT): losses and gradient norms of
    runs pruning the last layer equal those of runs that do not, and the pruned path ran."""
    args = sft_args if trainer == "sft" else dpo_args
    extra = ["actor.tp_size=2"] if trainer == "sft" and nproc == 2 else []
    runs = {}
    for prune in ("true", "false"):
        runs[prune] = tmp_path / prune
        run = run_trainer(trainer, nproc, args(assets, "actor.dtype=float64", *extra,
                                               f"actor.prune_last_layer={prune}"), runs[prune])
        logged = re.search(r"the last layer at (\d+) of (\d+) rows", run.stderr)
        assert (logged is not None) == (prune == "true")
        if logged:  # it ran, on fewer rows
            assert int(logged[1]) < int(logged[2])
    for key in ("train/loss", "train/grad_norm"):
        assert_close(train_rows(runs["true"], key), train_rows(runs["false"], key), 1e-9, key)
