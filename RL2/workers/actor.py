"""The policy worker: log-probs and update steps."""
import torch

from RL2.algorithms.losses import token_weights
from RL2.workers.worker import Worker


def with_weights(samples: list[dict], avg_level: str) -> list[dict]:
    """Attach global per-token loss weights (computed on whole sequences, before any sp split,
    over the whole global batch, so the loss does not depend on micro-batching or world size)."""
    weights = token_weights([s["action_mask"] for s in samples], avg_level)
    return [dict(s, loss_weight=w) for s, w in zip(samples, weights)]


class Actor(Worker):
    def compute_logps(self, samples: list[dict], temperature: float = 1.0) -> list[torch.Tensor]:
        return self.infer(samples, "logps", temperature=temperature)

    def sft_update(self, samples: list[dict]) -> dict:
        """One optimizer step of token-level NLL on the action tokens of a global batch."""
        samples = with_weights(samples, self.cfg.avg_level)
        loss_sum, n_tokens = 0.0, 0.0
        for mb in self.plan(samples):
            logps = self.forward(mb)["logps"]
            loss = -(logps * mb.data["loss_weight"]).sum()
            loss.backward()
            loss_sum += loss.item()
            n_tokens += mb.data["action_mask"].sum().item()
        grad_norm = self.step()
        return {"loss": self.all_reduce_metric(loss_sum), "grad_norm": grad_norm, "lr": self.lr,
                "tokens": self.all_reduce_metric(n_tokens)}

    @torch.no_grad()
    def sft_eval(self, samples: list[dict]) -> float:
        """Loss of the test split, normalised over the whole split."""
        weighted = with_weights(samples, self.cfg.avg_level)
        logps = self.compute_logps(samples)
        return -sum((lp * s["loss_weight"]).sum().item() for lp, s in zip(logps, weighted))
