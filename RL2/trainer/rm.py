"""Reward-model training (Bradley-Terry on preference pairs).

    torchrun --nproc_per_node=N -m RL2.trainer.rm actor.model_name=... data.train.path=...

The model is loaded with AutoModelForTokenClassification(num_labels=1) (a causal-LM checkpoint
gets a fresh 1-wide head); the reward of a sequence is the head's output at its last token. The
final model (run_dir/final) loads with AutoModelForTokenClassification. Its config keys are the
`actor.*` worker keys, like every trainer's trained model.
"""
from RL2.algorithms.rm import rm_eval, rm_update
from RL2.data.packing import resolve_share_prompt
from RL2.data.pairs import check_pair_lengths, pair_tokenizer
from RL2.trainer.base import Trainer
from RL2.workers.critic import Critic


class RMTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_data, self.test_data = self.load_splits(
            pair_tokenizer(cfg.data.train, self.tokenizer, for_reward_model=True))
        check_pair_lengths(self.train_data + self.test_data, cfg.actor)
        resolve_share_prompt(cfg.actor, self.device)  # a bad value stops the run before loading
        self.sampler, self.n_steps = self.plan_steps(len(self.train_data), cfg.data.train.batch_size)
        self.reward_model = Critic(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.maybe_resume()

    def trained_workers(self) -> dict:
        return {"reward_model": self.reward_model}

    def train_step(self, step: int) -> dict:
        return self.timed_update(rm_update, self.reward_model, self.batch(step))

    def evaluate(self) -> dict:
        return self.chunked_eval(self.test_data, lambda idx: rm_eval(
            self.reward_model, [self.test_data[i] for i in idx]))


def main():
    RMTrainer.launch("rm")


if __name__ == "__main__":
    main()
