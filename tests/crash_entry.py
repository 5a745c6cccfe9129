"""Test-side fault injection for the resume tests: `python -m tests.crash_entry <trainer> ...`
runs RL2.trainer.<trainer> but dies like a killed job (os._exit, no cleanup) right after saving
the checkpoint of step RL2_TEST_CRASH_AFTER_STEP, or right after logging step
RL2_TEST_CRASH_AFTER_LOG_STEP (a step the resumed run replays). The library's loop carries no test hook."""
import importlib
import os
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
    importlib.import_module(f"RL2.trainer.{trainer}").main()


if __name__ == "__main__":
    main()
