"""The value-model worker: an HF backbone with a 1-wide head (AutoModelForTokenClassification,
num_labels=1) whose output at token t is V(input_ids[<=t]). The reward model is one (its reward
is the value at the last token, where `eos_mask` == 1); the PPO critic is another."""
import torch
from torch import nn

from RL2.algorithms.losses import rm_loss
from RL2.parallel.collectives import sequence_sums
from RL2.workers.actor import flatten_pairs, pair_slots
from RL2.workers.worker import Worker


def disable_dropout(model: nn.Module):
    """HF token-classification heads apply dropout 0.1 by default; a value model is trained
    without it (the reward would be noisy, and results would depend on the micro-batching).
    Recorded in the config too, so the saved checkpoint evaluates the same way."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model.config.classifier_dropout = 0.0


class Critic(Worker):
    def __init__(self, cfg, device, **kw):
        super().__init__(cfg, device, value_head=True, **kw)
        disable_dropout(self.model)

    # ----- read-out -----
    def compute_values(self, samples: list[dict]) -> list[torch.Tensor]:
        """Per-token values of every sample (no grad), in order, on every rank."""
        return self.infer(samples, "values")

    def masked_values(self, mb, values: torch.Tensor, mask_key: str = "eos_mask") -> torch.Tensor:
        """sum_t values[t] * mask[t] per sequence of a micro-batch (with a one-hot mask: the
        value at that token), differentiable and identical on every rank of the sp group."""
        return sequence_sums(values * mb.data[mask_key], mb.cu_seqlens, self.dims.sp_group)

    def compute_rewards(self, samples: list[dict], mask_key: str = "eos_mask") -> torch.Tensor:
        """Reward of each sample: its value where `mask_key` == 1 (no grad)."""
        values = self.compute_values(samples)
        return torch.stack([(v.double() * s[mask_key].double()).sum() for v, s in zip(values, samples)])

    # ----- reward model -----
    def rm_update(self, pairs: list[dict]) -> dict:
        """One optimizer step of the Bradley-Terry loss averaged over the global batch of pairs."""
        samples, groups = flatten_pairs(pairs)
        # Every sp rank computes the same pair losses (rewards are all-reduced over sp, whose
        # backward all-reduces the gradient): scale so FSDP's sum over ranks counts them once.
        scale = 1.0 / (len(pairs) * self.dims.sp)
        sums = torch.zeros(5, dtype=torch.float64)
        for mb in self.plan(samples, groups):
            rewards = self.masked_values(mb, self.forward(mb)["values"])
            _, chosen, rejected = pair_slots(mb)
            loss, correct = rm_loss(rewards[chosen], rewards[rejected])
            (loss.sum() * scale).backward()
            if self.dims.sp_rank == 0:  # metrics: one copy per data-parallel rank
                sums += pair_metric_sums(loss, correct, rewards[chosen], rewards[rejected])
        grad_norm = self.step()
        metrics = {k: self.all_reduce_metric(v) / len(pairs) for k, v in zip(PAIR_METRICS, sums.tolist())}
        return dict(metrics, grad_norm=grad_norm, lr=self.lr,
                    tokens=float(sum(len(s["input_ids"]) for s in samples)))

    @torch.no_grad()
    def rm_eval(self, pairs: list[dict]) -> dict:
        """Mean loss, accuracy, margin and rewards over `pairs` (every rank gets the same)."""
        samples, _ = flatten_pairs(pairs)
        rewards = self.compute_rewards(samples)
        loss, correct = rm_loss(rewards[0::2], rewards[1::2])
        sums = pair_metric_sums(loss, correct, rewards[0::2], rewards[1::2])
        return {k: v / len(pairs) for k, v in zip(PAIR_METRICS, sums.tolist())}


PAIR_METRICS = ("loss", "accuracy", "margin", "reward/chosen", "reward/rejected")


def pair_metric_sums(loss, correct, r_chosen, r_rejected) -> torch.Tensor:
    """Sums over pairs of PAIR_METRICS (divided by the global pair count by the caller)."""
    c, r = r_chosen.detach().double(), r_rejected.detach().double()
    return torch.stack([loss.detach().double().sum(), correct.double().sum(), (c - r).sum(),
                        c.sum(), r.sum()]).cpu()
