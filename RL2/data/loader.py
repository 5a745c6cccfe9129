"""Resumable batch order: the indices of step s are a pure function of (seed, s), so resuming at
step s needs nothing but s."""
import torch

from RL2.utils.seeding import derive_seed


class StepSampler:
    def __init__(self, n_items: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if n_items < batch_size:
            raise ValueError(
                f"the dataset has {n_items} rows, fewer than batch_size={batch_size}; "
                f"lower data.train.batch_size")
        self.n, self.bs, self.seed, self.shuffle = n_items, batch_size, seed, shuffle
        self.steps_per_epoch = n_items // batch_size  # the last partial batch is dropped

    def batch(self, step: int) -> list[int]:
        epoch, j = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        return order[j * self.bs:(j + 1) * self.bs].tolist()


def eval_batches(n_items: int, batch_size: int) -> list[list[int]]:
    return [list(range(i, min(n_items, i + batch_size))) for i in range(0, n_items, batch_size)]
