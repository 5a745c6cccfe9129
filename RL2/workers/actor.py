"""The policy worker: a causal LM and its per-token log-probs (the update steps that use them live
in RL2/algorithms/)."""
import torch

from RL2.parallel.collectives import sequence_sums
from RL2.workers.worker import Worker


class Actor(Worker):
    def compute_logps(self, samples: list[dict], temperature: float = 1.0,
                      groups: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Per-token log-probs of every sample's labels (no grad), in order, on every rank; 0
        outside `action_mask` (`Worker._action_positions`). `groups`: samples packed together
        (`plan`), e.g. the sides of pairs that share a prompt."""
        return self.infer(samples, "logps", groups, temperature=temperature)

    def sequence_logps(self, mb, logps: torch.Tensor) -> torch.Tensor:
        """Summed log-probs of the action (response) tokens of each sequence of a micro-batch,
        accumulated in float64, differentiable, identical on every rank of the sp group."""
        return sequence_sums(logps * mb.data["action_mask"], mb.cu_seqlens, self.dims.sp_group,
                             dtype=torch.float64)

    def compute_sequence_logps(self, samples: list[dict],
                               groups: list[list[int]] | None = None) -> torch.Tensor:
        """(n,) float64 summed response log-probs of every sample (no grad; e.g. the reference)."""
        logps = self.compute_logps(samples, groups=groups)
        return torch.stack([(lp.double() * s["action_mask"].double()).sum()
                            for lp, s in zip(logps, samples)])
