"""The value-model worker: an HF backbone with a 1-wide head (AutoModelForTokenClassification,
num_labels=1, dropout off) whose output at token t is V(input_ids[<=t]). The reward model is one
(its reward is the value at the last token, where `eos_mask` == 1); the PPO critic is another."""
import torch

from RL2.parallel.collectives import sequence_sums
from RL2.workers.worker import Worker


class Critic(Worker):
    def __init__(self, cfg, device, **kw):
        super().__init__(cfg, device, value_head=True, **kw)

    def compute_values(self, samples: list[dict]) -> list[torch.Tensor]:
        """Per-token values of every sample (no grad), in order, on every rank."""
        return self.infer(samples, "values")

    def masked_values(self, mb, values: torch.Tensor, mask_key: str = "eos_mask") -> torch.Tensor:
        """sum_t values[t] * mask[t] per sequence of a micro-batch (with a one-hot mask: the
        value at that token), differentiable and identical on every rank of the sp group."""
        return sequence_sums(values * mb.data[mask_key], mb.cu_seqlens, self.dims.sp_group)

    def compute_rewards(self, samples: list[dict], mask_key: str = "eos_mask",
                        groups: list[list[int]] | None = None) -> torch.Tensor:
        """Reward of each sample: its value where `mask_key` == 1 (no grad). With eos_mask and
        `share_prompt`, samples that begin alike (a GRPO group's responses) compute their
        prompt once (`plan`): a scored token is never shared (`packing.shared_length`)."""
        values = self.infer(samples, "values", groups, share=mask_key == "eos_mask")
        return torch.stack([(v.double() * s[mask_key].double()).sum() for v, s in zip(values, samples)])
