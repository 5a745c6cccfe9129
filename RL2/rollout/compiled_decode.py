"""The embedded engine's decode step compiled with `torch.compile` (inductor), CPU, opt-in
(`actor.rollout.torch.compile_decode`).

Why: with the linear layers on oneDNN-packed weights, a decode step of the 25.7M-param model at
16 rows still spent ~4 ms of ~12 in some 200 small eager ops per step (RMSNorm, rotary, softmax,
residual adds, KV writes), each paying PyTorch's per-op dispatch. Inductor fuses them into a few
C++ loops called from one compiled graph (benchmarks/README.md, fix 16).

How:
- the step compiled is `llama_forward.static_step` (the step `decode_static` runs: the write
  column a tensor, padding an additive bias), given the live window of the KV buffers. Rows and
  columns are marked dynamic, so one graph serves every batch of >= 2 rows at every length. A
  one-row batch runs eagerly (dynamo specialises sizes 0 and 1).
- the linear layers stay on oneDNN's packed weights: they go through the custom op
  `rl2::packed_linear`, opaque to inductor (which would otherwise send them to aten's matmul,
  ~2.7x slower on AMD CPUs: RL2/utils/onednn.py). The op's `slot` names a (PackedLinears,
  modules) pair held here, so weights updated, shared or released are repacked exactly as in
  the eager step.
- if compiling fails (inductor needs a C++ compiler on the CPU; a model whose rotary module
  branches on data, e.g. "dynamic" RoPE, cannot be traced whole; past dynamo's recompile limit,
  which `fullgraph` turns into an error), the engine logs it once and decodes eagerly. The first
  step of each engine compiles (~15-20 s on 2 cores).
- the graph reads the modules' parameters at every call (so in-place updates and `.data`
  replacements reach it; `weights_changed` repacks the linear layers) but its module guards are
  skipped: replacing modules or Parameter objects needs a new CompiledDecode.
"""
from __future__ import annotations

import itertools
import logging
import types
import weakref

import torch

from RL2.rollout import llama_forward

logger = logging.getLogger(__name__)

_SLOTS: dict[int, tuple] = {}  # slot -> (PackedLinears, modules)
_next_slot = itertools.count()


# registered through torch.library.Library rather than the custom_op decorator: its dispatch
# costs ~5 us less per call, and a step makes ~30 calls
_LIB = torch.library.Library("rl2", "DEF")
_LIB.define("packed_linear(Tensor x, int slot, int out) -> Tensor")


def packed_linear(x: torch.Tensor, slot: int, out: int) -> torch.Tensor:
    """torch.cat([m(x) for m in modules], -1) through the slot's PackedLinears."""
    linear, projs = _SLOTS[slot]
    return linear.stacked(x, projs)


_LIB.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("rl2::packed_linear", lib=_LIB)
def _(x: torch.Tensor, slot: int, out: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out)


class _OpLinear:
    """The `linear` argument of `llama_forward` inside the compiled step: each projection (or
    stacked group) is one `rl2::packed_linear` call."""

    def __init__(self, slots: dict):
        self.slots = slots  # tuple of modules -> (slot, output features)

    def __call__(self, x: torch.Tensor, proj) -> torch.Tensor:
        slot, out = self.slots[(proj,)]
        return torch.ops.rl2.packed_linear(x, slot, out)

    def many(self, x: torch.Tensor, projs: tuple) -> list[torch.Tensor]:
        slot, out = self.slots[projs]
        return list(torch.ops.rl2.packed_linear(x, slot, out).split(
            [p.weight.shape[0] for p in projs], dim=-1))


def _free(slots: list[int]) -> None:
    for slot in slots:
        _SLOTS.pop(slot, None)


class CompiledDecode:
    def __init__(self, model, linear):
        self.model = model
        slots = {}
        for projs in llama_forward.linear_groups(model):
            slot = next(_next_slot)
            _SLOTS[slot] = (linear, projs)
            slots[projs] = (slot, sum(p.weight.shape[0] for p in projs))
        weakref.finalize(self, _free, [s for s, _ in slots.values()])
        op_linear = _OpLinear(slots)

        def step(tokens, positions, column, bias, keys, values):
            return llama_forward.static_step(model, tokens, positions, column, bias, keys,
                                               values, op_linear)

        # dynamo keeps compiled graphs per code object; the graph bakes in this instance's slots
        # and skips module guards (below), so each instance gets a code object of its own
        name = f"decode_step_{min(s for s, _ in slots.values())}"
        step = types.FunctionType(step.__code__.replace(co_name=name), step.__globals__,
                                  closure=step.__closure__)
        # the modules never change structure here (weights are updated through `.data` or in
        # place), so their guards are skipped (0.34 -> 0.14 ms per step); the inputs' stay
        # emulate_precision_casts: in bf16, round where the eager ops round (inductor would
        # otherwise keep fused intermediates in fp32 and drift from the trainer's log-probs)
        self.step = torch.compile(step, fullgraph=True, dynamic=False, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "emulate_precision_casts": True})
        self.calls = 0  # compiled steps run (tests check the compiled path is the one taken)

    def __call__(self, kv, tokens: torch.Tensor) -> torch.Tensor | None:
        """`llama_forward.decode(model, tokens, kv)` (kv.rows >= 2) through the compiled step, or
        None when it failed (e.g. no C++ compiler on this machine): logged once; the caller then
        decodes eagerly and drops this object. Re-running the step eagerly is safe: it writes the
        same column with the same keys and values."""
        # the live window (and the column written), not the whole buffers: a batch reserves
        # up to ROOM_CAP decode columns at once, so a whole-buffer step attends over ~10x more
        live = kv.live()
        keys, values = [k[live] for k in kv.k], [v[live] for v in kv.v]
        bias = kv.bias(dtype=self.model.model.embed_tokens.weight.dtype)
        column = torch.tensor([kv.end - kv.start], device=tokens.device)
        for t in (tokens, kv.lens, bias, *keys, *values):
            torch._dynamo.mark_dynamic(t, 0)  # rows
        for t in (*keys, *values):
            torch._dynamo.mark_dynamic(t, 2)  # columns
        torch._dynamo.mark_dynamic(bias, 3)
        if not self.calls:
            logger.info("compile_decode: compiling the decode step (once per engine; ~15-20 s)")
        self.calls += 1
        try:
            with torch.inference_mode():
                return self.step(tokens, kv.lens, column, bias, keys, values)
        except Exception as e:  # noqa: BLE001 - any compile failure: the eager step still works
            first = (str(e).splitlines() or [""])[0][:300]
            logger.warning("compile_decode: the compiled decode step failed (%s: %s); decoding "
                           "eagerly from now on", type(e).__name__, first)
            return None
