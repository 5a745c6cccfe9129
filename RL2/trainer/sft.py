"""Supervised fine-tuning.

    torchrun --nproc_per_node=N -m RL2.trainer.sft actor.model_name=... data.train.path=...
"""
from functools import partial

from RL2.algorithms.sft import sft_eval, sft_update
from RL2.data.formats import LOSS_ON, tokenize_sft
from RL2.data.packing import check_fits
from RL2.trainer.base import Trainer
from RL2.workers.actor import Actor


class SFTTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.data.train
        if d.loss_on not in LOSS_ON:
            raise SystemExit(f"data.train.loss_on={d.loss_on!r}: use one of {LOSS_ON}")
        tokenize = partial(
            tokenize_sft, tokenizer=self.tokenizer, prompt_key=d.prompt_key,
            response_key=d.response_key, messages_key=d.messages_key,
            apply_chat_template=d.apply_chat_template, max_length=d.max_length, loss_on=d.loss_on)
        self.train_data, self.test_data = self.load_splits(tokenize)
        check_fits(self.train_data + self.test_data, cfg.actor)
        self.sampler, self.n_steps = self.plan_steps(len(self.train_data), d.batch_size)
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.maybe_resume()

    def trained_workers(self) -> dict:
        return {"actor": self.actor}

    def train_step(self, step: int) -> dict:
        return self.timed_update(sft_update, self.actor, self.batch(step))

    def evaluate(self) -> dict:
        if not self.test_data:
            return {}
        return {f"test/{k}": v for k, v in sft_eval(self.actor, self.test_data).items()}


def main():
    SFTTrainer.launch("sft")


if __name__ == "__main__":
    main()
