"""The policy worker: log-probs and update steps (SFT, DPO)."""
import torch

from RL2.algorithms.losses import dpo_loss, token_weights
from RL2.parallel.collectives import sequence_sums
from RL2.workers.worker import Worker


def with_weights(samples: list[dict], avg_level: str) -> list[dict]:
    """Attach global per-token loss weights (computed on whole sequences, before any sp split,
    over the whole global batch, so the loss does not depend on micro-batching or world size)."""
    weights = token_weights([s["action_mask"] for s in samples], avg_level)
    return [dict(s, loss_weight=w) for s, w in zip(samples, weights)]


def flatten_pairs(pairs: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """Preference pairs {"chosen", "rejected", ...} -> samples [c0, r0, c1, r1, ...] and the
    groups [[0, 1], [2, 3], ...] that keep each pair in one micro-batch."""
    samples = [s for p in pairs for s in (p["chosen"], p["rejected"])]
    return samples, [[2 * i, 2 * i + 1] for i in range(len(pairs))]


def pair_slots(mb) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(pair ids, chosen positions, rejected positions): which pairs micro-batch `mb` holds (samples
    laid out by `flatten_pairs`) and where their two sides sit among its sequences. Empty for a
    dummy micro-batch."""
    where = {idx: j for j, idx in enumerate(mb.indices)}
    ids = sorted({i // 2 for i in mb.indices})
    chosen = torch.tensor([where[2 * p] for p in ids], dtype=torch.long)
    rejected = torch.tensor([where[2 * p + 1] for p in ids], dtype=torch.long)
    return ids, chosen.to(mb.cu_seqlens.device), rejected.to(mb.cu_seqlens.device)


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

    # ----- DPO -----
    def sequence_logps(self, mb, logps: torch.Tensor) -> torch.Tensor:
        """Summed log-probs of the action (response) tokens of each sequence of a micro-batch,
        accumulated in float64, differentiable, identical on every rank of the sp group."""
        return sequence_sums(logps * mb.data["action_mask"], mb.cu_seqlens, self.dims.sp_group,
                             dtype=torch.float64)

    def compute_sequence_logps(self, samples: list[dict]) -> torch.Tensor:
        """(n,) float64 summed response log-probs of every sample (no grad; e.g. the reference)."""
        logps = self.compute_logps(samples)
        return torch.stack([(lp.double() * s["action_mask"].double()).sum()
                            for lp, s in zip(logps, samples)])

    def dpo_update(self, pairs: list[dict], ref_logps: torch.Tensor) -> dict:
        """One optimizer step of DPO averaged over the global batch of pairs.

        `ref_logps`: (2 * len(pairs),) reference sequence log-probs laid out as `flatten_pairs`.
        Config: actor.beta, actor.label_smoothing (conservative DPO), actor.sft_coef (weight of
        the NLL of the chosen responses, normalised by actor.avg_level over the batch).
        """
        cfg = self.cfg
        samples, groups = flatten_pairs(pairs)
        if cfg.sft_coef:
            weights = token_weights([p["chosen"]["action_mask"] for p in pairs], cfg.avg_level)
            samples = [dict(s, loss_weight=weights[i // 2] if i % 2 == 0 else torch.zeros_like(s["action_mask"]))
                       for i, s in enumerate(samples)]  # NLL on the chosen side only
        ref_logps = ref_logps.to(torch.float64)
        # Every sp rank computes the same pair losses from all-reduced sequence log-probs (whose
        # backward all-reduces the gradient): scale so FSDP's sum over ranks counts them once.
        scale = 1.0 / (len(pairs) * self.dims.sp)
        sums = torch.zeros(len(DPO_METRICS), dtype=torch.float64)
        for mb in self.plan(samples, groups):
            logps = self.forward(mb)["logps"]
            seq = self.sequence_logps(mb, logps)
            ids, chosen, rejected = pair_slots(mb)
            ids = torch.tensor(ids, dtype=torch.long)
            ref_c, ref_r = ref_logps[2 * ids].to(seq.device), ref_logps[2 * ids + 1].to(seq.device)
            loss, rew_c, rew_r = dpo_loss(seq[chosen], seq[rejected], ref_c, ref_r, cfg.beta,
                                          cfg.label_smoothing)
            total = loss.sum() * scale
            if cfg.sft_coef:
                sft = -(logps * mb.data["loss_weight"]).sum()  # tokens live on one sp rank each
                total = total + cfg.sft_coef * sft
                sums[-1] += sft.item()  # summed over every rank below, so no sp_rank gate
            total.backward()
            if self.dims.sp_rank == 0:  # pair metrics: one copy per data-parallel rank
                sums[:-1] += dpo_metric_sums(loss, rew_c, rew_r, seq[chosen], seq[rejected])
        grad_norm = self.step()
        totals = [self.all_reduce_metric(v) for v in sums.tolist()]
        metrics = {k: v / len(pairs) for k, v in zip(DPO_METRICS[:-1], totals[:-1])}
        if cfg.sft_coef:  # loss = dpo_loss + sft_coef * sft_loss
            metrics.update(dpo_loss=metrics["loss"], sft_loss=totals[-1])
            metrics["loss"] += cfg.sft_coef * totals[-1]
        return dict(metrics, grad_norm=grad_norm, lr=self.lr,
                    tokens=float(sum(len(s["input_ids"]) for s in samples)))

    @torch.no_grad()
    def dpo_eval(self, pairs: list[dict], ref_logps: torch.Tensor) -> dict:
        """DPO loss (without the SFT term) and rewards over `pairs`; the same on every rank."""
        samples, _ = flatten_pairs(pairs)
        seq = self.compute_sequence_logps(samples)
        loss, rew_c, rew_r = dpo_loss(seq[0::2], seq[1::2], ref_logps[0::2], ref_logps[1::2],
                                      self.cfg.beta, self.cfg.label_smoothing)
        sums = dpo_metric_sums(loss, rew_c, rew_r, seq[0::2], seq[1::2])
        return {k: v / len(pairs) for k, v in zip(DPO_METRICS, sums.tolist())}


# Sums over pairs, divided by the global number of pairs; the last slot of dpo_update holds the
# SFT term (already normalised by token_weights).
DPO_METRICS = ("loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margin",
               "logps/chosen", "logps/rejected", "sft_loss")


def dpo_metric_sums(loss, rew_c, rew_r, logp_c, logp_r) -> torch.Tensor:
    c, r = rew_c.double(), rew_r.double()
    return torch.stack([loss.detach().double().sum(), (c > r).double().sum(), c.sum(), r.sum(),
                        (c - r).sum(), logp_c.detach().double().sum(),
                        logp_r.detach().double().sum()]).cpu()
