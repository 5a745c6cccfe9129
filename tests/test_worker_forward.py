"""The worker's forward computes logits only where a log-prob is read (`action_mask`): the same
log-probs, entropies and gradients as the full forward there, 0 elsewhere, and the lm_head sees
only those rows; on one rank and split over a ring (sp=2)."""
import os

import pytest
import torch

from tests.dist_utils import run_dist


def _actions_only_vs_full(rank, world, model_dir, data_dir, sp):
    from omegaconf import OmegaConf

    import RL2
    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows
    from RL2.workers.actor import Actor
    from transformers import AutoTokenizer

    cfg = OmegaConf.load(os.path.join(os.path.dirname(RL2.__file__), "config/worker/default.yaml"))
    cfg.model_name, cfg.dtype, cfg.sp_size = model_dir, "float32", sp
    actor = Actor(cfg, "cpu", total_steps=1, seed=0)
    assert actor.logits_for_actions_only  # an HF causal LM takes logits_to_keep
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(f"{data_dir}/sft_train.jsonl")
    samples = [tokenize_sft(rows[i], tok, max_length=64, row_index=i, source="t") for i in range(6)]
    (mb,) = actor.plan(samples)
    acts = mb.data["action_mask"].bool()
    assert 0 < acts.sum() < len(acts)  # prompts to skip and responses to keep on this rank
    rows_seen = []
    hook = actor.model.lm_head.register_forward_hook(
        lambda m, args, out: rows_seen.append(args[0].shape[-2]))
    runs = {}
    for only in (False, True):
        actor.logits_for_actions_only = only
        actor.model.zero_grad(set_to_none=True)
        out = actor.forward(mb, temperature=0.7, need_entropy=True)
        ((out["logps"] - 0.1 * out["entropy"]) * mb.data["action_mask"]).sum().backward()
        runs[only] = (out["logps"].detach(), out["entropy"].detach(),
                      [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                       for p in actor.model.parameters()])
    hook.remove()
    assert rows_seen == [len(acts), int(acts.sum())]
    (lp, ent, grads), (lp1, ent1, grads1) = runs[False], runs[True]
    # the lm_head's rows are computed alone either way: equal up to the product's blocking
    torch.testing.assert_close(lp1[acts], lp[acts], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent1[acts], ent[acts], rtol=1e-6, atol=1e-6)
    assert not lp1[~acts].any() and not ent1[~acts].any()
    for g, g1 in zip(grads, grads1):
        assert (g1 - g).norm() <= 1e-5 * g.norm() + 1e-12
    # a micro-batch with no action token (a padding one) still runs: one row, every value 0
    mb.data["action_mask"] = torch.zeros_like(mb.data["action_mask"])
    out = actor.forward(mb)
    assert out["logps"].shape == acts.shape and not out["logps"].any()
    return True


@pytest.mark.parametrize("world,sp", [(1, 1), (2, 2)])
def test_logits_only_where_log_probs_are_read(assets, world, sp):
    assert run_dist(_actions_only_vs_full, world, assets["model"], assets["data"], sp) == [True] * world


def test_only_transformers_own_forward_is_given_positions():
    """Remote code with a `logits_to_keep` argument may read it as a count: not used there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from RL2.workers.worker import takes_positions_to_keep

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32, vocab_size=64))
    assert takes_positions_to_keep(model)

    class Remote(Qwen2ForCausalLM):  # what trust_remote_code loads: its own module and forward
        def forward(self, input_ids=None, logits_to_keep=0, **kw):
            return super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kw)

    Remote.__module__ = "transformers_modules.some_org.modeling_remote"
    assert not takes_positions_to_keep(Remote(model.config))

    class Inherits(Qwen2ForCausalLM):  # a subclass keeping transformers' forward
        pass

    Inherits.__module__ = "elsewhere"
    assert takes_positions_to_keep(Inherits(model.config))
