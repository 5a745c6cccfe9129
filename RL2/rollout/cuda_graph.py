"""CUDA graphs for the embedded engine's decode step. GPU only, and NOT RUN: no GPU was
available to this project (README, Status). The static-shape step it replays
(`llama_forward.decode_static`) is tested on the CPU against the ordinary decode.

Why: on a GPU a small-batch decode step is bound by kernel launches (about ten small kernels
per layer, each issued from Python), not by the GPU. A captured graph replays the whole step
as one launch. A graph fixes shapes and addresses, so the captured step attends over the whole
KV buffers with a mask (`BatchKV.full_bias`), reads its token, position and write column from
tensors filled before each replay, and there is one graph per row-count bucket (powers of two,
up to the buffers' rows; live rows padded up to it). Graphs are captured at first use and
dropped when the KV cache is replaced or its buffers reallocated (a graph keeps the addresses
it was captured on: it would read freed memory) or the weights change (`clear`). The capture
follows torch.cuda.graphs' rules: warm-up on a side stream, then `torch.cuda.graph` with one
memory pool shared by every bucket, in "thread_local" error mode: with async rollouts
(`max_staleness > 0`) the trainer thread allocates on the same GPU during a capture, which the
default "global" mode makes an error in that thread (torch/cuda/graphs.py, `capture_error_mode`).
"""
import logging

import torch

from RL2.rollout import llama_forward

logger = logging.getLogger(__name__)


def unsupported(model) -> str | None:
    """Why `model`'s decode step cannot be captured, or None. "dynamic" RoPE re-reads its
    length from a device tensor in Python (a host sync inside a capture) and replaces its
    `inv_freq` buffer (transformers/modeling_rope_utils.py, dynamic_frequency_update)."""
    from RL2.parallel.attention import rope_types

    dynamic = sorted({t for t in rope_types(model) if "dynamic" in t})
    return f"rope_type {dynamic} (dynamic RoPE) cannot be captured" if dynamic else None


class GraphedDecode:
    def __init__(self, model, linear):
        self.model, self.linear = model, linear
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, static inputs, logits, buffers)
        self.buffers = None  # (cache, its realloc count) the graphs were captured on
        self.pool = None

    def clear(self) -> None:
        self.graphs.clear()
        self.buffers = self.pool = None

    def __call__(self, kv, tokens: torch.Tensor) -> torch.Tensor | None:
        """`llama_forward.decode(model, tokens, kv)` by replaying a graph; None when capturing
        failed (logged; the caller then decodes eagerly and drops this object). The eager step
        may rerun after a failed capture: it writes the same column with the same values."""
        # the cache object and its realloc count, not an address: a new cache's first buffer
        # can land where the old one was while the other layers' land elsewhere
        if self.buffers is None or self.buffers[0] is not kv or self.buffers[1] != kv.reallocs:
            self.clear()
            self.buffers = (kv, kv.reallocs)
        bucket = min(kv.k[0].shape[0], 1 << (kv.rows - 1).bit_length())
        if bucket not in self.graphs:
            try:
                self.graphs[bucket] = self._capture(kv, tokens, bucket)
            except Exception:  # noqa: BLE001 - a capture that fails: the eager step still works
                logger.warning("cuda_graph: capturing the decode step failed; decoding without "
                               "graphs from now on", exc_info=True)
                return None
        graph, inputs, logits, _ = self.graphs[bucket]
        self._load(inputs, kv, tokens, bucket)
        graph.replay()
        return logits[:kv.rows].clone()  # the next replay overwrites the static output

    def _load(self, inputs: dict, kv, tokens: torch.Tensor, bucket: int) -> None:
        n = kv.rows
        inputs["tokens"][:n].copy_(tokens)
        inputs["tokens"][n:].zero_()
        inputs["positions"][:n].copy_(kv.lens)
        inputs["positions"][n:].zero_()
        inputs["column"].fill_(kv.end)
        inputs["bias"].copy_(kv.full_bias(bucket, inputs["bias"].dtype))

    def _capture(self, kv, tokens: torch.Tensor, bucket: int) -> tuple:
        device = kv.k[0].device
        dtype = self.model.model.embed_tokens.weight.dtype
        inputs = dict(tokens=torch.zeros(bucket, dtype=torch.long, device=device),
                      positions=torch.zeros(bucket, dtype=torch.long, device=device),
                      column=torch.zeros(1, dtype=torch.long, device=device),
                      bias=kv.full_bias(bucket, dtype))
        keys, values = [k[:bucket] for k in kv.k], [v[:bucket] for v in kv.v]
        # this step's own inputs: the warm-up writes the same keys and values the replay will
        self._load(inputs, kv, tokens, bucket)

        def step():
            return llama_forward.decode_static(self.model, inputs["tokens"], inputs["positions"],
                                               inputs["column"], inputs["bias"], keys, values,
                                               self.linear)

        graph, logits = self._record(step, device)
        return graph, inputs, logits, (keys, values)  # held: the memory the graph replays on

    def _record(self, step, device) -> tuple:
        """(a CUDA graph of `step`, its static output). The only CUDA-specific part."""
        with torch.cuda.device(device):  # the capture stream and pool on the cache's GPU
            return self._record_on(step, device)

    def _record_on(self, step, device) -> tuple:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        # lazy initialisations (cuBLAS handles, workspaces) first; torch's docs and
        # make_graphed_callables warm up 3 times (the step rewrites the same column: idempotent)
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.current_stream(device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = step()
        finally:
            # torch.cuda.graph's __exit__ calls capture_end() before it restores the stream, so
            # a capture that fails (capture_end raises) would leave this thread on the capture
            # stream, unordered with the trainer's writes to the weights (torch/cuda/graphs.py)
            torch.cuda.set_stream(before)
        self.pool = graph.pool()
        return graph, logits
