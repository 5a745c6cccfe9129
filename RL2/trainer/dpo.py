"""Direct preference optimisation.

    torchrun --nproc_per_node=N -m RL2.trainer.dpo actor.model_name=... data.train.path=...

Per step: reference sequence log-probs of the batch (frozen copy of the initial policy, no grad)
-> one DPO optimizer step of the policy on the same pairs.
"""
import time

import torch
from omegaconf import OmegaConf

from RL2.trainer.base import Trainer
from RL2.trainer.rm import check_pair_lengths, evaluate_in_chunks, load_pairs
from RL2.workers.actor import Actor, flatten_pairs


def reference_config(cfg, device: str):
    """The actor's worker config with the `ref` overrides (same model and parallel layout)."""
    ref = OmegaConf.merge(cfg.actor, cfg.ref)
    ref.gradient_checkpointing = False
    if device == "cpu":
        ref.offload_params = False  # parameters already live in host memory (FSDP2's offload needs a GPU)
    return ref


class DPOTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_data, self.test_data = load_pairs(self, for_reward_model=False)
        check_pair_lengths(self.train_data + self.test_data, cfg.actor)
        self.n_steps = self.total_steps(len(self.train_data), cfg.data.train.batch_size)
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.ref = Actor(reference_config(cfg, self.device), self.device, train=False, seed=cfg.trainer.seed)
        self.test_ref_logps = None  # computed at the first evaluation (the reference is frozen)
        self.maybe_resume()

    def train_step(self, step: int) -> dict:
        return self.batch_step(step, self.dpo_update)

    def dpo_update(self, batch) -> dict:
        start = time.perf_counter()
        ref_logps = self.ref.compute_sequence_logps(flatten_pairs(batch)[0])
        ref_time = time.perf_counter() - start
        return dict(self.actor.dpo_update(batch, ref_logps), ref_time=ref_time)

    def evaluate(self) -> dict:
        if not self.test_data:
            return {}
        if self.test_ref_logps is None:
            self.test_ref_logps = self.ref.compute_sequence_logps(flatten_pairs(self.test_data)[0])

        def eval_chunk(idx):
            sides = torch.tensor([[2 * i, 2 * i + 1] for i in idx]).flatten()  # flatten_pairs layout
            return self.actor.dpo_eval([self.test_data[i] for i in idx], self.test_ref_logps[sides])

        return evaluate_in_chunks(len(self.test_data), self.cfg.data.test.batch_size, eval_chunk)


def main():
    DPOTrainer.launch("dpo")


if __name__ == "__main__":
    main()
