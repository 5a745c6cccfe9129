"""Embedded PyTorch rollout engine: an HF causal LM in-process, serving many asyncio callers.

Design (continuous batching over one left-padded batch KV cache):
- `generate` puts a request in a waiting list and awaits a future. One scheduler task per event
  loop (started on first use) alternates two phases and yields to the loop (`asyncio.sleep(0)`)
  after each, so environments and callers run between decode steps:
  1. admit: all waiting requests (bounded by `max_batch_size` rows and `max_prefill_tokens`
     padded prompt tokens) are prefilled together in one left-padded forward pass; each prompt is
     prefilled once and its cache rows repeated for its n samples; the first tokens are sampled;
     the new rows join the running cache, right-aligned (left padding).
  2. decode: one forward of the whole running batch (one token per row, explicit per-row
     position_ids and a 2-D padding mask, so padding never shifts RoPE positions); finished rows
     are evicted at once and leading all-padding cache columns are dropped.
  A request that arrives mid-decode joins at the next step instead of waiting for the batch to
  drain (static batching). Padding costs attention width only.
- KV memory (`BatchKV`): preallocated per-layer buffers written in place (no per-step
  concatenation); an evicted row is replaced by one live row from the end of the batch.
- Prefix cache: the KV of each finished sample (prompt + response) is kept, LRU-bounded by
  `prefix_cache_mb`; a later prompt that extends it (the next turn of a multi-turn agent)
  prefills only its new tokens. Dropped on update_weights and release_memory.
- Sampling per row: log-probs are log_softmax(logits / T) (T=1 for greedy) of the chosen token,
  before top-k/top-p. Sampled rows draw one uniform per token from their own torch.Generator
  (seeded from (seed, sample index)) and invert the CDF of their (optionally top-k/top-p
  filtered) distribution, so a seeded sample does not depend on the batch around it (up to
  float noise of batched matmuls).
- Stops: eos (tokenizer) and `stop_token_ids` are kept as the last output token. Stop strings are
  matched on the decoded text of the generated tokens after each token; the output ends with the
  token that completes the stop string (the stop string is INCLUDED, with any extra characters of
  that token), so token ids and log-probs stay exactly what was sampled. Finish reasons: "stop",
  "length" (max_new_tokens, or the context `max_model_len` reached), "abort" (release_memory,
  shutdown).
- Errors: invalid params, empty/out-of-vocab/too-long prompts raise ValueError in `generate`; an
  exception inside the scheduler is set on every pending request and the scheduler keeps serving.
- Thread model: call everything from the event loop's thread; the sync methods (update_weights,
  release/resume) run between decode steps. Requests still decoding during update_weights keep
  their cache and continue with the new weights.
"""
import asyncio
import gc
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F

from RL2.rollout import fast_decode as fast_decode_lib
from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams
from RL2.utils.seeding import derive_seed
from RL2.rollout.kv_cache import BatchKV

logger = logging.getLogger(__name__)

GREEDY_BELOW = 1e-6  # temperatures below this decode greedily (as SGLang does), log-probs at T=1
ROOM_CAP = 1024  # decode columns reserved up front when rows join the batch


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    stop_ids: frozenset
    seqs: list["_Seq"] = field(default_factory=list)


@dataclass(eq=False)
class _Seq:
    req: _Request
    gen: torch.Generator | None          # None for greedy
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


class TorchEngine(Engine):
    def __init__(self, model, tokenizer=None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | str = torch.float32, max_model_len: int | None = None,
                 max_batch_size: int = 256, max_prefill_tokens: int = 16384,
                 prefix_cache_mb: float = 512, attn_implementation: str = "sdpa",
                 offload_weights: bool = True, fast_decode: bool = True, seed: int = 0):
        """`model`: HF directory or an nn.Module (used as is, not copied). `tokenizer`: HF
        tokenizer, a path, or None (then no stop strings and no implicit eos). `offload_weights`:
        release_memory also moves the weights to CPU (only when the device is not CPU).
        `prefix_cache_mb`: memory for the KV of finished samples, kept for reuse by later prompts
        that extend them (0 disables). `fast_decode`: decode steps of Llama-family models run
        through RL2/rollout/fast_decode.py instead of the HF forward (other models always use
        the HF forward)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, torch.nn.Module):
            self.model = model
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model, dtype=dtype, attn_implementation=attn_implementation)
        self.model.to(self.device).eval()
        if isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.fast_decode = fast_decode and fast_decode_lib.supports(self.model)
        cfg = self.model.config.get_text_config(decoder=True)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.offload_weights = offload_weights
        self.prefix_cache_bytes = int(prefix_cache_mb * 2**20)
        self.clear_prefix_cache()
        self.stats = {"prefill_tokens": 0, "cached_prompt_tokens": 0}
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._rng = random.Random(seed)
        self._weights_shared = False  # weights are tensors owned by the trainer (share_weights)
        self._waiting: list[_Request] = []
        self._reset_batch()
        self._loop = self._task = self._wakeup = None
        self._released: set[str] = set()
        self._closed = False
        self._check_cache_layout()

    # ---------------------------------------------------------------- public API
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        if self._closed:
            raise RuntimeError("TorchEngine is shut down")
        if self._released:
            raise RuntimeError(f"TorchEngine memory {sorted(self._released)} is released; "
                               "call resume_memory() first")
        params.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt: generation needs at least one prompt token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len={self.max_model_len} "
                             "leaves no room for a generated token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        loop = asyncio.get_running_loop()
        self._ensure_scheduler(loop)
        req = _Request(prompt, params, loop.create_future(),
                       self._eos_ids | frozenset(int(t) for t in params.stop_token_ids))
        for i in range(params.n):
            gen = None
            if params.temperature >= GREEDY_BELOW:
                seed = (derive_seed(params.seed, i) if params.seed is not None
                        else self._rng.getrandbits(63))
                gen = torch.Generator().manual_seed(seed)
            req.seqs.append(_Seq(req, gen))
        self._waiting.append(req)
        self._wakeup.set()
        return await req.future

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # keep_vars gives the live parameters; tied weights appear under both names.
        self.clear_prefix_cache()  # cached KV belongs to the old weights
        targets = self.model.state_dict(keep_vars=True)
        if self._weights_shared:  # never write into memory the trainer owns: own a copy first
            with torch.no_grad():
                for t in {id(t): t for t in targets.values()}.values():  # parameters and buffers
                    t.data = t.data.clone()
            self._weights_shared = False
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.data.copy_(tensor)

    def can_share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> bool:
        if self.device.type != "cpu":
            return False
        return (named_tensors is None
                or self._share_mismatch(named_tensors, self.model.state_dict(keep_vars=True)) is None)

    @staticmethod
    def _share_mismatch(named_tensors, targets: dict) -> str | None:
        """Why these tensors cannot become the weights `targets` (None: they can)."""
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                return f"unknown parameter {name!r}"
            if tuple(target.shape) != tuple(tensor.shape) or target.dtype != tensor.dtype:
                return (f"{name} is {tuple(tensor.shape)} {tensor.dtype}, expected "
                        f"{tuple(target.shape)} {target.dtype}")
        return None

    @torch.no_grad()
    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.device.type != "cpu":
            raise RuntimeError(f"share_weights needs the engine on the CPU, not {self.device}")
        named = list(named_tensors)
        targets = self.model.state_dict(keep_vars=True)
        problem = self._share_mismatch(named, targets)  # all checked first: no half-shared model
        if problem:
            raise ValueError(f"share_weights: {problem}")
        self.clear_prefix_cache()
        self._weights_shared = True
        for name, tensor in named:
            targets[name].data = tensor  # tied weights: one parameter under two names, same values

    def weights_changed(self) -> None:
        self.clear_prefix_cache()  # cached KV belongs to the old weights

    def weights_shared(self) -> bool:
        return self._weights_shared

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Any tag aborts in-flight requests and drops the KV cache; "weights" (or None) also
        moves the weights to CPU when offload_weights is set and the device is not CPU."""
        tags = set(tags or ("weights", "kv_cache"))
        self._abort_all()
        self.clear_prefix_cache()
        if "weights" in tags and self.offload_weights and self.device.type != "cpu":
            self.model.to("cpu")
        self._released |= tags
        if self.device.type == "cuda":
            # A full collection costs ~0.3-1 s per rollout over a trainer's objects; only worth it
            # when the caching allocator can hand the memory back. On CPU, reference counting
            # already freed the KV tensors.
            gc.collect()
            torch.cuda.empty_cache()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        tags = set(tags or ("weights", "kv_cache"))
        if "weights" in tags & self._released:
            self.model.to(self.device)
        self._released -= tags

    def shutdown(self) -> None:
        self._abort_all()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._closed = True
        self.model = None
        gc.collect()

    # ---------------------------------------------------------------- scheduler
    def _ensure_scheduler(self, loop) -> None:
        if self._loop is not loop:
            # A new event loop (e.g. successive asyncio.run calls): state from the old one is dead.
            self._waiting.clear()
            self._reset_batch()
            self._loop, self._task, self._wakeup = loop, None, asyncio.Event()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._scheduler())

    async def _scheduler(self) -> None:
        try:
            while True:
                if not self._waiting and not self._rows:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                try:
                    if self._waiting:
                        self._admit()
                        await asyncio.sleep(0)
                    if self._rows:
                        self._decode_step()
                except Exception as exc:  # deliver to every caller instead of hanging them
                    logger.exception("TorchEngine scheduler step failed")
                    self._fail_all(exc)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._abort_all()
            raise

    def _reset_batch(self) -> None:
        self._admitting: list[_Request] = []  # taken from the queue, being prefilled
        self._rows: list[_Seq] = []     # one running sample per cache row
        self._kv = BatchKV()           # their KV cache, [B, heads, T, head_dim] per layer
        self._mask = None               # [B, T] long, 0 = padding
        self._lens = None               # [B] real tokens in the cache (= next position id)
        self._last = None               # [B] last sampled token, not yet in the cache

    def _pending(self) -> list[_Request]:
        """Every request not yet answered: being admitted, decoding, or waiting."""
        reqs = {id(r): r for r in self._admitting}
        reqs.update((id(s.req), s.req) for s in self._rows)
        return list(reqs.values()) + self._waiting

    def _fail_all(self, exc: Exception) -> None:
        reqs = self._pending()
        self._waiting = []
        self._reset_batch()
        for req in reqs:
            if not req.future.done():
                req.future.set_exception(exc)

    def _abort_all(self) -> None:
        reqs = self._pending()
        self._waiting = []
        self._reset_batch()
        for req in reqs:
            for seq in req.seqs:
                seq.finish = seq.finish or "abort"
            try:
                self._deliver(req)
            except RuntimeError:  # the request's event loop is already closed
                pass

    # ---------------------------------------------------------------- model steps
    def _check_cache_layout(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=self.model.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise NotImplementedError("TorchEngine supports full-attention models only "
                                      "(no sliding-window or linear-attention cache layers)")

    @torch.inference_mode()
    def _admit(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        batch, hits, rows, width = [], [], len(self._rows), 0
        while self._waiting:
            req = self._waiting[0]
            hit = self._prefix_lookup(req.prompt)
            new_width = max(width, len(req.prompt) - hit[0])
            fits = (rows + req.params.n <= self.max_batch_size
                    and new_width * (len(batch) + 1) <= self.max_prefill_tokens)
            if not fits and (batch or rows):
                break  # an oversized request still runs, alone, once the engine is empty
            self._waiting.pop(0)
            if req.future.done():  # caller gave up before admission
                continue
            batch.append(req)
            self._admitting = batch  # if the prefill fails, these callers get the error too
            hits.append(hit)
            rows, width = rows + req.params.n, new_width
        if not batch:
            return
        # Row layout: [pad | cached prefix | pad | new prompt tokens]; holes are masked and
        # position ids count real tokens only, so the gap changes nothing.
        past = max(n for n, _ in hits)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), past + width, dtype=torch.long)
        for i, (req, (n_hit, _)) in enumerate(zip(batch, hits)):
            suffix = req.prompt[n_hit:]
            ids[i, width - len(suffix):] = torch.tensor(suffix)
            mask[i, past - n_hit:past] = 1
            mask[i, past + width - len(suffix):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        if past:
            template = next(kv for n, kv in hits if n)
            for li, layer in enumerate(cache.layers):
                heads, _, dim = template[li][0].shape
                keys = template[li][0].new_zeros(len(batch), heads, past, dim)
                values = torch.zeros_like(keys)
                for i, (n_hit, kv) in enumerate(hits):
                    if n_hit:
                        keys[i, :, past - n_hit:] = kv[li][0][:, :n_hit]
                        values[i, :, past - n_hit:] = kv[li][1][:, :n_hit]
                layer.update(keys, values)
        self.stats["prefill_tokens"] += sum(len(r.prompt) - n for r, (n, _) in zip(batch, hits))
        self.stats["cached_prompt_tokens"] += sum(n for n, _ in hits)
        out = self.model(input_ids=ids, attention_mask=mask,
                         position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, past:],
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        # Each prompt was prefilled once; repeat its cache row for its n samples.
        src = torch.tensor([i for i, req in enumerate(batch) for _ in req.seqs], device=self.device)
        seqs = [seq for req in batch for seq in req.seqs]
        tokens = self._sample(out.logits[:, -1].float().index_select(0, src), seqs)
        keep = [j for j, seq in enumerate(seqs) if not self._append(seq, *tokens[j])]
        for req in batch:
            self._deliver(req)
        if not keep:
            self._admitting = []
            return
        keep_t = torch.tensor(keep, device=self.device)
        rows_src = src.index_select(0, keep_t)
        cache.batch_select_indices(rows_src)
        self._merge(cache, mask.index_select(0, rows_src), [seqs[j] for j in keep],
                    torch.tensor([tokens[j][0] for j in keep], device=self.device))
        self._admitting = []

    # ---------------------------------------------------------------- prefix cache
    def _prefix_lookup(self, prompt: list[int]) -> tuple[int, list | None]:
        """Longest stored sequence that is a proper prefix of `prompt` (multi-turn: the previous
        turn's context + response): (its length, per-layer (keys, values) [H, L, D])."""
        best, best_key, prompt = 0, None, tuple(prompt)
        for key in self._prefix:
            if best < len(key) < len(prompt) and prompt[:len(key)] == key:
                best, best_key = len(key), key
        if best_key is None:
            return 0, None
        self._prefix.move_to_end(best_key)
        return best, self._prefix[best_key]

    def _prefix_store(self, row: int) -> None:
        """Keep the cache row of a finished sample (prompt + all tokens but the last), LRU-bounded
        by `prefix_cache_mb`."""
        seq = self._rows[row]
        key = tuple(seq.req.prompt + seq.tokens[:-1])
        per_token = sum(2 * k.shape[1] * k.shape[3] * k.element_size() for k in self._kv.k)
        if key in self._prefix or len(key) * per_token > self.prefix_cache_bytes:
            return
        cols = self._mask[row].nonzero()[:, 0]
        self._prefix[key] = [self._kv.row(li, row, cols) for li in range(len(self._kv.k))]
        self._prefix_bytes += len(key) * per_token
        while self._prefix_bytes > self.prefix_cache_bytes:
            old, _ = self._prefix.popitem(last=False)
            self._prefix_bytes -= len(old) * per_token

    def clear_prefix_cache(self) -> None:
        self._prefix, self._prefix_bytes = OrderedDict(), 0

    def _merge(self, cache, mask, seqs, last) -> None:
        # decode columns these rows may still need (capped: most responses stop early; the
        # cache still grows by doubling past the cap)
        room = max(min(s.req.params.max_new_tokens - len(s.tokens),
                       self.max_model_len - len(s.req.prompt) - len(s.tokens)) for s in seqs)
        self._kv.add([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
                     room=min(max(room, 0), ROOM_CAP))
        lens = mask.sum(1)
        if not self._rows:
            self._mask, self._lens, self._last, self._rows = mask, lens, last, seqs
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._mask = torch.cat([F.pad(self._mask, (width - self._mask.shape[1], 0)),
                                F.pad(mask, (width - mask.shape[1], 0))])
        self._lens = torch.cat([self._lens, lens])
        self._last = torch.cat([self._last, last])
        self._rows = self._rows + seqs

    @torch.inference_mode()
    def _decode_step(self) -> None:
        live = [j for j, seq in enumerate(self._rows) if not seq.req.future.done()]
        if len(live) < len(self._rows):  # callers cancelled: drop their rows before computing
            self._evict(live)
            if not self._rows:
                return
        batch = len(self._rows)
        self._mask = torch.cat([self._mask, self._mask.new_ones(batch, 1)], dim=1)
        self._kv.reserve(1)
        if self.fast_decode:
            logits = fast_decode_lib.decode_step(self.model, self._last, self._lens, self._kv, self._mask)
        else:
            logits = self.model(input_ids=self._last[:, None], attention_mask=self._mask,
                                position_ids=self._lens[:, None], past_key_values=self._kv.cache(),
                                use_cache=True).logits[:, -1]
        self._kv.advance(1)
        self._lens = self._lens + 1
        tokens = self._sample(logits.float(), self._rows)
        self._last = torch.tensor([t for t, _ in tokens], device=self.device)
        keep, done = [], {}
        for j, seq in enumerate(self._rows):
            if self._append(seq, *tokens[j]):
                done[id(seq.req)] = seq.req
                if self.prefix_cache_bytes:
                    self._prefix_store(j)
            else:
                keep.append(j)
        for req in done.values():
            self._deliver(req)
        if len(keep) < batch:
            self._evict(keep)

    def _evict(self, keep: list[int]) -> None:
        order = self._kv.compact(keep)
        if not order:
            self._rows, self._mask, self._lens, self._last = [], None, None, None
            return
        idx = torch.tensor(order, device=self.device)
        self._mask, self._lens, self._last = (
            t.index_select(0, idx) for t in (self._mask, self._lens, self._last))
        self._rows = [self._rows[j] for j in order]
        start = int(self._mask.any(0).int().argmax())  # first column holding a real token
        if start > 0:
            self._kv.start += start
            self._mask = self._mask[:, start:]

    # ---------------------------------------------------------------- sampling
    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[tuple[int, float]]:
        """Choose one token per row; return (token, log_softmax(logits/T)[token]) per row."""
        params = [seq.req.params for seq in seqs]
        temps = torch.tensor([p.temperature if p.temperature >= GREEDY_BELOW else 1.0 for p in params],
                             device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        tokens = logits.argmax(-1)
        sampled = [p.temperature >= GREEDY_BELOW for p in params]
        plain = [j for j, p in enumerate(params) if sampled[j] and p.top_k <= 0 and p.top_p >= 1]
        filtered = [j for j, p in enumerate(params) if sampled[j] and (p.top_k > 0 or p.top_p < 1)]
        if plain:
            rows = torch.tensor(plain, device=logits.device)
            tokens[rows] = self._invert_cdf(logp[rows].exp(), [seqs[j] for j in plain])
        if filtered:
            rows = torch.tensor(filtered, device=logits.device)
            probs, order = logp[rows].exp().sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[1], device=logits.device)
            top_k = torch.tensor([params[j].top_k if params[j].top_k > 0 else probs.shape[1]
                                  for j in filtered], device=logits.device)
            top_p = torch.tensor([params[j].top_p for j in filtered], device=logits.device)
            # nucleus: keep a token while the mass strictly before it is < top_p (the top one stays)
            keep = (rank[None] < top_k[:, None]) & ((probs.cumsum(-1) - probs) < top_p[:, None])
            keep[:, 0] = True
            pick = self._invert_cdf(probs * keep, [seqs[j] for j in filtered])
            tokens[rows] = order.gather(1, pick[:, None])[:, 0]
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        return list(zip(tokens.tolist(), chosen.tolist()))

    @staticmethod
    def _invert_cdf(probs: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        # One uniform per row from the row's own generator: independent of batch composition.
        u = torch.tensor([torch.rand((), generator=seq.gen).item() for seq in seqs],
                         device=probs.device, dtype=probs.dtype)
        cdf = probs.cumsum(-1)
        # right=True picks the first index whose cdf exceeds u*total: never a zero-probability token
        idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        return idx.clamp(max=probs.shape[1] - 1)

    # ---------------------------------------------------------------- bookkeeping
    def _append(self, seq: _Seq, token: int, logprob: float) -> bool:
        """Record a token; return True when the sequence is finished."""
        req, params = seq.req, seq.req.params
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        if token in req.stop_ids or (params.stop and self._hits_stop(seq)):
            seq.finish = "stop"
        elif (len(seq.tokens) >= params.max_new_tokens
              or len(req.prompt) + len(seq.tokens) >= self.max_model_len):
            seq.finish = "length"
        return seq.finish is not None

    def _hits_stop(self, seq: _Seq) -> bool:
        # Earlier tokens were checked already, so a new match ends inside the last few tokens:
        # a stop of b UTF-8 bytes spans at most b tokens (+1 for a split leading character).
        stops = seq.req.params.stop
        window = max(len(s.encode("utf-8")) for s in stops) + 1
        text = self.tokenizer.decode(seq.tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in stops)

    @staticmethod
    def _deliver(req: _Request) -> None:
        if req.future.done() or any(seq.finish is None for seq in req.seqs):
            return
        req.future.set_result([GenerationOutput(seq.tokens, seq.logprobs, seq.finish)
                               for seq in req.seqs])
