"""Model runners of the embedded engine: how the running batch's rows are prefilled and decoded.

Both keep their rows in the order the scheduler keeps its samples: `join` appends rows, `keep`
drops rows and returns the new order (old index per new row).

- `KVRunner` (Llama-family models, the default): our own forward (`llama_forward.py`) over our
  own KV buffers (`kv_cache.BatchKV`). Nothing of transformers' cache API is used. On the CPU
  its linear layers use oneDNN-packed copies of the weights (`RL2/utils/onednn.py`; dropped by
  `weights_changed`, rebuilt on the next step), and products of a few rows (decode steps) RL2's
  AVX-512 kernel where it builds (`small_gemm`, `RL2/utils/small_gemm.py`), which then also
  does the norms, residual adds and gated activation around them. With `compile_decode` (CPU)
  decode steps of two or more rows run one inductor-compiled graph (`compiled_decode.py`). On CUDA with
  `cuda_graph`, decode steps replay CUDA graphs (`cuda_graph.py`; written, not run: no GPU here).
- `RecomputeRunner` (every other architecture, or `own_forward=False`): the HF forward over
  each row's whole context at every step, with no KV cache at all. Quadratic in the length, but
  it relies only on the forward's public arguments (`input_ids`, `attention_mask`,
  `position_ids`), so it cannot break with transformers' cache internals either. Meant for
  correctness on models the fast path does not cover; use vLLM or SGLang for speed on them.
"""
import logging

import torch

from RL2.rollout import llama_forward
from RL2.rollout.kv_cache import BatchKV
from RL2.utils.onednn import PackedLinears

logger = logging.getLogger(__name__)


class KVRunner:
    caches_prefixes = True  # rows' KV can be kept for later prompts (`row_kv`)

    def __init__(self, model, device, onednn: bool = True, cuda_graph: bool = False,
                 compile_decode: bool = False, small_gemm: bool = False):
        self.model, self.device = model, device
        cpu = torch.device(device).type == "cpu"
        # oneDNN and RL2's kernel are CPU libraries: on CUDA every product stays F.linear
        self.linear = PackedLinears(enabled=onednn and cpu, small=small_gemm and cpu)
        self.graphed = self.compiled = None
        if compile_decode:
            if not cpu:
                raise ValueError("compile_decode is for the CPU engine; on CUDA use cuda_graph")
            from RL2.rollout.compiled_decode import CompiledDecode  # registers its op: only if used

            self.compiled = CompiledDecode(model, self.linear)
            if self.linear.small:
                logger.warning("compile_decode: the compiled decode step does not use RL2's "
                               "AVX-512 kernel, available here, whose eager step measured faster "
                               "(benchmarks/README.md, fix 27); consider compile_decode=false")
        if cuda_graph and torch.device(device).type == "cuda":
            from RL2.rollout.cuda_graph import GraphedDecode, unsupported

            why = unsupported(model)
            if why:
                logger.warning("cuda_graph: %s; decoding without graphs", why)
            else:
                self.graphed = GraphedDecode(model, self.linear)
        self.reset()

    def reset(self) -> None:
        self.kv = BatchKV()
        self._staged = None
        if self.graphed is not None:  # captured on the old cache's buffers
            self.graphed.clear()

    def weights_changed(self) -> None:
        self.linear.clear()
        if self.graphed is not None:  # replaced weights (share, release) live elsewhere
            self.graphed.clear()

    def prefill(self, prompts: list[list[int]], hits: list[tuple[int, list | None]]) -> torch.Tensor:
        """Last-token logits [P, vocab] of each prompt; hits[i] = (cached tokens, their KV)."""
        logits, *self._staged = llama_forward.prefill(
            self.model, [p[n:] for p, (n, _) in zip(prompts, hits)], [kv for _, kv in hits], self.device,
            self.linear)
        return logits

    def step(self, last: torch.Tensor, prompts: list[list[int]], hits: list) -> tuple:
        """`decode(last)` and `prefill(prompts, hits)` as one forward pass (the weights read
        once for both): (decode logits, prefill logits). The prompts' rows join as after
        `prefill`. Eager also with `compile_decode` or `cuda_graph`: their fixed-form decode
        step plus a prefill pass would read the weights twice."""
        self.kv.reserve(1)
        logits, prompt_logits, *self._staged = llama_forward.mixed(
            self.model, last, self.kv, [p[n:] for p, (n, _) in zip(prompts, hits)],
            [kv for _, kv in hits], self.device, self.linear)
        self.kv.advance()
        return logits, prompt_logits

    def join(self, src: list[int], room: int) -> None:
        """Add rows for prompts `src` (indices into the last prefill; repeats allowed) with
        `room` decode columns reserved."""
        keys, values, lens = self._staged
        idx = torch.tensor(src, device=self.device)
        self.kv.add([k.index_select(0, idx) for k in keys], [v.index_select(0, idx) for v in values],
                    lens.index_select(0, idx), room=room)
        self._staged = None

    def decode(self, last: torch.Tensor) -> torch.Tensor:
        self.kv.reserve(1)
        logits = None
        if self.graphed is not None:
            logits = self.graphed(self.kv, last)
            if logits is None:  # capturing failed (logged): eager from now on
                self.graphed = None
        elif self.compiled is not None and self.kv.rows > 1:  # one row: eager (dynamo
            logits = self.compiled(self.kv, last)              # specialises size 1)
            if logits is None:  # compiling failed (logged): eager from now on
                self.compiled = None
        if logits is None:
            logits = llama_forward.decode(self.model, last, self.kv, self.linear)
        self.kv.advance()
        return logits

    def keep(self, rows: list[int]) -> list[int]:
        return self.kv.compact(rows)

    def token_bytes(self) -> int:
        return self.kv.token_bytes()

    def row_kv(self, row: int) -> tuple[list, int]:
        """(per-layer (keys, values) of one row's cached tokens, their bytes)."""
        return self.kv.row(row), int(self.kv.lens[row]) * self.kv.token_bytes()


class RecomputeRunner:
    caches_prefixes = False

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.reset()

    def reset(self) -> None:
        self.contexts: list[list[int]] = []
        self._staged = None

    def weights_changed(self) -> None:
        pass

    @torch.inference_mode()
    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        width = max(map(len, seqs))
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=self.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # left padding shifts no position
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          use_cache=False).logits[:, -1]

    def prefill(self, prompts, hits) -> torch.Tensor:
        self._staged = prompts
        return self._forward(prompts)

    def join(self, src: list[int], room: int) -> None:
        self.contexts += [list(self._staged[i]) for i in src]
        self._staged = None

    def decode(self, last: torch.Tensor) -> torch.Tensor:
        for context, token in zip(self.contexts, last.tolist()):
            context.append(token)
        return self._forward(self.contexts)

    def step(self, last: torch.Tensor, prompts, hits) -> tuple:
        return self.decode(last), self.prefill(prompts, hits)

    def keep(self, rows: list[int]) -> list[int]:
        self.contexts = [self.contexts[j] for j in rows]
        return rows


def make_runner(model, device, own_forward: bool = True, onednn: bool = True,
                cuda_graph: bool = False, compile_decode: bool = False, small_gemm: bool = False):
    if own_forward and llama_forward.supports(model):
        return KVRunner(model, device, onednn, cuda_graph, compile_decode, small_gemm)
    return RecomputeRunner(model, device)

