"""Per-sample state and token choice of the embedded engine.

Log-probs are log_softmax(logits / T) (T=1 for greedy) of the chosen token, before top-k/top-p.
Sampled rows draw one uniform per token from their own torch.Generator (seeded from (seed, sample
index)) and invert the CDF of their (optionally top-k/top-p filtered) distribution, so a seeded
sample does not depend on the batch around it (up to float noise of batched matmuls).

Stops: eos (tokenizer) and `stop_token_ids` are kept as the last output token. Stop strings are
matched on the decoded text of the generated tokens after each token; the output ends with the
token that completes the stop string (INCLUDED, with any extra characters of that token), so
token ids and log-probs stay exactly what was sampled.
"""
import asyncio
import random
from dataclasses import dataclass, field

import torch

from RL2.rollout.engine import GenerationOutput, SamplingParams
from RL2.utils.seeding import derive_seed

GREEDY_BELOW = 1e-6  # temperatures below this decode greedily (as SGLang does), log-probs at T=1


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    stop_ids: frozenset
    seqs: list["Seq"] = field(default_factory=list)

    def add_samples(self, rng: random.Random, raw_seed: bool = False) -> None:
        """One `Seq` per sample; sampled ones get their own generator (raw_seed: params.seed
        itself, one sample per request as in vLLM; else derived from (seed, i))."""
        for i in range(self.params.n):
            gen = None
            if self.params.temperature >= GREEDY_BELOW:
                seed = derive_seed(self.params.seed, i) if self.params.seed is not None else rng.getrandbits(63)
                if raw_seed and self.params.seed is not None:
                    seed = self.params.seed
                gen = torch.Generator().manual_seed(seed)
            self.seqs.append(Seq(self, gen))

    def deliver(self) -> None:
        """Answer the caller once every sample has finished."""
        if self.future.done() or any(seq.finish is None for seq in self.seqs):
            return
        outs = [GenerationOutput(s.tokens, s.logprobs, s.finish) for s in self.seqs]
        for out, s in zip(outs, self.seqs):  # token spans per weight version (RL2.rollout.server)
            out.weight_versions = getattr(s, "spans", None)
        self.future.set_result(outs)


@dataclass(eq=False)
class Seq:
    req: Request
    gen: torch.Generator | None          # None for greedy
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None             # "stop" | "length" | "abort"

    def append(self, token: int, logprob: float, max_model_len: int, tokenizer) -> bool:
        """Record a token; return True when the sample is finished."""
        req, params = self.req, self.req.params
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in req.stop_ids or (params.stop and self._hits_stop(tokenizer)):
            self.finish = "stop"
        elif (len(self.tokens) >= params.max_new_tokens
              or len(req.prompt) + len(self.tokens) >= max_model_len):
            self.finish = "length"
        return self.finish is not None

    def _hits_stop(self, tokenizer) -> bool:
        # Earlier tokens were checked already, so a new match ends inside the last few tokens:
        # a stop of b UTF-8 bytes spans at most b tokens (+1 for a split leading character).
        stops = self.req.params.stop
        window = max(len(s.encode("utf-8")) for s in stops) + 1
        text = tokenizer.decode(self.tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in stops)


def sample(logits: torch.Tensor, seqs: list[Seq]) -> list[tuple[int, float]]:
    """Choose one token per row of `logits` [B, vocab] (float32); return (token,
    log_softmax(logits/T)[token]) per row."""
    params = [seq.req.params for seq in seqs]
    sampled = [p.temperature >= GREEDY_BELOW for p in params]
    temps = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
    if any(t != 1.0 for t in temps):
        logp = torch.log_softmax(logits / torch.tensor(temps, device=logits.device)[:, None], dim=-1)
    else:  # T = 1 everywhere (greedy rows, or sampling at 1): x / 1 is x, no division pass
        logp = torch.log_softmax(logits, dim=-1)
    if all(sampled):  # every row's token is drawn below
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    else:  # max's indices are argmax's (the first maximum), ~2.5x faster on the CPU (49k vocab)
        tokens = logits.max(-1).indices
    plain = [j for j, p in enumerate(params) if sampled[j] and p.top_k <= 0 and p.top_p >= 1]
    filtered = [j for j, p in enumerate(params) if sampled[j] and (p.top_k > 0 or p.top_p < 1)]
    if len(plain) == len(seqs):  # every row: no gather of the rows and scatter back
        tokens = _invert_cdf(logp.exp(), seqs)
    elif plain:
        rows = torch.tensor(plain, device=logits.device)
        tokens[rows] = _invert_cdf(logp[rows].exp(), [seqs[j] for j in plain])
    if filtered:
        rows = torch.tensor(filtered, device=logits.device)
        tokens[rows] = _sample_filtered(logp[rows], [seqs[j] for j in filtered])
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return list(zip(tokens.tolist(), chosen.tolist()))


def _sample_filtered(logp: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
    params = [seq.req.params for seq in seqs]
    probs, order = logp.exp().sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=logp.device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[1] for p in params], device=logp.device)
    top_p = torch.tensor([p.top_p for p in params], device=logp.device)
    # nucleus: keep a token while the mass strictly before it is < top_p (the top one stays)
    keep = (rank[None] < top_k[:, None]) & ((probs.cumsum(-1) - probs) < top_p[:, None])
    keep[:, 0] = True
    pick = _invert_cdf(probs * keep, seqs)
    return order.gather(1, pick[:, None])[:, 0]


def _invert_cdf(probs: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
    # One uniform per row from the row's own generator: independent of batch composition.
    u = torch.tensor([torch.rand((), generator=seq.gen).item() for seq in seqs],
                     device=probs.device, dtype=probs.dtype)
    cdf = probs.cumsum(-1)
    # right=True picks the first index whose cdf exceeds u*total: never a zero-probability token
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp(max=probs.shape[1] - 1)
