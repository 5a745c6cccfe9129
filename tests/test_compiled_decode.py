"""The torch engine's compiled decode step (RL2/rollout/compiled_decode.py, CPU, opt-in): greedy
tokens == HF generate and log-probs == an HF forward; one graph for every batch (rows finishing
at different steps, requests joining a decoding batch, growing lengths, buffer reallocations);
weights updated in place or shared (storage replaced) are what the compiled step computes with;
a one-row batch runs eagerly; two engines in one process keep their own weights."""
import asyncio

import pytest
import torch
from torch._dynamo.utils import counters

from RL2.rollout.engine import SamplingParams, make_engine
from RL2.rollout.model_runner import KVRunner
from RL2.rollout.torch_engine import TorchEngine
from tests.run_utils import FIRST_WORD_ENV, read_metrics, run_trainer
from tests.test_torch_engine import (CharTokenizer, hf_greedy, hf_logprobs, random_prompts,
                                     staggered, tiny_model)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _greedy(engine, prompts, lengths, gap=0):
    jobs = [(p, SamplingParams(temperature=0, max_new_tokens=k)) for p, k in zip(prompts, lengths)]
    return [o[0] for o in asyncio.run(staggered(engine, jobs, gap=gap))]


def test_compiled_decode_matches_hf_with_one_graph():
    model = tiny_model(max_pos=256)
    engine = make_engine("torch", model, CharTokenizer(), compile_decode=True)
    compiled = engine.runner.compiled
    assert compiled is not None
    prompts = random_prompts(11, seed=3)
    lengths = [4 + 7 * (i % 4) for i in range(11)]  # rows finish at different steps
    before = _graphs()
    for gap in (0, 3):  # all at once; staggered (rows join a decoding batch, buffers grow)
        for prompt, k, out in zip(prompts, lengths, _greedy(engine, prompts, lengths, gap)):
            ref = hf_greedy(model, prompt, k)
            assert out.token_ids == ref
            torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs(model, prompt, ref, 1.0),
                                       atol=1e-5, rtol=0)
    assert compiled.calls >= 40, compiled.calls
    # one compiled graph served every row count (11 .. 2) and length: no recompiles, no
    # fallback to eager (which would not count as a graph)
    assert _graphs() - before == 1
    # a one-row batch runs eagerly (dynamo would specialise on size 1)
    calls = compiled.calls
    (out,) = _greedy(engine, prompts[:1], [9])
    assert out.token_ids == hf_greedy(model, prompts[0], 9) and compiled.calls == calls


def test_window_starting_at_column_zero_needs_no_second_graph():
    """The live KV window is a view into the engine's buffers; torch.compile specialises on a
    storage offset of 0 or 1, so a window starting at column 0 after the step was compiled on one
    starting later compiled a second graph mid-run (found as a slow multi-turn SmolLM2 run).
    BatchKV's buffers start a few elements into their storage: one graph for both."""
    from RL2.rollout.compiled_decode import CompiledDecode
    from RL2.rollout.kv_cache import BatchKV
    from RL2.utils.onednn import PackedLinears

    model = tiny_model(max_pos=256)
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)

    def rows(r, w):
        kv = [[torch.randn(r, heads, w, dim, generator=g) for _ in range(cfg.num_hidden_layers)]
              for _ in range(2)]
        return kv[0], kv[1], torch.full((r,), w, dtype=torch.long)

    step, kv = CompiledDecode(model, PackedLinears()), BatchKV()
    before = _graphs()
    kv.add(*rows(4, 6), room=32)
    kv.compact([0, 1])  # two rows free: the next rows join without a reallocation
    tokens = lambda: torch.randint(0, cfg.vocab_size, (kv.rows,), generator=g)
    assert kv.start > 0
    assert step(kv, tokens()) is not None
    kv.advance()
    kv.add(*rows(2, kv.end))  # as wide as every column up to `end`: the window starts at 0
    assert kv.start == 0
    assert step(kv, tokens()) is not None
    assert step.calls == 2 and _graphs() - before == 1
    assert kv.k[0][kv.live()].storage_offset() >= 2


@pytest.mark.slow
def test_compiled_decode_sees_updated_and_shared_weights():
    """update_weights copies in place, share_weights replaces each parameter's storage: both
    reach the compiled step (its linear layers repack through `rl2::packed_linear`, the other
    weights are graph inputs). A second engine in the process keeps its own weights (each
    engine compiles its own graph: the graph names its engine's packed weights)."""
    m1, m2, m3 = (tiny_model(seed=s, tie=True) for s in (0, 1, 2))
    engine = TorchEngine(tiny_model(seed=0, tie=True), CharTokenizer(), compile_decode=True)
    other = TorchEngine(tiny_model(seed=1, tie=True), CharTokenizer(), compile_decode=True)
    prompts, lengths = random_prompts(4, seed=7), [12] * 4
    tokens = lambda e: [o.token_ids for o in _greedy(e, prompts, lengths)]
    assert tokens(engine) == [hf_greedy(m1, p, 12) for p in prompts]
    assert tokens(other) == [hf_greedy(m2, p, 12) for p in prompts]
    engine.update_weights(m2.state_dict().items())
    assert tokens(engine) == [hf_greedy(m2, p, 12) for p in prompts]
    shared = {k: v.clone() for k, v in m3.state_dict().items()}
    engine.share_weights(shared.items())
    assert tokens(engine) == [hf_greedy(m3, p, 12) for p in prompts]
    assert tokens(other) == [hf_greedy(m2, p, 12) for p in prompts]
    assert engine.runner.compiled.calls > 0 and other.runner.compiled.calls > 0


def test_compiled_decode_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match="compile_decode is for the CPU"):
        KVRunner(tiny_model(), "cuda", compile_decode=True)


def test_compile_failure_falls_back_to_eager_decoding(caplog):
    """Inductor needs a C++ compiler on the CPU: if compiling fails, the engine says so once
    and decodes eagerly; no request fails."""
    model = tiny_model()
    engine = TorchEngine(model, None, compile_decode=True)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
    engine.runner.compiled.step = no_compiler
    prompts = random_prompts(3, seed=4)
    with caplog.at_level("WARNING", logger="RL2.rollout.compiled_decode"):
        outs = _greedy(engine, prompts, [8] * 3)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8, eos=None) for p in prompts]
    assert engine.runner.compiled is None
    assert [r.getMessage() for r in caplog.records if "decoding eagerly" in r.getMessage()] == [
        "compile_decode: the compiled decode step failed (RuntimeError: InvalidCxxCompiler: No "
        "working C++ compiler found); decoding eagerly from now on"]


@pytest.mark.slow  # a second compile; the fast subset keeps the fp32 one
def test_compiled_bf16_engine_rounds_as_the_eager_one():
    """In bf16 inductor would keep fused intermediates in fp32 (log-probs 0.06 away from the
    eager engine on this model); with its precision-cast emulation the two agree."""
    prompts = random_prompts(5, seed=2)
    outs = []
    for compiled in (False, True):
        engine = TorchEngine(tiny_model(), None, dtype="bfloat16", compile_decode=compiled)
        engine.model.to(torch.bfloat16)
        outs.append(_greedy(engine, prompts, [10] * 5))
    assert engine.runner.compiled.calls > 0
    for eager, compiled in zip(*outs):
        assert eager.token_ids == compiled.token_ids
        torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs),
                                   atol=1e-4, rtol=0)


@pytest.mark.slow
def test_ppo_with_the_compiled_engine_samples_the_trainers_policy(assets, tmp_path):
    """A 2-rank GRPO run with `actor.rollout.torch.compile_decode=true`: the compiled step is
    the one decoding (rank 0's log line, no fallback) and its log-probs are the trainer's
    (strict_on_policy checks them at every step; engine_kl ~ fp32 rounding)."""
    env = tmp_path / "env.py"
    env.write_text(FIRST_WORD_ENV)
    proc = run_trainer("ppo", 2, [
        f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
        f"actor.rollout.env_path={env}", "actor.rollout.torch.compile_decode=true",
        "actor.strict_on_policy=true", "actor.rollout.max_length=128",
        "actor.rollout.prompts_per_rollout=4", "actor.rollout.responses_per_prompt=4",
        "actor.rollout.train_sampling_params.max_new_tokens=6", "trainer.total_steps=3"],
        tmp_path / "run", timeout=900)
    logs = proc.stdout + proc.stderr
    assert "compile_decode: compiling the decode step" in logs, logs[-3000:]  # rank 0 logs
    assert "decoding eagerly" not in logs
    gaps = [abs(r["rollout/engine_kl"]) for r in read_metrics(tmp_path / "run")
            if "rollout/engine_kl" in r]
    assert len(gaps) == 3 and max(gaps) < 1e-6, gaps
