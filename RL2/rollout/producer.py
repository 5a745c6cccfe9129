"""Asynchronous rollout (`actor.rollout.max_staleness=k >= 1`): a producer thread generates the
train batches of later steps while the trainer updates, bounded by weight staleness.

Versions: version v = the weights after v optimizer steps; train step t (from 0) updates version
t. Batch t may start once the engine can hold version need(t) = max(v0, t - k) (v0 = the version
the run started or resumed at), so its tokens are at most k versions old when step t trains on
them; that gate is also the buffer bound (at most k + 1 batches ahead of the trainer). Every turn
records the versions its tokens were generated with; `drop_stale` removes (and counts) groups
with a token older than k at train time — a guarantee, never triggered by this schedule.

In-flight updates (`actor.rollout.inflight_update`):
  none   the producer loads version need(t) exactly, between batches: the schedule is a pure
         function of (seed, step), so runs and resumed runs are identical.
  pause  new weights are loaded as soon as they are published, at a scheduler step boundary
         (a callback on the producer's event loop): in-flight generations are aborted and
         continue from their partial tokens with the new weights (partial rollout).
  abort  the same, but a trajectory whose generation was cut restarts from scratch (requeued).

Threads and collectives: only the producer thread runs the rollout event loop and the rollout
gloo group (`Rollout.cpu_group`, gathering each batch: every rank's producer runs the batches in
the same order); the trainer's thread owns the default group (FSDP, weight snapshots). Weight
snapshots are taken on the trainer's thread (a collective) and loaded into the engine on the
producer's thread. `quiesce()` parks the producer at a batch boundary every rank agrees on,
so the trainer can evaluate or checkpoint with the loop and the rollout group to itself.
"""
import logging
import threading
import time

from RL2.rollout.engine import on_this_cuda_device

logger = logging.getLogger(__name__)

INFLIGHT_MODES = ("none", "pause", "abort")
_ON_ABORT = {"none": None, "pause": "continue", "abort": "restart"}


def drop_stale(groups: list[list], step: int, k: int) -> tuple[list[list], int]:
    """Groups whose every trajectory's oldest token is at most k versions behind `step` (the
    version being trained), and how many trajectories were too old (their groups are dropped
    whole: group baselines need every sample of a prompt)."""
    kept, dropped = [], 0
    for g in groups:
        stale = sum(t.min_version is not None and step - t.min_version > k for t in g)
        if stale:
            dropped += stale
        else:
            kept.append(g)
    return kept, dropped


class Producer:
    """Runs `rollout.run_batch(prompts_for(t, .), t)` for t = first.. n_steps-1 on its own thread."""

    def __init__(self, rollout, prompts_for, k: int, mode: str, version: int, n_steps: int,
                 buffered: dict | None = None):
        if mode not in INFLIGHT_MODES:
            raise ValueError(f"actor.rollout.inflight_update={mode!r}: use one of {INFLIGHT_MODES}")
        self.rollout, self.prompts_for, self.k, self.mode = rollout, prompts_for, k, mode
        self.v0 = self.engine_version = version
        self.n_steps = n_steps
        self.batches = dict(buffered or {})  # step -> RolloutBatch, generated and not yet trained
        self.next = max(self.batches, default=version - 1) + 1  # the next batch to generate
        self.snapshots = {}  # version -> weights (None on ranks without an engine)
        self.newest = version
        self.cond = threading.Condition()
        self.busy = False  # generating a batch
        self.park_before = None  # the producer stops before this batch (quiesce)
        self.error = None
        self.stopping = False
        rollout.clock = lambda: self.engine_version
        rollout.on_abort = _ON_ABORT[mode]
        self._set_device = on_this_cuda_device()  # the engine's GPU, not device 0, in the thread
        self.thread = threading.Thread(target=self._main, name="rl2-rollout-producer", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ trainer thread
    def get(self, step: int):
        """The batch of `step` (waits for it); raises the producer's error, if any."""
        with self.cond:
            self.cond.wait_for(lambda: step in self.batches or self.error is not None)
            if self.error is not None:
                raise RuntimeError(f"the rollout producer failed: {self.error!r}") from self.error
            return self.batches.pop(step)

    def publish(self, version: int, weights) -> None:
        """New weights (from `Rollout.snapshot`) for the engine; pause/abort load them at once."""
        with self.cond:
            self.snapshots[version] = weights
            self.newest = max(self.newest, version)
            self.cond.notify_all()
        if self.mode != "none":
            self.rollout.loop.call_soon_threadsafe(self._load_inflight)

    def quiesce(self) -> None:
        """Park the producer before the first batch it cannot start yet (the same on every rank:
        batch newest + k + 1 needs weights not published), waiting for the batches before it."""
        with self.cond:
            self.park_before = self.newest + self.k + 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.error is not None or (
                not self.busy and self.next >= min(self.park_before, self.n_steps)))
            if self.error is not None:
                raise RuntimeError(f"the rollout producer failed: {self.error!r}") from self.error

    def load_newest(self) -> None:
        """While parked: put the newest published weights into the engine (for evaluation)."""
        self._load(self.newest)

    def resume(self) -> None:
        with self.cond:
            self.park_before = None
            self.cond.notify_all()

    def buffered(self) -> dict:
        """While parked: the generated, untrained batches (what a checkpoint must keep)."""
        with self.cond:
            return dict(self.batches)

    def stop(self, timeout: float = 60.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout)

    # ------------------------------------------------------------------ producer thread
    def _need(self, t: int) -> int:
        return max(self.v0, t - self.k)

    def _target(self) -> int | None:
        """The weight version to load before batch `next`, or None when it is not published."""
        need = self._need(self.next)
        if self.mode == "none":
            return need if need == self.engine_version or need in self.snapshots else None
        return self.newest if self.newest >= need else None

    def _load(self, version: int) -> None:
        if version == self.engine_version:
            return
        with self.cond:
            weights = self.snapshots[version]
        engine = self.rollout.engine
        if engine is not None:
            if hasattr(engine, "next_version"):  # engine servers report the version they hold
                engine.next_version = str(version)
            self.rollout.load(weights)
        self.engine_version = version
        with self.cond:  # older snapshots are never needed again
            for v in [v for v in self.snapshots if v < version]:
                del self.snapshots[v]

    def _load_inflight(self) -> None:
        """On the producer's loop, between scheduler steps: abort running generations (they
        continue or restart per mode), then load the newest weights."""
        if self.newest == self.engine_version:
            return
        try:
            if self.rollout.engine is not None:
                self.rollout.engine.abort_requests()
            self._load(self.newest)
        except BaseException as e:  # a loop callback's exception would only be logged: hand it on
            logger.exception("in-flight weight update failed")
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait_for_work(self) -> int | None:
        with self.cond:
            while True:
                if self.stopping or self.error is not None:
                    return None
                parked = self.park_before is not None and self.next >= self.park_before
                if not parked and self.next < self.n_steps:
                    target = self._target()
                    if target is not None:
                        self.busy = True
                        return target
                self.cond.wait()

    def _main(self) -> None:
        try:
            self._set_device()
            while True:
                target = self._wait_for_work()
                if target is None:
                    return
                self._load(target)
                t, start = self.next, time.perf_counter()
                batch = self.rollout.run_batch(lambda tries: self.prompts_for(t, tries), t)
                batch.metrics["generate_seconds"] = time.perf_counter() - start
                with self.cond:
                    self.batches[t] = batch
                    self.next, self.busy = t + 1, False
                    self.cond.notify_all()
        except BaseException as e:  # handed to the trainer's thread by get() / quiesce()
            logger.exception("rollout producer failed")
            with self.cond:
                self.error, self.busy = e, False
                self.cond.notify_all()
