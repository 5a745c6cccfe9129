"""TorchEngine against HF references: greedy == model.generate, log-probs == HF forward,
sampling, stops, n, seeds, weight updates, bad inputs, memory release, make_engine."""
import asyncio
import random
import string

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from RL2.rollout.engine import GenerationOutput, SamplingParams, make_engine
from RL2.rollout.torch_engine import TorchEngine

VOCAB = 64
EOS = 63


class CharTokenizer:
    """Id-level fake tokenizer: token i decodes to one known character (eos = '.')."""
    chars = string.ascii_letters + string.digits + " ."
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.chars[i] for i in ids)


def tiny_model(seed=0, tie=False, max_pos=128):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=0.2, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def random_prompts(n, seed=0, lo=1, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(model, prompt, max_new_tokens, eos=EOS):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def hf_logprobs(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def staggered(engine, jobs, gap=3):
    """Submit (prompt, params) jobs one by one, `gap` event-loop turns apart, so that later
    requests join a batch that is already decoding."""
    async def one(i, prompt, params):
        for _ in range(i * gap):
            await asyncio.sleep(0)
        return await engine.generate(prompt, params)
    return await asyncio.gather(*[one(i, p, s) for i, (p, s) in enumerate(jobs)])


def test_greedy_matches_hf_generate_concurrent_and_staggered(model, monkeypatch):
    engine = TorchEngine(model, CharTokenizer())
    merges = []
    orig_join = engine._join
    monkeypatch.setattr(engine, "_join", lambda *a: (merges.append(bool(engine._rows)), orig_join(*a)))
    mixed = _count_mixed(monkeypatch)
    prompts = random_prompts(12)
    lengths = [5 + 3 * (i % 5) for i in range(12)]
    jobs = [(p, SamplingParams(temperature=0, max_new_tokens=k)) for p, k in zip(prompts, lengths)]
    together = asyncio.run(staggered(engine, jobs, gap=0))
    apart = asyncio.run(staggered(engine, jobs, gap=4))
    assert any(merges), "no request joined a running batch"
    assert any(rows for rows, _ in mixed), "no prompt was prefilled in a decode step's pass"
    for (prompt, params), a, b in zip(jobs, together, apart):
        ref = hf_greedy(model, prompt, params.max_new_tokens)
        assert a[0].token_ids == ref and b[0].token_ids == ref
        assert a[0].finish_reason == ("stop" if ref[-1] == EOS else "length")
        torch.testing.assert_close(torch.tensor(a[0].logprobs), hf_logprobs(model, prompt, ref, 1.0),
                                   atol=1e-5, rtol=0)
    assert not engine._rows


def test_identical_prompts_of_separate_requests_are_prefilled_once():
    """A GRPO group whose samples are trajectories of their own sends one request per sample:
    each distinct prompt is prefilled once for all of them, and every sample is still the
    model's (greedy == HF generate, sampled log-probs == HF's)."""
    model = tiny_model(seed=0)
    engine = TorchEngine(model, None, prefix_cache_mb=0)
    a, b = random_prompts(2, seed=5, lo=10, hi=20)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    sampled = [SamplingParams(temperature=0.9, max_new_tokens=6, seed=s) for s in range(3)]
    jobs = [(a, greedy), (b, greedy), (a, greedy)] + [(a, p) for p in sampled] + [(b, sampled[0])]
    outs = asyncio.run(_gather(*[engine.generate(p, params) for p, params in jobs]))
    assert engine.stats["prefill_tokens"] == len(a) + len(b)  # one admission, two prompts
    for (prompt, params), (out,) in zip(jobs, outs):
        if params.temperature == 0:
            assert out.token_ids == hf_greedy(model, prompt, 6)
        torch.testing.assert_close(torch.tensor(out.logprobs),
                                   hf_logprobs(model, prompt, out.token_ids, params.temperature or 1.0),
                                   atol=1e-5, rtol=0)
    assert len({tuple(o[0].token_ids) for o in outs[3:6]}) > 1  # the samples' own seeds


def _count_mixed(monkeypatch) -> list:
    """Record (decode rows, prompts with a cached prefix) of every llama_forward.mixed pass."""
    import RL2.rollout.llama_forward as llama_forward

    calls, mixed = [], llama_forward.mixed

    def counted(model, tokens, kv, suffixes, prefixes, *a, **kw):
        calls.append((0 if tokens is None else len(tokens), sum(p is not None for p in prefixes)))
        return mixed(model, tokens, kv, suffixes, prefixes, *a, **kw)
    monkeypatch.setattr(llama_forward, "mixed", counted)
    return calls


@pytest.mark.parametrize("cache_mb", [512, 0.03, 0])  # roomy, a few entries (LRU), disabled
def test_multi_turn_prefix_reuse_matches_hf_and_is_dropped_on_update(cache_mb, monkeypatch):
    m1, m2 = tiny_model(seed=0), tiny_model(seed=1)
    mixed = _count_mixed(monkeypatch)
    engine = TorchEngine(tiny_model(seed=0), None, prefix_cache_mb=cache_mb)
    greedy, obs = SamplingParams(temperature=0, max_new_tokens=8), [7, 8, 9]

    async def agent(i, prompt, turns=3):
        await asyncio.sleep(0.001 * i)
        for _ in range(turns):
            prompt = prompt + (await engine.generate(prompt, greedy))[0].token_ids + obs
        return prompt
    prompts = random_prompts(5, seed=11)
    contexts = asyncio.run(_gather(*[agent(i, p) for i, p in enumerate(prompts)]))
    assert (engine.stats["cached_prompt_tokens"] > 0) == (cache_mb > 0)
    assert engine.prefix_cache.nbytes <= engine.prefix_cache.max_bytes
    for prompt, context in zip(prompts, contexts):
        for _ in range(3):
            prompt = prompt + hf_greedy(m1, prompt, 8, eos=None) + obs
        assert prompt == context
    if cache_mb:  # a later turn's prompt ran over its cached prefix in another row's decode pass
        assert any(rows and hits for rows, hits in mixed), mixed
    # The stored KV belongs to m1: after the update a continuation must not reuse it.
    engine.update_weights(m2.state_dict().items())
    before = engine.stats["cached_prompt_tokens"]
    out = asyncio.run(engine.generate(contexts[0], greedy))[0].token_ids
    assert engine.stats["cached_prompt_tokens"] == before
    assert out == hf_greedy(m2, contexts[0], 8, eos=None)


async def _gather(*coros):
    return await asyncio.gather(*coros)


def test_batch_kv_matches_naive_reference():
    """Random adds / decode writes / evictions on BatchKV == a naive pad-and-concat cache."""
    from RL2.rollout.kv_cache import BatchKV
    rng = random.Random(0)
    kv, ref, mask = BatchKV(), None, None   # ref: [B, 1, W, 1] naive cache, mask [B, W]
    most_rows = most_cols = 0
    moves, move = [], kv._move  # the window moved within its buffers (not reallocated)
    kv._move = lambda left: (moves.append(left), move(left))
    for step in range(800):
        op = rng.random()
        if ref is None or op < 0.2:
            r, w = rng.randint(1, 3), rng.randint(1, 12)
            x = torch.randn(r, 1, w, 1)
            m = torch.zeros(r, w, dtype=torch.long)
            for i in range(r):
                m[i, rng.randint(0, w - 1):] = 1
            x = x * m[:, None, :, None]
            room = rng.randint(0, 8)
            kv.add([x], [2 * x], m.sum(1), room=room)  # values = 2 * keys (exact in float)
            if ref is None:
                ref, mask = x, m
            else:
                width = max(ref.shape[2], w)
                ref = torch.cat([F.pad(ref, (0, 0, width - ref.shape[2], 0)), F.pad(x, (0, 0, width - w, 0))])
                mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)), F.pad(m, (width - w, 0))])
        elif op < 0.8:
            col = torch.randn(ref.shape[0], 1, 1, 1)
            kv.reserve(1)
            keys, _ = kv.write(0, col[:, :, 0], 2 * col[:, :, 0])
            kv.advance()
            ref, mask = torch.cat([ref, col], 2), torch.cat([mask, torch.ones(ref.shape[0], 1, dtype=torch.long)], 1)
            assert torch.equal(keys * mask[:, None, :, None], ref * mask[:, None, :, None])
        else:
            # in the second half a row always stays: the window then drifts right with the
            # decode steps (an empty batch recentres it) and must move or grow
            least = min(int(step >= 200), ref.shape[0])
            keep = sorted(rng.sample(range(ref.shape[0]), rng.randint(least, ref.shape[0])))
            order = kv.compact(keep)
            assert sorted(order) == keep
            if not order:
                ref = mask = None
                continue
            ref, mask = ref[order], mask[order]
            first = int(mask.any(0).int().argmax())  # compact drops columns no row uses
            ref, mask = ref[:, :, first:], mask[:, first:]
        m = mask[:, None, :, None]
        live_k, live_v = kv.k[0][:kv.rows, :, kv.start:kv.end], kv.v[0][:kv.rows, :, kv.start:kv.end]
        assert live_k.shape == ref.shape
        assert torch.equal(live_k * m, ref * m) and torch.equal(live_v * m, 2 * ref * m)
        assert torch.isfinite(live_k).all() and torch.isfinite(live_v).all()
        assert torch.equal(kv.lens, mask.sum(1))  # = each row's next position id
        assert torch.equal(torch.isfinite(kv.bias(extra=0))[:, 0, 0], mask.bool())
        # buffers stay proportional to the live batch (reallocations for columns keep the rows)
        most_rows, most_cols = max(most_rows, kv.rows), max(most_cols, kv.end - kv.start + 8)
        assert kv.k[0].shape[0] <= 2 * most_rows, (step, kv.k[0].shape, most_rows)
        assert kv.k[0].shape[2] <= 4 * most_cols + 16, (step, kv.k[0].shape, most_cols)
    assert len(moves) >= 3 and kv.reallocs >= 3, (len(moves), kv.reallocs)  # both paths ran


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.3, max_new_tokens=12, n=2, seed=1),
    SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=12, n=2, seed=2),
])
def test_sampled_logprobs_match_hf_forward(model, params):
    engine = TorchEngine(model, None)
    prompts = random_prompts(6, seed=1)
    outs = asyncio.run(staggered(engine, [(p, params) for p in prompts], gap=2))
    for prompt, samples in zip(prompts, outs):
        assert len(samples) == params.n
        for s in samples:
            ref = hf_logprobs(model, prompt, s.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)
            if params.top_k > 0:  # every sampled token lies in the top-k / nucleus of its step
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1:-1]
                probs, order = torch.softmax(logits / params.temperature, -1).sort(-1, descending=True)
                rank = (order == torch.tensor(s.token_ids)[:, None]).int().argmax(-1)
                assert (rank < params.top_k).all()
                mass_before = (probs.cumsum(-1) - probs).gather(1, rank[:, None])[:, 0]
                assert (mass_before < params.top_p).all()


def test_sampling_distribution(model):
    """Empirical next-token frequencies follow the (filtered) softmax."""
    engine = TorchEngine(model, None)
    prompt = [3, 14, 15, 9]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.8, -1)
    for top_k in (-1, 4):
        params = SamplingParams(temperature=0.8, top_k=top_k, max_new_tokens=1, n=4000, seed=top_k)
        outs = asyncio.run(engine.generate(prompt, params))
        counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=VOCAB).double()
        expected = probs.double().clone()
        if top_k > 0:
            expected[expected.argsort(descending=True)[top_k:]] = 0
        expected /= expected.sum()
        assert (counts[expected == 0] == 0).all()
        assert (counts / 4000 - expected).abs().max() < 0.03


def test_seeded_sampling_reproducible_and_batch_independent(model):
    engine = TorchEngine(model, None)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, n=3, seed=123)
    prompt = random_prompts(1, seed=5)[0]
    alone = asyncio.run(engine.generate(prompt, params))
    others = [(p, SamplingParams(temperature=1.0, max_new_tokens=15)) for p in random_prompts(5, seed=6)]
    crowded = asyncio.run(staggered(engine, others[:2] + [(prompt, params)] + others[2:], gap=1))[2]
    assert [o.token_ids for o in alone] == [o.token_ids for o in crowded]
    assert len({tuple(o.token_ids) for o in alone}) == 3  # the n samples differ
    other_seed = asyncio.run(engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": 124})))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in alone]


def test_stop_strings_and_stop_ids(model):
    tok = CharTokenizer()
    engine = TorchEngine(model, tok)
    prompt = random_prompts(1, seed=7)[0]
    free = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30)))[0]
    tokens = free.token_ids
    assert EOS not in tokens and len(tokens) == 30, "pick another prompt: this one hits eos"
    # Stop string = 2 characters starting at index 6: output ends with the token completing it.
    stop = tok.decode(tokens[6:8])
    first = next(k for k in range(1, 31) if stop in tok.decode(tokens[:k]))
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30, stop=["zzz", stop])))[0]
    assert out.token_ids == tokens[:first] and out.finish_reason == "stop"
    assert out.logprobs == pytest.approx(free.logprobs[:first], abs=1e-6)
    # Stop token id: kept as the last token.
    sid = tokens[10]
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=[sid])))[0]
    assert out.token_ids == tokens[:tokens.index(sid) + 1] and out.finish_reason == "stop"


def test_stop_string_with_bpe_tokenizer():
    from RL2.tools.make_assets import build_tokenizer
    tok = build_tokenizer()
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2)
    model = Qwen2ForCausalLM(cfg).eval()
    engine = make_engine("torch", model, tok)
    prompt = tok("the answer is")["input_ids"]
    free = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=[])))[0]
    text = tok.decode(free.token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    first = next(k for k in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:k]))
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, stop=[stop])))[0]
    assert out.token_ids == free.token_ids[:first] and out.finish_reason == "stop"


def test_update_weights_switches_model():
    m1, m2 = tiny_model(seed=0, tie=True), tiny_model(seed=1, tie=True)
    engine = TorchEngine(tiny_model(seed=0, tie=True), CharTokenizer())
    prompts = random_prompts(4, seed=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    run = lambda: [o[0].token_ids for o in asyncio.run(staggered(engine, [(p, greedy) for p in prompts]))]
    assert run() == [hf_greedy(m1, p, 12) for p in prompts]
    engine.update_weights((k, v.to(torch.bfloat16).float()) for k, v in m2.state_dict().items())
    engine.update_weights(m2.state_dict().items())
    assert run() == [hf_greedy(m2, p, 12) for p in prompts]
    with pytest.raises(KeyError, match="nope"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_bad_inputs(model):
    engine = TorchEngine(model, None, max_model_len=40)

    async def gen(prompt, **kw):
        return await engine.generate(prompt, SamplingParams(**kw))
    for prompt, kw, msg in [
        ([], {}, "empty prompt"),
        ([1] * 40, {}, "max_model_len"),
        ([1, VOCAB], {}, "token ids"),
        ([1], {"temperature": -0.5}, "temperature"),
        ([1], {"top_p": 0.0}, "top_p"),
        ([1], {"top_p": 1.5}, "top_p"),
        ([1], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1], {"n": 0}, "n must be"),
        ([1], {"stop": ["x"]}, "tokenizer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            asyncio.run(gen(prompt, **kw))
    out = asyncio.run(gen([1] * 35, temperature=0, max_new_tokens=20))[0]  # context reached
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize("failing_call", [1, 3])  # 1: the prefill, 3: a decode step
@pytest.mark.parametrize("fast", [True, False], ids=["own_forward", "hf_forward"])
def test_scheduler_error_reaches_every_caller_then_recovers(model, monkeypatch, failing_call, fast):
    import RL2.rollout.llama_forward as llama_forward

    engine = TorchEngine(model, None, own_forward=fast)
    assert engine.own_forward == fast
    calls = {"n": 0}

    def flaky(fn):
        def wrapped(*a, **kw):
            calls["n"] += 1
            if calls["n"] == failing_call:
                raise RuntimeError("boom")
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(model, "forward", flaky(model.forward))
    monkeypatch.setattr(llama_forward, "prefill", flaky(llama_forward.prefill))
    monkeypatch.setattr(llama_forward, "decode", flaky(llama_forward.decode))

    async def main():
        jobs = [engine.generate(p, SamplingParams(temperature=0, max_new_tokens=10)) for p in random_prompts(4)]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout=10)
    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "boom" in str(r) for r in results)
    ok = asyncio.run(engine.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4)))
    assert ok[0].token_ids == hf_greedy(model, [1, 2, 3], 4, eos=None)


def test_cancelled_caller_is_evicted(model):
    engine = TorchEngine(model, None)

    async def main():
        long = asyncio.create_task(engine.generate([1, 2], SamplingParams(temperature=0, max_new_tokens=100, stop_token_ids=[])))
        short = engine.generate([3, 4], SamplingParams(temperature=0, max_new_tokens=5))
        out = await short
        long.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        return out
    out = asyncio.run(main())
    assert out[0].token_ids == hf_greedy(model, [3, 4], 5, eos=None)
    assert not engine._rows


def test_release_resume_shutdown(model):
    engine = TorchEngine(model, None)

    async def main():
        task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=100, n=2)))
        for _ in range(6):
            await asyncio.sleep(0)
        engine.release_memory()
        out = await task
        with pytest.raises(RuntimeError, match="released"):
            await engine.generate([1], SamplingParams())
        engine.resume_memory()
        return out, await engine.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4))
    aborted, fresh = asyncio.run(main())
    assert [o.finish_reason for o in aborted] == ["abort", "abort"] and 0 < len(aborted[0].token_ids) < 100
    assert fresh[0].token_ids == hf_greedy(model, [1, 2, 3], 4, eos=None)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(engine.generate([1], SamplingParams()))


def test_make_engine(tmp_path, model):
    engine = make_engine("auto", model, None)
    assert isinstance(engine, TorchEngine)
    model.save_pretrained(tmp_path)
    engine = make_engine("torch", str(tmp_path), None, max_batch_size=8)
    out = asyncio.run(engine.generate([5, 6], SamplingParams(temperature=0, max_new_tokens=6)))
    assert out == [GenerationOutput(out[0].token_ids, out[0].logprobs, out[0].finish_reason)]
    assert out[0].token_ids == hf_greedy(model, [5, 6], 6, eos=None)
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tensorrt", model, None)  # vllm is a real kind now (tests/vllm)
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ImportError, match="SGLang extra"):
            make_engine("sglang", str(tmp_path), None)


def _arch_model(arch):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.2)
    torch.manual_seed(3)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True)).eval()
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=24)).eval()  # q/k norms, odd head_dim
    return tiny_model(seed=3, tie=True)


@pytest.mark.parametrize("arch", ["qwen2_tied", "llama", "qwen3"])
def test_own_forward_matches_hf(arch):
    """The hand-written prefill and decode (RL2/rollout/llama_forward.py) == the HF forward: greedy tokens
    equal HF generate, log-probs equal an HF forward, on each supported architecture."""
    from RL2.rollout import llama_forward
    model = _arch_model(arch)
    assert llama_forward.supports(model)
    x = torch.randn(5, 64) * 3  # the one-call norm is bitwise HF's RMSNorm
    assert torch.equal(llama_forward._norm(model.model.norm, x), model.model.norm(x))
    engine = TorchEngine(model, None)
    assert engine.own_forward
    prompts = random_prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=12)

    async def run():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    for prompt, (out,) in zip(prompts, asyncio.run(run())):
        assert out.token_ids == hf_greedy(model, prompt, 12, eos=None)
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs(model, prompt, out.token_ids, 1.0),
                                   atol=1e-5, rtol=0)


def test_other_architectures_use_the_hf_forward():
    """GPT-2 is not Llama-family: it runs through the HF forward (no KV cache) and still
    equals HF generate."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from RL2.rollout import llama_forward
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                      initializer_range=0.2)).eval()
    assert not llama_forward.supports(gpt2)
    engine = TorchEngine(gpt2, None)
    assert not engine.own_forward
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    outs = asyncio.run(staggered(engine, [(p, params) for p in prompts], gap=2))
    for prompt, (out,) in zip(prompts, outs):
        assert out.token_ids == hf_greedy(gpt2, prompt, 6, eos=None)


def test_weight_sharing_is_all_or_nothing_and_never_writes_the_owner():
    """A one-rank WeightSync aliases only matching tensors; a mismatch shares nothing; writing
    into a sharing engine first gives it its own copy of every parameter and buffer."""
    from RL2.rollout.weight_sync import WeightSync

    owner = tiny_model(seed=1)
    engine = TorchEngine(tiny_model(seed=2), None)
    bad = [(n, t.double()) if i == 3 else (n, t) for i, (n, t) in enumerate(owner.state_dict().items())]
    assert not engine.can_share_weights(bad)
    with pytest.raises(ValueError, match="share_weights"):
        engine.share_weights(bad)
    assert not engine.weights_shared()
    assert not any(p.data_ptr() == q.data_ptr() for p, q in zip(engine.model.parameters(), owner.parameters()))

    sync = WeightSync(owner)  # plain one-process model: transport "local"
    sync(engine)
    assert sync.mode == "aliased" and engine.weights_shared()
    with torch.no_grad():
        next(owner.parameters()).add_(1.0)  # an optimizer step, in place
    sync(engine)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), owner.state_dict().values()))
    kept = {n: t.clone() for n, t in owner.state_dict().items()}
    engine.update_weights((n, torch.zeros_like(t)) for n, t in kept.items())
    assert not engine.weights_shared()
    assert all(torch.equal(t, kept[n]) for n, t in owner.state_dict().items())  # owner untouched

    # A trainer in another dtype (float64 master weights) is copied, not aliased.
    owner64 = tiny_model(seed=1).double()
    engine2 = TorchEngine(tiny_model(seed=2), None)
    sync64 = WeightSync(owner64)
    sync64(engine2)
    assert sync64.mode is None and not engine2.weights_shared()
    assert all(torch.equal(a, b.float()) for a, b in zip(engine2.model.state_dict().values(),
                                                         owner64.state_dict().values()))


def test_sample_greedy_takes_the_first_maximum_and_mixes_with_sampled_rows():
    """Greedy rows take argmax's token (the first of tied maxima, as HF generate), with the
    log-prob at T = 1; sampled rows next to them, or alone, draw from their own generators."""
    from RL2.rollout.sampling import Request, Seq, sample

    def seq(temperature, seed=None):
        req = Request([1], SamplingParams(temperature=temperature, max_new_tokens=1), None, frozenset())
        return Seq(req, None if seed is None else torch.Generator().manual_seed(seed))

    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 9.0, 0.0]])
    greedy = sample(logits, [seq(0.0), seq(0.0), seq(0.0)])
    want = torch.log_softmax(logits, -1)
    assert [t for t, _ in greedy] == [1, 0, 2] == logits.argmax(-1).tolist()
    assert [lp for _, lp in greedy] == [want[r, t].item() for r, t in enumerate([1, 0, 2])]
    mixed = sample(logits, [seq(0.0), seq(1.0, seed=3), seq(1.0, seed=4)])
    drawn = sample(logits[1:], [seq(1.0, seed=3), seq(1.0, seed=4)])  # every row sampled
    assert mixed[0] == greedy[0] and mixed[1:] == drawn
    assert mixed[2][0] == 2 and mixed[1][0] in range(4)
