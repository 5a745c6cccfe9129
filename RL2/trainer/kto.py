"""Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024) from unpaired feedback: each row
is a prompt, one completion and a label (desirable or not); no pairs needed.

    torchrun --nproc_per_node=N -m RL2.trainer.kto actor.model_name=... data.train.path=...

With r = log pi(y|x) - log pi_ref(y|x) summed over the completion, and z0 an estimate of
KL(pi || pi_ref) (no gradient, clamped at 0):
    desirable:    loss = desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable:  loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r)))
averaged over the global batch. z0 is the batch mean of r over mismatched (prompt i,
completion i+1) examples, as in the paper. The implied reward of a completion is beta * r.

This file is the whole algorithm (data, loss, update step, trainer) on top of the workers'
mechanics; RL2/config/kto.yaml holds its keys.
"""
import time
from functools import partial

import torch
import torch.nn.functional as F

from RL2.algorithms.losses import token_metrics, upcast
from RL2.data.formats import DataError, tokenize_sft
from RL2.data.packing import check_fits
from RL2.trainer.base import Trainer
from RL2.workers.actor import Actor


# ----- loss -----
def kto_loss(logps, ref_logps, desirable, z0: float, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0):
    """Per-example KTO loss and implied rewards beta * r (detached), from sequence log-probs."""
    r = upcast(logps) - upcast(ref_logps)
    d = desirable.bool()
    value = torch.where(d, F.sigmoid(beta * (r - z0)), F.sigmoid(beta * (z0 - r)))
    weight = torch.where(d, torch.full_like(r, desirable_weight), torch.full_like(r, undesirable_weight))
    return weight * (1 - value), (beta * r).detach()


def kl_estimate(kl_logps: torch.Tensor, kl_ref_logps: torch.Tensor) -> float:
    """z0: mean log-ratio over the mismatched examples, clamped at 0 (a KL is >= 0)."""
    return max(0.0, (kl_logps.double() - kl_ref_logps.double()).mean().item())


# ----- data -----
_LABEL_WORDS = {"true": True, "false": False, "1": True, "0": False}


def tokenize_unpaired(row, row_index, source, *, tokenizer, d) -> dict:
    """{"sample": SFT-style sample (loss mask on the completion), "desirable": bool}."""
    label = row.get(d.label_key) if hasattr(row, "get") else None
    if isinstance(label, str):  # CSV cells are strings (RL2/data/io.py): "true", "False", "1", ...
        label = _LABEL_WORDS.get(label.strip().lower(), label)
    if not (isinstance(label, bool) or label in (0, 1)):
        raise DataError(f"{source} row {row_index}: key '{d.label_key}' must be true (desirable) "
                        f"or false (undesirable), got {label!r}")
    sample = tokenize_sft(row, tokenizer, prompt_key=d.prompt_key, response_key=d.completion_key,
                          messages_key=d.messages_key, apply_chat_template=d.apply_chat_template,
                          max_length=d.max_length, row_index=row_index, source=source)
    return {"sample": sample, "desirable": bool(label)}


def _prompt_and_completion(sample: dict) -> tuple[list[int], list[int], list[int]]:
    tokens = sample["input_ids"].tolist() + sample["labels"][-1:].tolist()
    mask = [0] + [int(m) for m in sample["action_mask"].tolist()]
    start = mask.index(1)
    return tokens[:start], tokens[start:], mask[start:]


def mismatched(samples: list[dict], max_length: int) -> list[dict]:
    """Prompt of sample i with the completion of sample i+1 (mod n), first `max_length` tokens:
    completions the policy was not trained to give for that prompt, for the z0 estimate."""
    parts = [_prompt_and_completion(s) for s in samples]
    out = []
    for i, (prompt, _, _) in enumerate(parts):
        _, completion, mask = parts[(i + 1) % len(parts)]
        tokens, m = (prompt + completion)[:max_length], ([0] * len(prompt) + mask)[:max_length]
        out.append({"input_ids": torch.tensor(tokens[:-1]), "labels": torch.tensor(tokens[1:]),
                    "action_mask": torch.tensor(m[1:], dtype=torch.float32)})
    return out


# ----- update step -----
def metric_sums(loss, rewards, logps, desirable) -> torch.Tensor:
    d = desirable.bool()
    lp = logps.detach().double()
    return torch.stack([loss.detach().double().sum(), rewards[d].double().sum(),
                        rewards[~d].double().sum(), lp[d].sum(), lp[~d].sum()]).cpu()


def metric_means(sums: list[float], desirable: torch.Tensor, z0: float) -> dict:
    n_d = int(desirable.sum().item())
    n_u = len(desirable) - n_d
    out = {"loss": sums[0] / len(desirable), "kl": z0}
    if n_d:
        out.update({"rewards/chosen": sums[1] / n_d, "logps/chosen": sums[3] / n_d})
    if n_u:
        out.update({"rewards/rejected": sums[2] / n_u, "logps/rejected": sums[4] / n_u})
    return out


def kto_update(actor, samples: list[dict], desirable: torch.Tensor, ref_logps: torch.Tensor,
               z0: float) -> dict:
    """One optimizer step of KTO averaged over the global batch (config under `actor.`)."""
    cfg = actor.cfg
    # Every sp rank computes the same example losses from all-reduced sequence log-probs
    # (whose backward all-reduces the gradient): scale so FSDP's sum counts them once.
    scale = 1.0 / (len(samples) * actor.dims.sp)
    sums = torch.zeros(5, dtype=torch.float64)
    for mb in actor.plan(samples):
        ids = torch.tensor(mb.indices, dtype=torch.long)
        seq = actor.sequence_logps(mb, actor.forward(mb)["logps"])[:len(ids)]  # none for a dummy
        d = desirable[ids].to(seq.device)
        loss, rewards = kto_loss(seq, ref_logps[ids].to(seq.device), d, z0, cfg.beta,
                                 cfg.desirable_weight, cfg.undesirable_weight)
        (loss.sum() * scale).backward()
        if actor.dims.sp_rank == 0:  # metrics: one copy per data-parallel rank
            sums += metric_sums(loss, rewards, seq, d)
    grad_norm = actor.step()
    totals = actor.all_reduce_metrics(sums.tolist())
    return dict(metric_means(totals, desirable, z0), grad_norm=grad_norm, lr=actor.lr,
                **token_metrics(samples))


# ----- trainer -----
class KTOTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_data, self.test_data = self.load_splits(
            partial(tokenize_unpaired, tokenizer=self.tokenizer, d=cfg.data.train))
        samples = [e["sample"] for e in self.train_data + self.test_data]
        check_fits(samples, cfg.actor)
        # Mismatched examples are cut to the longest real one, so they fit a micro-batch too.
        self.kl_max_length = max(len(s["input_ids"]) for s in samples) + 1
        self.sampler, self.n_steps = self.plan_steps(len(self.train_data), cfg.data.train.batch_size)
        self.actor = Actor(cfg.actor, self.device, total_steps=self.n_steps, seed=cfg.trainer.seed)
        self.ref = self.reference_model()
        self.test_ref = None  # reference log-probs of the test split, computed once
        self.maybe_resume()

    def trained_workers(self) -> dict:
        return {"actor": self.actor}

    def reference_logps(self, samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(reference logps of `samples`, of their mismatched examples, the mismatched examples)."""
        kl_samples = mismatched(samples, self.kl_max_length)
        ref = self.ref.compute_sequence_logps(samples + kl_samples)
        return ref[:len(samples)], ref[len(samples):], kl_samples

    def train_step(self, step: int) -> dict:
        return self.timed_update(self.update, self.batch(step))

    def update(self, examples: list[dict]) -> dict:
        start = time.perf_counter()
        samples = [e["sample"] for e in examples]
        ref_logps, kl_ref, kl_samples = self.reference_logps(samples)
        z0 = kl_estimate(self.actor.compute_sequence_logps(kl_samples), kl_ref)
        ref_time = time.perf_counter() - start
        desirable = torch.tensor([e["desirable"] for e in examples])
        return dict(kto_update(self.actor, samples, desirable, ref_logps, z0), ref_time=ref_time)

    @torch.no_grad()
    def evaluate(self) -> dict:
        if not self.test_data:
            return {}
        samples = [e["sample"] for e in self.test_data]
        if self.test_ref is None:
            self.test_ref = self.reference_logps(samples)
        ref_logps, kl_ref, kl_samples = self.test_ref
        z0 = kl_estimate(self.actor.compute_sequence_logps(kl_samples), kl_ref)
        logps = self.actor.compute_sequence_logps(samples)
        desirable = torch.tensor([e["desirable"] for e in self.test_data])
        c = self.actor.cfg
        loss, rewards = kto_loss(logps, ref_logps, desirable, z0, c.beta, c.desirable_weight,
                                 c.undesirable_weight)
        means = metric_means(metric_sums(loss, rewards, logps, desirable).tolist(), desirable, z0)
        return {f"test/{k}": v for k, v in means.items()}


def main():
    KTOTrainer.launch("kto")


if __name__ == "__main__":
    main()
