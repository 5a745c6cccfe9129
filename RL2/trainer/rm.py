"""Reward-model training (Bradley-Terry on preference pairs).

    torchrun --nproc_per_node=N -m RL2.trainer.rm actor.model_name=... data.train.path=...

The model is loaded with AutoModelForTokenClassification(num_labels=1) (a causal-LM checkpoint
gets a fresh 1-wide head); the reward of a sequence is the head's output at its last token. The
final model (run_dir/final) loads with AutoModelForTokenClassification.
"""
from functools import partial

from RL2.data.formats import tokenize_pair
from RL2.data.loader import eval_batches
from RL2.data.packing import padded_length
from RL2.trainer.base import Trainer
from RL2.workers.critic import Critic


def load_pairs(trainer: Trainer, for_reward_model: bool) -> tuple[list[dict], list[dict]]:
    """Train/test preference pairs {"chosen", "rejected", "row"} (bad rows stop the run, or are
    counted and skipped with data.train.skip_bad_rows=true)."""
    d = trainer.cfg.data.train

    def tokenize(row, row_index, source):
        chosen, rejected = tokenize_pair(
            row, trainer.tokenizer, for_reward_model=for_reward_model, prompt_key=d.prompt_key,
            chosen_key=d.chosen_key, rejected_key=d.rejected_key, messages_key=d.messages_key,
            apply_chat_template=d.apply_chat_template, max_length=d.max_length,
            row_index=row_index, source=source)
        return {"chosen": chosen, "rejected": rejected, "row": f"{source} row {row_index}"}

    return trainer.load_splits(tokenize)


def check_pair_lengths(pairs: list[dict], worker_cfg, section: str = "actor"):
    """Stop before training if a pair (both sides are packed into one micro-batch) does not fit
    the per-device budget."""
    sp, capacity = worker_cfg.sp_size, worker_cfg.max_length_per_device * worker_cfg.sp_size * worker_cfg.tp_size
    for p in pairs:
        sides = [len(p["chosen"]["input_ids"]), len(p["rejected"]["input_ids"])]
        need = sum(padded_length(n, sp) for n in sides)
        if need > capacity:
            raise SystemExit(
                f"{p['row']}: the pair needs {need} tokens (chosen {sides[0]} + rejected {sides[1]}"
                f"{', padded for sp' if sp > 1 else ''}) but one micro-batch holds "
                f"{section}.max_length_per_device*sp_size*tp_size = {capacity}; both sides of a "
                f"pair share a micro-batch, so a pair can need up to 2*data.train.max_length "
                f"tokens: raise {section}.max_length_per_device or {section}.sp_size, or lower "
                f"data.train.max_length")


class RMTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_data, self.test_data = load_pairs(self, for_reward_model=True)
        check_pair_lengths(self.train_data + self.test_data, cfg.actor)
        self.n_steps = self.total_steps(len(self.train_data), cfg.data.train.batch_size)
        self.actor = Critic(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.maybe_resume()

    def train_step(self, step: int) -> dict:
        return self.batch_step(step, self.actor.rm_update)

    def evaluate(self) -> dict:
        if not self.test_data:
            return {}
        return evaluate_in_chunks(
            len(self.test_data), self.cfg.data.test.batch_size,
            lambda idx: self.actor.rm_eval([self.test_data[i] for i in idx]))


def evaluate_in_chunks(n_pairs: int, batch_size: int, eval_fn) -> dict:
    """`eval_fn(pair indices) -> means over those pairs`, combined into test/ means over all."""
    totals = {}
    for idx in eval_batches(n_pairs, batch_size):
        for k, v in eval_fn(idx).items():
            totals[k] = totals.get(k, 0.0) + v * len(idx)
    return {f"test/{k}": v / n_pairs for k, v in totals.items()}


def main():
    RMTrainer.launch("rm")


if __name__ == "__main__":
    main()
