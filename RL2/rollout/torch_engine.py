"""Embedded PyTorch rollout engine: an HF causal LM in-process, serving many asyncio callers.

Parts (one file each):
- this file: the `Engine` API (generate, weights, memory) and the scheduler;
- `model_runner.py` + `llama_forward.py` + `kv_cache.py`: how rows are prefilled and decoded.
  Llama-family models run our own forward over KV buffers the engine owns (plain tensors; no
  transformers cache class is subclassed or patched, so the trainer's transformers and the
  older one pinned by the vLLM extra both work; `tests/test_torch_engine.py` runs under both).
  Other architectures recompute each row's context with the HF forward (correct, slow);
- `sampling.py`: per-sample state, token choice, stop rules;
- `prefix_cache.py`: KV of finished samples reused by prompts that extend them.

Scheduling (continuous batching): `generate` puts a request in a waiting list and awaits a
future. One scheduler task per event loop (started on first use) runs one forward pass per step
and yields to the loop (`asyncio.sleep(0)`) after each, so environments and callers run between
steps. A step decodes one token of every running row and, in the same pass, prefills the waiting
requests (bounded by `max_batch_size` rows and `max_prefill_tokens` prompt tokens; unpadded;
each distinct prompt once, also when separate requests repeat it, its KV repeated for its
samples): at a decode step's few rows the linear layers are bound by reading their weights, so
the prompts' tokens ride along instead of paying that read again (a multi-turn rollout admits a
turn or two at a time). The decoded rows that finish are evicted at once; the prompts' first
tokens are sampled and their rows join the batch for the next step.
A request that arrives mid-decode joins at the next step instead of waiting for the batch to
drain (static batching).

Errors: invalid params, empty/out-of-vocab/too-long prompts raise ValueError in `generate`; an
exception inside the scheduler is set on every pending request and the scheduler keeps serving.
Thread model: call everything from the event loop's thread; the sync methods (update_weights,
release/resume) run between decode steps. Requests still decoding during update_weights keep
their cache and continue with the new weights. Finish reasons: "stop", "length" (max_new_tokens,
or the context `max_model_len` reached), "abort" (release_memory, shutdown).
"""
import asyncio
import gc
import logging
import random
from typing import Iterable

import torch

from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams, check_prompt
from RL2.rollout.model_runner import make_runner
from RL2.rollout.prefix_cache import PrefixCache
from RL2.rollout.sampling import Request, Seq, sample
from RL2.utils import onednn
from RL2.utils.config import check_choice

logger = logging.getLogger(__name__)

ROOM_CAP = 1024  # decode columns reserved up front when rows join the batch


class TorchEngine(Engine):
    raw_seeds = False  # True (RL2.rollout.server): a request's seed is its one sample's, as in vLLM

    def __init__(self, model, tokenizer=None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | str = torch.float32, max_model_len: int | None = None,
                 max_batch_size: int = 256, max_prefill_tokens: int = 16384,
                 prefix_cache_mb: float = 512, attn_implementation: str = "sdpa",
                 offload_weights: bool = True, own_forward: bool = True, seed: int = 0,
                 cpu_matmul: str = "onednn", cuda_graph: bool = False,
                 compile_decode: bool = False, small_gemm: bool = True):
        """`model`: HF directory or an nn.Module (used as is, not copied). `tokenizer`: HF
        tokenizer, a path, or None (then no stop strings and no implicit eos). `offload_weights`:
        release_memory also moves the weights to CPU (only when the device is not CPU).
        `prefix_cache_mb`: memory for the KV of finished samples, kept for reuse by later prompts
        that extend them (0 disables). `own_forward`: Llama-family models run through
        `llama_forward.py` over the engine's KV buffers (False: every model uses the HF forward
        without a cache, as other architectures always do; for tests). `cpu_matmul`: "onednn"
        (linear layers on oneDNN-packed weights on the CPU, RL2/utils/onednn.py), "aten", or
        "auto" (oneDNN: faster at decode shapes on AMD and Intel alike). `small_gemm`: with
        oneDNN, products of a few fp32 rows (decode steps) through RL2's AVX-512 kernel where
        it builds (RL2/utils/small_gemm.py; else oneDNN).
        `cuda_graph`: on CUDA, decode steps of Llama-family models replay CUDA graphs
        (RL2/rollout/cuda_graph.py; written, not run on a GPU). `compile_decode`: on the CPU,
        decode steps of Llama-family models run one torch.compile'd graph
        (RL2/rollout/compiled_decode.py; the first step compiles, ~15-20 s)."""
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
        use_onednn = onednn.resolve(check_choice(cpu_matmul, "cpu_matmul", onednn.CHOICES),
                                    training=False) == "onednn"
        self.runner = make_runner(self.model, self.device, own_forward, onednn=use_onednn,
                                  cuda_graph=cuda_graph, compile_decode=compile_decode,
                                  small_gemm=small_gemm)
        self.own_forward = self.runner.caches_prefixes
        cfg = self.model.config.get_text_config(decoder=True)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.offload_weights = offload_weights
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20) if self.own_forward else 0)
        self.stats = {"prefill_tokens": 0, "cached_prompt_tokens": 0}
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._rng = random.Random(seed)
        self._weights_shared = False  # weights are tensors owned by the trainer (share_weights)
        self._waiting: list[Request] = []
        self._reset_batch()
        self._loop = self._task = self._wakeup = None
        self._released: set[str] = set()
        self._closed = False

    # ---------------------------------------------------------------- public API
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        if self._closed:
            raise RuntimeError("TorchEngine is shut down")
        if self._released:
            raise RuntimeError(f"TorchEngine memory {sorted(self._released)} is released; "
                               "call resume_memory() first")
        params.validate()
        prompt = check_prompt(prompt_ids, self.max_model_len, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        loop = asyncio.get_running_loop()
        self._ensure_scheduler(loop)
        req = Request(prompt, params, loop.create_future(),
                      self._eos_ids | frozenset(int(t) for t in params.stop_token_ids))
        req.add_samples(self._rng, raw_seed=self.raw_seeds)
        self._waiting.append(req)
        self._wakeup.set()
        return await req.future

    def clear_prefix_cache(self) -> None:
        self.prefix_cache.clear()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # keep_vars gives the live parameters; tied weights appear under both names.
        self.weights_changed()
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
        self.weights_changed()
        self._weights_shared = True
        for name, tensor in named:
            targets[name].data = tensor  # tied weights: one parameter under two names, same values

    def weights_changed(self) -> None:
        self.prefix_cache.clear()  # cached KV belongs to the old weights
        self.runner.weights_changed()  # and so do packed copies of them

    def weights_shared(self) -> bool:
        return self._weights_shared

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Any tag aborts in-flight requests and drops the KV cache; "weights" (or None) also
        moves the weights to CPU when offload_weights is set and the device is not CPU."""
        tags = set(tags or ("weights", "kv_cache"))
        self._abort_all()
        self.weights_changed()  # also frees the packed weights until the next step
        if "weights" in tags and self.offload_weights and self.device.type != "cpu":
            self.model.to("cpu")
        self._released |= tags
        if self.device.type == "cuda":
            # A full collection walks all of a trainer's objects, every rollout; only worth it
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
        self.model = self.runner = None
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
                    self._step()
                except Exception as exc:  # deliver to every caller instead of hanging them
                    logger.exception("TorchEngine scheduler step failed")
                    self._fail_all(exc)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._abort_all()
            raise

    def _reset_batch(self) -> None:
        self._admitting: list[Request] = []  # taken from the queue, being prefilled
        self._rows: list[Seq] = []      # one running sample per runner row
        self._last = None               # [B] last sampled token of each row, not yet in the cache
        if getattr(self, "runner", None) is not None:
            self.runner.reset()

    def _pending(self) -> list[Request]:
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
                req.deliver()
            except RuntimeError:  # the request's event loop is already closed
                pass

    # ---------------------------------------------------------------- steps
    def _take_waiting(self) -> tuple[list[Request], list[tuple[int, object]], list[int]]:
        """Waiting requests for one prefill (within the row and prefill-token budgets), the
        prefix-cache hit of each, and for each the index of the first request with its prompt."""
        batch, hits, which, first = [], [], [], {}
        rows, tokens = len(self._rows), 0
        while self._waiting:
            req = self._waiting[0]
            hit = self.prefix_cache.lookup(req.prompt) if self.own_forward else (0, None)
            key = tuple(req.prompt)
            new = 0 if key in first else len(req.prompt) - hit[0]  # a repeat is prefilled once
            fits = rows + req.params.n <= self.max_batch_size and tokens + new <= self.max_prefill_tokens
            if not fits and (batch or rows):
                break  # an oversized request still runs, alone, once the engine is empty
            self._waiting.pop(0)
            if req.future.done():  # caller gave up before admission
                continue
            which.append(first.setdefault(key, len(batch)))
            batch.append(req)
            hits.append(hit)
            rows, tokens = rows + req.params.n, tokens + new
        return batch, hits, which

    @torch.inference_mode()
    def _step(self) -> None:
        """One forward pass: a decode step of the running rows, and in the same pass the prefill
        of the waiting requests the budgets admit (their rows join the batch afterwards)."""
        live = [j for j, seq in enumerate(self._rows) if not seq.req.future.done()]
        if len(live) < len(self._rows):  # callers cancelled: drop their rows before computing
            self._evict(live)
        batch, hits, which = self._take_waiting() if self._waiting else ([], [], [])
        if not batch and not self._rows:
            return
        self._admitting = batch  # if the pass fails, these callers get the error too
        # Each distinct prompt is prefilled once and its n samples start from the same logits
        # and KV; so are identical prompts of separate requests (a GRPO group whose samples
        # run as trajectories of their own: 16 x 18 -> 4 x 18 prefill tokens in the benchmark)
        unique = [i for i, w in enumerate(which) if w == i]
        prompts, prompt_hits = [batch[i].prompt for i in unique], [hits[i] for i in unique]
        if batch and self._rows:
            logits, prompt_logits = self.runner.step(self._last, prompts, prompt_hits)
        elif batch:
            prompt_logits = self.runner.prefill(prompts, prompt_hits)
        else:
            logits = self.runner.decode(self._last)
        if self._rows:
            self._decoded(logits)
        if batch:
            self.stats["prefill_tokens"] += sum(len(p) - h[0] for p, h in zip(prompts, prompt_hits))
            self.stats["cached_prompt_tokens"] += sum(h[0] for h in prompt_hits)
            self._admitted(batch, which, unique, prompt_logits)
        self._admitting = []

    def _admitted(self, batch: list[Request], which: list[int], unique: list[int],
                  logits: torch.Tensor) -> None:
        """First tokens of the prefilled requests; the rows that go on join the batch."""
        at = {i: u for u, i in enumerate(unique)}
        src = [at[which[i]] for i, req in enumerate(batch) for _ in req.seqs]
        seqs = [seq for req in batch for seq in req.seqs]
        rows = torch.tensor(src, device=logits.device)
        tokens = sample(logits.float().index_select(0, rows), seqs)
        keep = [j for j, seq in enumerate(seqs) if not self._append(seq, *tokens[j])]
        for req in batch:
            req.deliver()
        if keep:
            self._join([src[j] for j in keep], [seqs[j] for j in keep],
                       torch.tensor([tokens[j][0] for j in keep], device=self.device))

    def _join(self, src: list[int], seqs: list[Seq], last: torch.Tensor) -> None:
        """New rows (prompts `src` of the last prefill) join the running batch."""
        # decode columns these rows may still need (capped: most responses stop early; the
        # cache still grows by doubling past the cap)
        room = max(min(s.req.params.max_new_tokens - len(s.tokens),
                       self.max_model_len - len(s.req.prompt) - len(s.tokens)) for s in seqs)
        self.runner.join(src, room=min(max(room, 0), ROOM_CAP))
        self._last = last if self._last is None else torch.cat([self._last, last])
        self._rows = self._rows + seqs

    def _decoded(self, logits: torch.Tensor) -> None:
        """Next tokens of the running rows; finished rows leave the batch."""
        tokens = sample(logits.float(), self._rows)
        self._last = torch.tensor([t for t, _ in tokens], device=self.device)
        keep, done = [], {}
        for j, seq in enumerate(self._rows):
            if self._append(seq, *tokens[j]):
                done[id(seq.req)] = seq.req
                self._store_prefix(j)
            else:
                keep.append(j)
        for req in done.values():
            req.deliver()
        if len(keep) < len(self._rows):
            self._evict(keep)

    def _append(self, seq: Seq, token: int, logprob: float) -> bool:
        return seq.append(token, logprob, self.max_model_len, self.tokenizer)

    def _store_prefix(self, row: int) -> None:
        """Keep a finished row's KV (prompt + all tokens but the last: the last is not cached)."""
        if not self.prefix_cache.max_bytes:
            return
        seq = self._rows[row]
        key = tuple(seq.req.prompt + seq.tokens[:-1])
        if self.prefix_cache.wants(key, len(key) * self.runner.token_bytes()):
            self.prefix_cache.store(key, *self.runner.row_kv(row))

    def _evict(self, keep: list[int]) -> None:
        order = self.runner.keep(keep)
        self._rows = [self._rows[j] for j in order]
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self._last = self._last.index_select(0, idx) if order else None
