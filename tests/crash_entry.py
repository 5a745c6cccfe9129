"""Test-side fault injection for the resume tests: `python -m tests.crash_entry <trainer> ...`
runs RL2.trainer.<trainer> but dies like a killed job (os._exit, no cleanup) right after saving
the checkpoint of step RL2_TEST_CRASH_AFTER_STEP, or right after logging step
RL2_TEST_CRASH_AFTER_LOG_STEP (a step the resumed run replays), or SIGKILLs itself when the
RL2_TEST_SIGKILL_IN_UPDATE-th PPO actor update of this process starts (mid-step: its batch taken,
the log-probs computed, the producer generating later batches). The library's loop carries no test hook."""
import importlib
import os
import signal
import sys

from RL2.trainer.base import Trainer


def main():
    trainer = sys.argv.pop(1)
    if "RL2_TEST_CRASH_AFTER_STEP" in os.environ:
        crash_step = int(os.environ["RL2_TEST_CRASH_AFTER_STEP"])
        save = Trainer.save

        def save_then_die(self, step: int):
            save(self, step)
            if step == crash_step:
                os._exit(17)

        Trainer.save = save_then_die
    if "RL2_TEST_CRASH_AFTER_LOG_STEP" in os.environ:  # die after logging a step not checkpointed
        from RL2.utils.logging import MetricLogger

        log_step = int(os.environ["RL2_TEST_CRASH_AFTER_LOG_STEP"])
        log = MetricLogger.log

        def log_then_die(self, metrics, step, advance=True):
            log(self, metrics, step, advance)
            if advance and step == log_step:
                os._exit(17)

        MetricLogger.log = log_then_die
    if "RL2_TEST_SIGKILL_IN_UPDATE" in os.environ:
        kill_at, calls = int(os.environ["RL2_TEST_SIGKILL_IN_UPDATE"]), [0]
        ppo = importlib.import_module("RL2.trainer.ppo")
        update = ppo.actor_update

        def update_then_die(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return update(*args, **kwargs)

        ppo.actor_update = update_then_die
    importlib.import_module(f"RL2.trainer.{trainer}").main()


if __name__ == "__main__":
    main()
