"""Supervised fine-tuning.

    torchrun --nproc_per_node=N -m RL2.trainer.sft actor.model_name=... data.train.path=...
"""
from functools import partial

from RL2.data.formats import tokenize_sft
from RL2.trainer.base import Trainer
from RL2.workers.actor import Actor


class SFTTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.data.train
        tokenize = partial(
            tokenize_sft, tokenizer=self.tokenizer, prompt_key=d.prompt_key,
            response_key=d.response_key, messages_key=d.messages_key,
            apply_chat_template=d.apply_chat_template, max_length=d.max_length)
        self.train_data, self.test_data = self.load_splits(tokenize)
        self.check_lengths(self.train_data + self.test_data)
        self.n_steps = self.total_steps(len(self.train_data), d.batch_size)
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.maybe_resume()

    def check_lengths(self, samples):
        a = self.cfg.actor
        capacity = a.max_length_per_device * a.sp_size * a.tp_size
        longest = max(len(s["input_ids"]) for s in samples)
        if longest > capacity:
            raise SystemExit(
                f"a sequence of {longest} tokens exceeds the per-device budget "
                f"actor.max_length_per_device*sp_size*tp_size = {capacity}; raise "
                f"actor.max_length_per_device or actor.sp_size, or lower data.train.max_length")

    def train_step(self, step: int) -> dict:
        return self.batch_step(step, self.actor.sft_update)

    def evaluate(self) -> dict:
        if not self.test_data:
            return {}
        return {"test/loss": self.actor.sft_eval(self.test_data)}


def main():
    SFTTrainer.launch("sft")


if __name__ == "__main__":
    main()
