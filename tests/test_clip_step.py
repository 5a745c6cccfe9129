"""Worker.step's clip by the global norm folded into fused AdamW (fix 51): the same update as
scaling every gradient first and stepping (torch's clip_grad_norm_ + AdamW), on plain tensors
and on FSDP2 shards (2 gloo ranks against one process); other optimizers scale the gradients."""

import pytest
import torch
from omegaconf import OmegaConf

from tests.dist_utils import run_dist

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g) * 3, torch.randn(4, 3, generator=g)) for _ in range(STEPS)]


def _worker(model, optimizer, max_norm, max_nonfinite_steps=5):
    from RL2.workers.worker import Worker, make_scheduler

    w = Worker.__new__(Worker)
    w.cfg = OmegaConf.create(dict(offload_optimizer=False, max_grad_norm=max_norm, warmup_ratio=0.0,
                                  min_lr_ratio=0.0, scheduler="constant",
                                  max_nonfinite_steps=max_nonfinite_steps))
    w.device, w.model, w.optimizer, w.nonfinite_streak = "cpu", model, optimizer, 0
    w.scheduler = make_scheduler(optimizer, w.cfg, STEPS)
    return w


def _loss(model, x, y):
    return (model(x) - y).square().sum()


def _reference(max_norm, fused=True):
    """clip_grad_norm_ (gradients scaled in place), then the optimizer step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused, foreach=None if fused else False)
    norms = []
    for x, y in _batches():
        _loss(model, x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("fused", [True, False])
def test_clip_folded_into_fused_adamw_matches_scaling_first(fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused, foreach=None if fused else False)
    w = _worker(model, opt, 0.5)
    scaled = []
    real_step = opt.step

    def step(*a, **kw):  # what the optimizer was handed: a divisor (fused) or scaled gradients
        scaled.append(getattr(opt, "grad_scale", None))
        return real_step(*a, **kw)

    opt.step = step
    norms = []
    for x, y in _batches():
        _loss(model, x, y).backward()
        norms.append(w.step())
    want, want_norms = _reference(0.5, fused)
    assert all(n > 0.5 for n in want_norms)  # every step really clips
    assert norms == pytest.approx(want_norms, rel=1e-6)
    for got, ref in zip(model.parameters(), want):
        # x / (1 / c) against x * c: fp32 rounding apart; without fusion the same bits
        torch.testing.assert_close(got.detach(), ref, rtol=0 if not fused else 1e-6,
                                   atol=0 if not fused else 1e-6)
    assert not hasattr(opt, "grad_scale")  # not left for the next step
    if fused:
        assert all(s is not None and s.item() == pytest.approx(n / 0.5, rel=1e-6)
                   for s, n in zip(scaled, want_norms))
    else:
        assert scaled == [None] * STEPS


def test_no_clip_hands_no_divisor():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    w = _worker(model, opt, 1e6)
    for x, y in _batches():
        _loss(model, x, y).backward()
        w.step()
    want, _ = _reference(1e6)
    for got, ref in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach(), ref, rtol=0, atol=0)


def test_nonfinite_steps_are_skipped_and_a_streak_stops_the_run():
    """A non-finite grad norm skips the step (the weights stay as they were); a finite step ends
    the streak; max_nonfinite_steps in a row raise, naming the key, instead of a run that skips
    every step and exits 0 (found by a hostile-input probe)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    w = _worker(model, opt, 0.5, max_nonfinite_steps=2)
    x, y = _batches()[0]

    def nan_step():
        before = [p.detach().clone() for p in model.parameters()]
        (_loss(model, x, y) * float("nan")).backward()
        norm = w.step()
        assert norm != norm  # NaN
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b) and p.grad is None

    nan_step()
    _loss(model, x, y).backward()
    w.step()  # finite: the streak starts again
    nan_step()
    with pytest.raises(FloatingPointError, match=r"2 optimizer steps in a row \(max_nonfinite_steps=2\)"):
        nan_step()
    never = _worker(_model(), torch.optim.AdamW(_model().parameters()), 0.5, max_nonfinite_steps=0)
    for _ in range(3):
        (_loss(never.model, x, y) * float("inf")).backward()
        never.step()  # 0: skip forever, as before


def test_the_default_nonfinite_limit_is_set():
    from RL2.utils.config import load_config

    cfg = load_config("ppo", ["actor.model_name=m", "data.train.path=x", "actor.rollout.env_path=x"])
    assert cfg.actor.max_nonfinite_steps == cfg.critic.max_nonfinite_steps == 5


def _fsdp_clip(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _model()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    w = _worker(model, opt, 0.5)
    norms = []
    for x, y in _batches():
        # each rank the half of the rows it holds; FSDP averages the gradients: halve the sum loss
        _loss(model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).mul(world).backward()
        norms.append(w.step())
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # plain lists: a tensor would cross the queue as shared memory of an exited process
    return norms, [p.full_tensor().detach().tolist() for p in model.parameters()]


def test_clip_folded_on_fsdp2_shards_equals_one_process():
    want, want_norms = _reference(0.5)
    for norms, params in run_dist(_fsdp_clip, 2):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for got, ref in zip(params, want):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-6)
