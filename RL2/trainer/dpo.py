"""Direct preference optimisation.

    torchrun --nproc_per_node=N -m RL2.trainer.dpo actor.model_name=... data.train.path=...

Per step: reference sequence log-probs of the batch (frozen copy of the initial policy, no grad)
-> one DPO optimizer step of the policy on the same pairs (RL2/algorithms/dpo.py).
"""
import time

import torch

from RL2.algorithms.dpo import dpo_eval, dpo_update
from RL2.data.packing import resolve_share_prompt
from RL2.data.pairs import check_pair_lengths, flatten_pairs, pair_tokenizer
from RL2.trainer.base import Trainer
from RL2.workers.actor import Actor


class DPOTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_data, self.test_data = self.load_splits(
            pair_tokenizer(cfg.data.train, self.tokenizer, for_reward_model=False))
        check_pair_lengths(self.train_data + self.test_data, cfg.actor)
        resolve_share_prompt(cfg.actor, self.device)  # a bad value stops the run before loading
        self.sampler, self.n_steps = self.plan_steps(len(self.train_data), cfg.data.train.batch_size)
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.ref = self.reference_model()
        self.test_ref_logps = None  # computed at the first evaluation (the reference is frozen)
        self.maybe_resume()

    def trained_workers(self) -> dict:
        return {"actor": self.actor}

    def train_step(self, step: int) -> dict:
        return self.timed_update(self.update, self.batch(step))

    def update(self, pairs: list[dict]) -> dict:
        start = time.perf_counter()
        ref_logps = self.ref.compute_sequence_logps(*flatten_pairs(pairs, self.ref.share_prompt))
        ref_time = time.perf_counter() - start
        return dict(dpo_update(self.actor, pairs, ref_logps), ref_time=ref_time)

    def evaluate(self) -> dict:
        if self.test_data and self.test_ref_logps is None:
            self.test_ref_logps = self.ref.compute_sequence_logps(
                *flatten_pairs(self.test_data, self.ref.share_prompt))

        def eval_chunk(idx):
            sides = torch.tensor([[2 * i, 2 * i + 1] for i in idx]).flatten()  # flatten_pairs layout
            return dpo_eval(self.actor, [self.test_data[i] for i in idx], self.test_ref_logps[sides])

        return self.chunked_eval(self.test_data, eval_chunk)


def main():
    DPOTrainer.launch("dpo")


if __name__ == "__main__":
    main()
