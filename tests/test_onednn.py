"""oneDNN linear layers on the CPU (RL2/utils/onednn.py): the same numbers as F.linear within fp32
rounding, forward and backward, in training (worker models) and in the torch engine (packed
weights, refreshed whenever the weights change)."""
import asyncio

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine
from RL2.utils import onednn, small_gemm
from tests.run_utils import assert_close, run_trainer, sft_args, train_rows

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")


@pytest.fixture
def counted(monkeypatch):
    """Counts the oneDNN products actually run (a path that silently fell back to F.linear
    would pass every numeric check)."""
    calls = {"n": 0}
    real = onednn._mm

    def mm(*args):
        calls["n"] += 1
        return real(*args)
    monkeypatch.setattr(onednn, "_mm", mm)
    return calls


def model(seed=0, hidden=256, layers=2):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_gradients_match_float64(counted, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 70, 384, requires_grad=True)  # 3-D input, rows not a multiple of a block
    w = torch.randn(192, 384, requires_grad=True)
    b = torch.randn(192, requires_grad=True) if bias else None
    g = torch.randn(3, 70, 192)
    y = onednn.linear(x, w, b)
    y.backward(g)
    assert counted["n"] == 3  # forward, input grad, weight grad
    ref = [t.detach().double().requires_grad_() for t in (x, w)] + (
        [b.detach().double().requires_grad_()] if bias else [None])
    y_ref = F.linear(*ref)
    y_ref.backward(g.double())
    # fp32 products over 384 (forward) and 210 (weight grad) terms: ~1e-6 relative of |x||w|
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), ref[0].grad, rtol=0, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), ref[1].grad, rtol=0, atol=1e-4)
    if bias:
        torch.testing.assert_close(b.grad.double(), ref[2].grad, rtol=1e-6, atol=1e-5)


def test_linear_falls_back_where_onednn_does_not_apply(counted):
    w = torch.randn(8, 16, dtype=torch.float64)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert torch.equal(onednn.linear(x, w), F.linear(x, w))  # float64: no oneDNN kernel
    assert torch.equal(onednn.linear(torch.randn(0, 16), w.float()), torch.randn(0, 8) * 0)
    assert counted["n"] == 0


def test_model_loss_and_gradients_match_aten(counted):
    ids = torch.randint(0, 512, (2, 96))
    ref, fast = model(), model()
    assert onednn.use_for_linears(fast) == 2 * 7 + 1  # 7 per layer + lm_head
    losses = []
    for m in (ref, fast):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert counted["n"] == 3 * 15
    assert abs(losses[0] - losses[1]) < 1e-5 * losses[0]
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_weights_follow_weight_changes(counted):
    lin = torch.nn.Linear(256, 128)
    packed = onednn.PackedLinears()
    x = torch.randn(16, 256)
    with torch.no_grad():
        torch.testing.assert_close(packed(x, lin), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(2)  # in place: the packed copy is stale until the owner says so
        assert not torch.allclose(packed(x, lin), F.linear(x, lin.weight, lin.bias), atol=1e-3)
        packed.clear()
        torch.testing.assert_close(packed(x, lin), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.data = torch.randn(128, 256)  # new storage: repacked without being told
        torch.testing.assert_close(packed(x, lin), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert counted["n"] == 4


def test_stacked_projections_equal_separate_ones_and_follow_weight_changes(counted):
    # q/k/v-like: different widths, bias on some only (a zero bias stands in for the others)
    projs = (torch.nn.Linear(64, 64), torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32))
    packed = onednn.PackedLinears()
    x = torch.randn(16, 64)
    with torch.no_grad():
        def check():
            outs = packed.many(x, projs)
            assert [o.shape[-1] for o in outs] == [64, 32, 32]
            for o, p in zip(outs, projs):
                torch.testing.assert_close(o, F.linear(x, p.weight, p.bias), rtol=1e-5, atol=1e-5)
        check()
        assert counted["n"] == 1  # one product for the three
        projs[1].weight.data = torch.randn(32, 64)  # new storage in one of them: restacked
        check()
        projs[2].weight.mul_(3)  # in place: stale until cleared, as for a single projection
        assert not torch.allclose(packed.many(x, projs)[2], F.linear(x, projs[2].weight, projs[2].bias), atol=1e-3)
        packed.clear()
        check()


def generate(engine, prompts, n=24):
    async def run():
        params = SamplingParams(temperature=0, max_new_tokens=n)
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return [out[0] for out in asyncio.run(run())]


def test_engine_matches_aten_engine_and_sees_weight_updates(counted):
    m = model(seed=1).eval()
    # 195 prompt tokens: the prefill's products go to oneDNN (more rows than small_gemm takes)
    prompts = [[(7 * i + j) % 512 for j in range(25 + 3 * i)] for i in range(6)]
    aten = TorchEngine(m, None, cpu_matmul="aten")
    want = generate(aten, prompts)
    assert counted["n"] == 0
    fast = TorchEngine(model(seed=1).eval(), None)  # default: onednn
    got = generate(fast, prompts)
    assert counted["n"] > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)
    # new weights (in place, as a colocated sync writes them): the packed copies are rebuilt
    other = model(seed=2)
    fast.update_weights(other.state_dict().items())
    aten.update_weights(other.state_dict().items())
    assert [o.token_ids for o in generate(fast, prompts)] == [o.token_ids for o in generate(aten, prompts)]


def test_auto_takes_onednn_for_training_only_on_amd(monkeypatch, tmp_path):
    # the vendor comes from /proc/cpuinfo's vendor_id line
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: real_open(cpuinfo if f == "/proc/cpuinfo" else f, *a, **k))
    assert onednn.cpu_vendor() == "AuthenticAMD"
    assert onednn.resolve("auto") == "onednn" and onednn.resolve("auto", training=False) == "onednn"
    cpuinfo.write_text("vendor_id\t: GenuineIntel\n")
    assert onednn.resolve("auto") == "aten" and onednn.resolve("auto", training=False) == "onednn"
    cpuinfo.unlink()  # no /proc/cpuinfo (another OS): PyTorch's default for training
    assert onednn.cpu_vendor() == "" and onednn.resolve("auto") == "aten"
    assert onednn.resolve("onednn") == "onednn" and onednn.resolve("aten", training=False) == "aten"


def test_bad_choice_is_refused_by_name():
    with pytest.raises(ValueError, match="cpu_matmul='mkl'"):
        TorchEngine(model(), None, cpu_matmul="mkl")


@pytest.mark.slow
def test_sft_with_onednn_matches_aten(assets, tmp_path):
    runs = {}
    for choice in ("aten", "onednn", "auto"):
        runs[choice] = tmp_path / choice
        proc = run_trainer("sft", 1, sft_args(assets, "actor.dtype=float32", f"actor.cpu_matmul={choice}"),
                           runs[choice])
        # the worker says it switched (15 layers: 7 per decoder layer + lm_head), only when asked;
        # auto says what it chose for this machine's CPU
        chosen = onednn.resolve(choice)
        assert ("cpu_matmul=onednn: 15 linear layers" in proc.stderr) == (chosen == "onednn")
        assert (f"cpu_matmul=auto: {chosen} (CPU vendor" in proc.stderr) == (choice == "auto")
    assert_close(train_rows(runs["auto"], "train/loss"), train_rows(runs[onednn.resolve("auto")], "train/loss"),
                 0, "train/loss")
    for key in ("train/loss", "train/grad_norm"):
        assert_close(train_rows(runs["onednn"], key), train_rows(runs["aten"], key), 1e-5, key)
    proc = run_trainer("sft", 1, sft_args(assets, "actor.cpu_matmul=mkl"), tmp_path / "bad", check=False)
    assert proc.returncode != 0 and "cpu_matmul='mkl'" in proc.stderr + proc.stdout


@pytest.mark.skipif(small_gemm.load()[0] is None, reason="RL2's kernel does not build here")
def test_backward_transposes_through_the_kernel_with_the_same_bits(counted, monkeypatch):
    # the weight and input gradients' operands are transposed by RL2's kernel (fix 37): an exact
    # copy, so the gradients are bit for bit those of PyTorch's strided copy
    torch.manual_seed(0)
    x0, w0, g = torch.randn(2, 45, 96), torch.randn(80, 96), torch.randn(2, 45, 80)
    real, used = small_gemm.transpose, {"n": 0}

    def counting(t):
        y = real(t)
        used["n"] += y is not None
        return y

    grads = []
    for kernel in (counting, lambda t: None):
        monkeypatch.setattr(small_gemm, "transpose", kernel)
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())  # as a model's
        onednn.linear(x, w).backward(g)
        grads.append((x.grad, w.grad))
    assert used["n"] == 1  # g, the weight gradient's first operand; W and x go as views (fix 48)
    assert counted["n"] == 6
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_non_dense_operands_are_copied_not_sent_to_the_reference_kernel(monkeypatch):
    # a sliced or expanded operand as oneDNN's weight runs its reference kernel (~1000x slower,
    # fix 48's review): the backward copies such an x transposed, and a sliced weight keeps
    # F.linear; the gradients stay those of float64 arithmetic
    calls = {"n": 0}
    real = onednn._transposed

    def counting(t):
        calls["n"] += 1
        return real(t)
    monkeypatch.setattr(onednn, "_transposed", counting)
    torch.manual_seed(0)
    wide, w0 = torch.randn(2, 30, 128), torch.randn(40, 96)
    for x0, copies in ((wide[..., :96], 2), (torch.randn(96).expand(2, 30, 96), 2),
                       (wide[..., :96].contiguous(), 1)):
        calls["n"] = 0
        x, w = x0.detach().requires_grad_(), torch.nn.Parameter(w0.clone())
        g = torch.randn(2, 30, 40)
        onednn.linear(x, w).backward(g)
        assert calls["n"] == copies  # g, and x unless its transposed view is dense
        g2, x2 = g.reshape(-1, 40).double(), x0.reshape(-1, 96).double()
        assert torch.allclose(w.grad.double(), g2.t() @ x2, atol=1e-4)
        assert torch.allclose(x.grad.double(), (g2 @ w0.double()).view(2, 30, 96), atol=1e-4)
    sliced = torch.randn(40, 128)[:, :96]  # not dense: not eligible, F.linear's autograd
    x = torch.randn(2, 30, 96)
    assert not onednn._eligible(x, sliced) and onednn._eligible(x, sliced.contiguous())
    assert onednn._eligible(x, torch.randn(96, 40).t())  # column-major: dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_weight_operands_as_views_give_the_same_bits(dtype):
    # fix 48: the products' second operand goes as a transposed view, which oneDNN's product
    # takes as it is (ATen's _linear_pointwise copies only its first operand); the gradients are
    # bit for bit those of products on contiguous transposed copies
    torch.manual_seed(0)
    x0, w0, g = (torch.randn(*s, dtype=dtype) for s in ((3, 45, 96), (80, 96), (3, 45, 80)))
    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    onednn.linear(x, w).backward(g)
    g2, x2 = g.reshape(-1, 80), x0.reshape(-1, 96)
    grad_x = onednn._mm(g2, w0.t().contiguous(), None).view(3, 45, 96)
    grad_w = onednn._mm(g2.t().contiguous(), x2.t().contiguous(), None)
    assert torch.equal(x.grad, grad_x) and torch.equal(w.grad, grad_w)
    assert torch.allclose(w.grad.double(), g2.double().t() @ x2.double(), rtol=0.05, atol=0.05)
