"""In-flight weight updates on the real embedded engine: a generation aborted mid-turn continues
from its partial tokens (versions per segment) or is requeued; the default `abort_requests`."""
import asyncio

import pytest

from RL2.rollout.engine import SamplingParams
from RL2.rollout.torch_engine import TorchEngine
from RL2.rollout.trajectory import Requeue, generate_turn

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(assets):
    return TorchEngine(assets["model"], None, device="cpu", seed=0)  # no tokenizer: no eos stop


def run(engine, on_abort, interrupt_after: int | None):
    """generate_turn, greedy, 12 tokens; after `interrupt_after` decoded tokens the engine's
    requests are aborted and the weight version becomes 1 (as Producer._load_inflight does)."""
    version = [0]

    async def interrupt():
        while not any(len(s.tokens) >= interrupt_after for s in engine._rows):
            await asyncio.sleep(0)
        engine.abort_requests()
        version[0] = 1

    async def main():
        job = asyncio.ensure_future(generate_turn(engine, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=12),
                                                  clock=lambda: version[0], on_abort=on_abort))
        if interrupt_after is not None:
            await interrupt()
        return await job

    return asyncio.run(main())


def test_paused_turn_continues_from_its_partial_tokens(engine):
    straight = run(engine, "continue", None)
    assert straight.versions == [[0, 12]] and straight.finish_reason == "length"
    paused = run(engine, "continue", 3)
    # greedy: the continuation under (here unchanged) weights is the same sequence
    assert paused.token_ids == straight.token_ids
    assert paused.logprobs == pytest.approx(straight.logprobs, abs=1e-5)
    n0 = paused.versions[0][1]
    assert paused.versions == [[0, n0], [1, 12 - n0]] and 3 <= n0 < 12
    assert paused.finish_reason == "length"


def test_aborted_turn_is_requeued_or_returned(engine):
    with pytest.raises(Requeue):
        run(engine, "restart", 3)
    out = run(engine, None, 3)  # synchronous rollout: the abort is returned as is
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 12 and out.versions[0][0] == 0


class FakeRollout:
    """Records which weight version each batch started with (no engine, no collectives)."""
    engine, loop = None, None

    def __init__(self):
        self.calls = []

    def run_batch(self, prompt_source, t):
        from RL2.rollout.rollout import RolloutBatch

        assert prompt_source(0) == (t, 0)
        # `clock` is set by Producer before its thread starts (a `producer` attribute assigned
        # after the constructor returned raced with the thread's first batch under load)
        self.calls.append((t, self.clock()))
        return RolloutBatch(t)


def test_producer_schedule_and_quiesce():
    from RL2.rollout.producer import Producer

    fake = FakeRollout()
    p = Producer(fake, lambda t, k: (t, k), k=2, mode="none", version=0, n_steps=6)
    assert p.get(0).step == 0
    p.publish(1, None)
    p.quiesce()  # parks before batch 1 + 2 + 1: batches 1-3 are generated, 4 is not started
    assert sorted(p.buffered()) == [1, 2, 3] and p.next == 4
    p.resume()
    for t in range(1, 6):
        assert p.get(t).step == t
        p.publish(t + 1, None)
    p.stop()
    # batch t started with exactly version max(0, t - k): a deterministic schedule
    assert fake.calls == [(t, max(0, t - 2)) for t in range(6)]
    # a resumed producer continues after its buffered batches, from the checkpoint's version
    fake2 = FakeRollout()
    q = Producer(fake2, lambda t, k: (t, k), k=2, mode="none", version=2, n_steps=6,
                 buffered={2: None, 3: None, 4: None})
    q.publish(3, None)
    assert q.get(5).step == 5 and fake2.calls == [(5, 3)]
    q.stop()
