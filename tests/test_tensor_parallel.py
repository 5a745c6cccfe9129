"""Tensor parallel (DTensor) == single process: logits, log-probs, entropy, gradients, FSDP2 x TP."""
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from RL2.parallel import vocab_logps
from RL2.parallel.collectives import grad_norm_and_clip
from RL2.parallel.tensor_parallel import apply_tp, validate_tp
from RL2.parallel.vocab_logps import logps_and_entropy
from tests.dist_utils import run_dist

TOL = 1e-10  # float64 throughout: any layout bug shows up far above this


def _config(arch="qwen2", tied=False, heads=4, kv=2, vocab=128, num_labels=1):
    from transformers import AutoConfig

    extra = {"head_dim": 8} if arch == "qwen3" else {}
    return AutoConfig.for_model(
        arch, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        tie_word_embeddings=tied, initializer_range=0.2, num_labels=num_labels, **extra)


def _build(kind="causal", **cfg):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    torch.manual_seed(0)
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForTokenClassification
    return cls.from_config(_config(**cfg)).to(torch.float64).eval()  # eval: no dropout


def _batch(vocab, n_seqs=2, length=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n_seqs, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _ref_logps_entropy(logits, labels):
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _max_grad_diff(ref, model):
    """Largest relative difference between per-parameter gradients (full tensors)."""
    worst = 0.0
    for (name, p_ref), (name2, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert name == name2, (name, name2)
        g_ref, g = p_ref.grad, _full(p.grad)
        worst = max(worst, ((g - g_ref).norm() / g_ref.norm().clamp_min(1e-30)).item())
    return worst


def _compare_case(case, tp_mesh):
    """One model: reference forward/backward, TP forward/backward, return the max errors."""
    kind = case.get("kind", "causal")
    ref = _build(**case)
    model = apply_tp(copy.deepcopy(ref), tp_mesh)
    ids, labels = _batch(ref.config.vocab_size)
    out = {}
    if kind == "causal":
        if ref.config.tie_word_embeddings:
            out["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        out["sharded_logits"] = isinstance(model(input_ids=ids).logits, DTensor)
        ref_logits = ref(input_ids=ids).logits
        lp_ref, ent_ref = _ref_logps_entropy(ref_logits / 0.8, labels)
        (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
        logits = model(input_ids=ids).logits
        lp, ent = logps_and_entropy(logits, labels, temperature=0.8, need_entropy=True)
        (lp.sum() + 0.3 * ent.sum()).backward()
        out["logits"] = (_full(logits) - ref_logits).abs().max().item()
        out["logps"] = (lp - lp_ref).abs().max().item()
        out["entropy"] = (ent - ent_ref).abs().max().item()
    else:
        values_ref = ref(input_ids=ids).logits.squeeze(-1)
        (values_ref ** 2).sum().backward()
        values = model(input_ids=ids).logits.squeeze(-1)
        (values ** 2).sum().backward()
        out["head_replicated"] = not isinstance(model.score.weight, DTensor)
        out["values"] = (values - values_ref).abs().max().item()
    out["grads"] = _max_grad_diff(ref, model)
    # TP-only layouts mix plain, Replicate, Shard(0/1) (and Partial for Qwen3 q/k norms) grads.
    norm_ref = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    out["norm"] = abs(grad_norm_and_clip(list(model.parameters()), None) - norm_ref) / norm_ref
    return out


TP2_CASES = [
    dict(arch="qwen2", tied=False),
    dict(arch="qwen2", tied=True),
    dict(arch="llama", tied=False),
    dict(arch="qwen3", tied=True),
    dict(arch="qwen3", tied=False),
    dict(arch="mistral", tied=False),
    dict(arch="qwen2", tied=True, vocab=101),  # vocab not divisible: replicated fallback
    dict(arch="qwen2", kind="value"),
]
TP4_CASE = dict(arch="qwen2", tied=True, heads=4, kv=4)


def _check(result, case):
    for key, value in result.items():
        if isinstance(value, bool):
            expected = key != "sharded_logits" or case.get("vocab", 128) % 2 == 0
            assert value is expected, (case, key, value)
        else:
            assert value < TOL, (case, key, value)


def _fsdp_tp_case(mesh):
    """dp=2 x tp=2: TP on the tp dim, then FSDP2 on the dp dim; loss, grad norm, clipped grads."""
    from torch.distributed.fsdp import fully_shard

    # Qwen3, tied: q/k-norm grads are Partial over tp, the tied weight is one 2-D DTensor.
    ref = _build(arch="qwen3", tied=True)
    model = apply_tp(copy.deepcopy(ref), mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # embeddings + tied lm_head in the root unit

    ids, labels = _batch(ref.config.vocab_size, n_seqs=4)
    lp, ent = _ref_logps_entropy(ref(input_ids=ids).logits, labels)
    loss_ref = -lp.mean() - 0.1 * ent.mean()
    loss_ref.backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05).item()

    # Each dp rank takes 2 of the 4 sequences; FSDP averages the gradients over dp.
    dp = mesh.get_local_rank("dp")
    mine = slice(2 * dp, 2 * dp + 2)
    lp, ent = logps_and_entropy(model(input_ids=ids[mine]).logits, labels[mine], need_entropy=True)
    loss = -lp.mean() - 0.1 * ent.mean()
    loss.backward()
    norm = grad_norm_and_clip(list(model.parameters()), max_norm=0.05)
    loss_avg = loss.detach().clone()
    dist.all_reduce(loss_avg, group=mesh.get_group("dp"))
    return {
        "loss": abs(loss_avg.item() / 2 - loss_ref.item()),
        "norm": abs(norm - norm_ref) / norm_ref,
        "clipped_grads": _max_grad_diff(ref, model),
        "norm_clipped": norm_ref > 0.05,  # the clip really scaled the gradients
    }


def _worker(rank, world_size):
    """One 4-rank launch for every layout (spawning + importing transformers dominates cost)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "tp2": [_compare_case(case, mesh["tp"]) for case in TP2_CASES],
        "tp4": _compare_case(TP4_CASE, init_device_mesh("cpu", (4,))),
        "dp2_tp2_fsdp": _fsdp_tp_case(mesh),
    }


@pytest.fixture(scope="module")
def dist_results():
    return run_dist(_worker, 4)


def test_tp2_matches_single_process(dist_results):
    for out in dist_results:
        for case, result in zip(TP2_CASES, out["tp2"]):
            _check(result, case)


def test_tp4_matches_single_process(dist_results):
    for out in dist_results:
        _check(out["tp4"], TP4_CASE)


def test_fsdp_dp2_tp2_matches_single_process(dist_results):
    for out in dist_results:
        _check(out["dp2_tp2_fsdp"], {})


@pytest.mark.parametrize("key,value,message", [
    ("num_attention_heads", 6, "num_attention_heads=6 is not divisible by tp_size=4"),
    ("num_key_value_heads", 2, "num_key_value_heads=2 is not divisible by tp_size=4"),
    ("intermediate_size", 66, "intermediate_size=66 is not divisible by tp_size=4"),
])
def test_validate_tp_names_the_numbers(key, value, message):
    cfg = _config(heads=12, kv=4)
    setattr(cfg, key, value)
    with pytest.raises(ValueError, match=message):
        validate_tp(cfg, 4)


def test_validate_tp_architecture_and_vocab():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="tensor parallelism supports model_type"):
        validate_tp(GPT2Config(), 2)
    assert validate_tp(_config(vocab=128), 2) is True
    assert validate_tp(_config(vocab=101), 2) is False  # replicated lm_head fallback


@pytest.mark.parametrize("temperature", [0.7, 1.0])  # T == 1 skips the scaling
@pytest.mark.parametrize("chunk", [1 << 24, 7])  # 7 elements: one token per chunk
def test_logps_and_entropy_plain_tensor(monkeypatch, chunk, temperature):
    monkeypatch.setattr(vocab_logps, "_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 11, (2, 5))
    lp, ent = logps_and_entropy(logits, labels, temperature=temperature, need_entropy=True)
    lp_ref, ent_ref = _ref_logps_entropy(logits / temperature, labels)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    lp_only, none = logps_and_entropy(logits, labels, temperature)
    assert none is None and lp_only.shape == (2, 5)
    torch.testing.assert_close(lp_only, lp_ref, rtol=0, atol=1e-12)
    before = logits.detach().clone()
    torch.autograd.gradcheck(
        lambda x: logps_and_entropy(x, labels, temperature, need_entropy=True), (logits,))
    torch.autograd.gradcheck(lambda x: logps_and_entropy(x, labels, temperature)[0], (logits,))
    # the entropy computed as a metric only (PPO with entropy_coef 0): its grad arrives as None
    torch.autograd.gradcheck(
        lambda x: logps_and_entropy(x, labels, temperature, need_entropy=True)[0], (logits,))
    # only the entropy's gradient (the logps output unused)
    torch.autograd.gradcheck(
        lambda x: logps_and_entropy(x, labels, temperature, need_entropy=True)[1], (logits,))
    assert torch.equal(logits.detach(), before)  # the backward works on copies, never the logits


def test_grad_norm_and_clip_plain_matches_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm=1.0).item()
    assert abs(grad_norm_and_clip(a, 1.0) - ref) < 1e-5
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
    assert abs(grad_norm_and_clip(a, None) - 1.0) < 1e-5  # no clip: just the (clipped) norm


def test_grad_norm_of_strided_low_precision_and_empty_grads():
    """The squared norms come from a dot product of the flattened gradient: a transposed
    (non-contiguous) gradient, a bf16 one (summed in fp32) and an empty one count as torch
    counts them."""
    torch.manual_seed(0)
    grads = [torch.randn(5, 7).t(), torch.randn(6, 3).to(torch.bfloat16), torch.randn(0, 4),
             torch.randn(64, dtype=torch.float64)]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g
        params.append(p)
    want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert abs(grad_norm_and_clip(params, None) - want) <= 1e-6 * want


def test_cpu_chunks_stay_under_the_mmap_threshold():
    """On the CPU a chunk's temporaries stay under the malloc threshold keep_freed_memory sets
    (reused heap blocks, not fresh pages); GPUs keep the larger chunks."""
    from RL2.utils.process import MMAP_THRESHOLD

    for vocab in (11, 2048, 49152, 151936, 10 ** 7):
        for dtype in (torch.float32, torch.float64):
            rows = vocab_logps._chunk_rows(vocab, dtype, torch.device("cpu"))
            assert rows >= 1
            assert rows == 1 or rows * vocab * dtype.itemsize <= MMAP_THRESHOLD // 4
        assert vocab_logps._chunk_rows(vocab, torch.float32, torch.device("cuda")) == max(
            1, vocab_logps._CHUNK_ELEMENTS // vocab)
