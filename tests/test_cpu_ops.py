"""Training RMSNorms and SiLU(gate) * up through RL2's C kernel (RL2/utils/cpu_ops.py) against
HF's modules: values and gradients, a model's logits and every gradient, what falls back or is
left alone, and an SFT run with actor.cpu_fused_ops=false against the default."""
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from RL2.utils import cpu_ops, small_gemm
from tests.run_utils import assert_close, run_trainer, sft_args, train_rows

needs_kernel = pytest.mark.skipif(not small_gemm.available(), reason="RL2's AVX-512 kernel not built here")


def _norm(k: int, seed: int = 0) -> Qwen2RMSNorm:
    norm = Qwen2RMSNorm(k, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return norm


@needs_kernel
@pytest.mark.parametrize("shape", [(2, 70, 512), (9, 37), (1, 16)])  # 37: a tail of 5 lanes
def test_forward_and_both_gradients_match_hfs_module(shape):
    g = torch.Generator().manual_seed(len(shape))
    norm = _norm(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).requires_grad_()
    grad = torch.randn(shape, generator=g)
    want = norm(x)
    want.backward(grad)
    want_dx, want_dw = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    got = cpu_ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    got.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad, want_dw, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("shape", [(2, 70, 1536), (3, 37)])  # 37: a tail of 5 lanes
def test_silu_mul_and_its_gradients_match_the_eager_ops(shape):
    g = torch.Generator().manual_seed(len(shape))
    gate = (torch.randn(shape, generator=g) * 6).requires_grad_()  # past exp's clamps too
    up = torch.randn(shape, generator=g).requires_grad_()
    grad = torch.randn(shape, generator=g)
    want = F.silu(gate) * up
    want.backward(grad)
    want_grads = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    got = cpu_ops.silu_mul(gate, up)
    got.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((gate.grad, up.grad), want_grads, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_frozen_weight_gets_no_gradient_and_threads_change_no_input_gradient():
    norm = _norm(96)
    norm.weight.requires_grad_(False)  # LoRA: the base model's norms are frozen
    x = torch.randn(50, 96, requires_grad=True)
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            x.grad = None
            cpu_ops.rms_norm(x, norm.weight, 1e-6).sum().backward()
            grads.append(x.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert norm.weight.grad is None
    assert torch.equal(grads[0], grads[1])  # each row's gradient is its own pass


def _model(seed: int = 0, **extra) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, **extra)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@needs_kernel
def test_a_models_norms_switch_and_its_logits_and_gradients_stay():
    ref, model = _model(), _model()
    assert cpu_ops.use_for_model(model) == (2 * 2 + 1, 2)  # norms: two per layer and the final one
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (ref, model):
        out = m(ids).logits
        out.pow(2).mean().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # other dtypes run HF's own forward: the same bits as the module
    for dtype in (torch.float64, torch.bfloat16):
        ref.to(dtype), model.to(dtype)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_class_whose_forward_differs_is_left_alone():
    class Qwen2RMSNorm(torch.nn.Module):  # the name of a known class, another formula
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(32)), 1e-6

        def forward(self, x):
            return self.weight * x / x.abs().mean(-1, keepdim=True)

    class Qwen2MLP(torch.nn.Module):  # likewise: the activation after the product
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(32, 32) for _ in range(3))
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.act_fn(self.down_proj(self.gate_proj(x) * self.up_proj(x)))

    model = torch.nn.Sequential(Qwen2RMSNorm(), Qwen2RMSNorm(), Qwen2MLP())
    assert cpu_ops.use_for_model(model) == (0, 0)
    assert all("forward" not in vars(m) for m in model)
    gelu = _model(hidden_act="gelu_pytorch_tanh")  # another activation: its MLPs stay
    assert cpu_ops.use_for_model(gelu) == ((2 * 2 + 1, 0) if small_gemm.available() else (0, 0))


@needs_kernel
def test_sft_without_cpu_fused_ops_matches_the_default(assets, serial, tmp_path):
    run_trainer("sft", 1, sft_args(assets, "actor.dtype=float32", "actor.cpu_fused_ops=false"), tmp_path)
    for key in ("train/loss", "train/grad_norm", "test/loss"):
        assert_close(train_rows(tmp_path, key), train_rows(serial["float32"], key), 1e-5, key)


@needs_kernel
def test_switching_leaves_the_global_generator_and_rejects_what_it_cannot_take():
    """The class checks draw their probes without moving torch's global generator (a seeded
    run's later draws must not depend on the option); the helpers refuse tensors the kernel
    cannot read, and a second derivative, rather than reading past a buffer or dropping it."""
    model = _model()
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    assert cpu_ops.use_for_model(model) == (5, 2)
    assert torch.equal(torch.rand(4), want)
    norm, x = _norm(16), torch.randn(3, 16)
    for bad in [lambda: cpu_ops.rms_norm(x[:, :8], norm.weight, 1e-6),
                lambda: cpu_ops.rms_norm(x.double(), norm.weight.double(), 1e-6),
                lambda: cpu_ops.silu_mul(x, x[:2])]:
        with pytest.raises(ValueError):
            bad()
    x.requires_grad_()
    (dx,) = torch.autograd.grad(cpu_ops.rms_norm(x, norm.weight, 1e-6).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dx.sum().backward()
