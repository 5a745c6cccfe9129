"""Rollout engine interface: sampling parameters, outputs, the `Engine` ABC and `make_engine`.

Backends: `torch` (embedded PyTorch engine, any device, in `torch_engine.py`), `sglang`
(optional GPU extra, `sglang_engine.py`) and `vllm` (optional extra, runs on CPU too,
`vllm_engine.py`). All are imported lazily so that this module never pulls in a backend the
caller does not use.
"""
import asyncio
import importlib.util
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable

import torch

logger = logging.getLogger(__name__)

@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 (or < 1e-6) means greedy decoding
    top_p: float = 1.0            # nucleus sampling mass, in (0, 1]
    top_k: int = -1               # keep the k most likely tokens; -1 (or 0) disables
    max_new_tokens: int = 128     # >= 1
    stop: list[str] = field(default_factory=list)            # stop strings (decoded text)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer eos
    n: int = 1                    # samples per prompt
    seed: int | None = None       # per-request seed; sample i of n uses a seed derived from (seed, i)

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (-1 or 0 disables), got {self.top_k}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens}")
        if int(self.n) != self.n or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class GenerationOutput:
    token_ids: list[int]          # generated tokens (stop token / stop string included)
    logprobs: list[float]         # log_softmax(logits / T) of each token, before top-p/top-k
    finish_reason: str            # "stop" | "length" | "abort"


class Engine(ABC):
    """A generation backend shared by many concurrent asyncio callers (one event loop)."""

    # The event loop the backend is bound to (SGLang: fixed at construction), or None when any
    # loop works. Callers run their rollout coroutines on it when it is set.
    loop = None

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        """Generate `params.n` continuations of `prompt_ids` (a list of length n)."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors keyed by HF parameter names."""

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> None:
        """Serve the base model with this LoRA adapter from now on: full lora_A/lora_B tensors
        under PEFT's saved names, and PEFT's adapter_config fields (engines that load adapters:
        vLLM)."""
        raise NotImplementedError(f"{type(self).__name__} takes merged weights, not LoRA adapters")

    def can_share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> bool:
        """Whether `share_weights` works (weights in this process's CPU memory), and, given
        (name, tensor) pairs (meta tensors do), whether it would accept exactly those."""
        return False

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Use these full CPU tensors (shared memory written by the trainer ranks) as the weights
        themselves, without a copy; later in-place rewrites are announced by `weights_changed`."""
        raise NotImplementedError(f"{type(self).__name__} cannot share weights")

    def weights_changed(self) -> None:
        """The shared weight tensors were rewritten in place."""
        raise NotImplementedError(f"{type(self).__name__} cannot share weights")

    def weights_shared(self) -> bool:
        """Whether the weights are still the tensors given to `share_weights` (an
        `update_weights` call gives the engine its own copy again)."""
        return False

    @abstractmethod
    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free generation memory while training runs; in-flight requests end with "abort".
        tags: subset of ["weights", "kv_cache"]; None = all."""

    @abstractmethod
    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Undo `release_memory` for `tags` (None = all). Weight sync order: resume ["weights"],
        update_weights, resume ["kv_cache"]."""

    def abort_requests(self) -> None:
        """End every in-flight request now with finish_reason "abort", returning the tokens
        generated so far (asynchronous rollout: new weights arrive mid-generation; the caller
        continues or restarts them). Called from the engine's event-loop thread, between
        scheduler steps. Default: drop and re-take the KV cache, which aborts in-flight requests
        (see `release_memory`); backends with a cheaper abort override it."""
        self.release_memory(["kv_cache"])
        self.resume_memory(["kv_cache"])

    @abstractmethod
    def shutdown(self) -> None:
        """Abort pending requests and free everything."""


def check_prompt(prompt_ids, max_model_len: int, vocab_size: int | None = None) -> list[int]:
    """The prompt as a list of ints, or a ValueError saying why no engine can continue it."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt: generation needs at least one prompt token")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len={max_model_len} "
                         "leaves no room for a generated token")
    if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return prompt


def on_this_cuda_device():
    """A function that makes the CUDA device current here the current one of the thread that
    calls it: the current device is per host thread and a new thread starts on device 0 (a
    rank on another GPU would send, capture or allocate there). A no-op without CUDA."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return (lambda: None) if device is None else (lambda: torch.cuda.set_device(device))


async def in_daemon_thread(fn, *args):
    """`await asyncio.to_thread(fn, *args)`, on a daemon thread of its own: a transfer call
    (joining a weight-transfer group, a broadcast) blocks until its peer arrives or its timeout
    (up to server_timeout). When the server's side failed, the trainer stops with that error at
    once; a blocked executor thread would hold the process's exit until the timeout. The
    thread runs on the caller's CUDA device (`on_this_cuda_device`)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    set_device = on_this_cuda_device()

    def settle(method, value):
        if not done.done():
            getattr(done, method)(value)

    def run():
        try:
            set_device()
            result, method = fn(*args), "set_result"
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, method = e, "set_exception"
        try:
            loop.call_soon_threadsafe(settle, method, result)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, daemon=True, name="rl2-transfer").start()
    return await done


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the loop's remaining tasks (an engine's scheduler or output handler), let them
    finish, then close it. A loop that is running or closed is left alone."""
    if loop.is_closed() or loop.is_running():
        return
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (an empty gather would belong to the thread's current loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


KINDS = ("auto", "torch", "sglang", "vllm")


def resolve_engine_kind(kind: str, device: str = "cuda") -> str:
    """The concrete backend for `kind`: "auto" is sglang when it is importable, CUDA is available
    and the trainer runs on CUDA, else torch. Decided once, before any backend argument is built."""
    if kind not in KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; expected 'auto', 'torch', 'sglang' or 'vllm'")
    if kind != "auto":
        return kind
    usable = (device == "cuda" and torch.cuda.is_available()
              and importlib.util.find_spec("sglang") is not None)
    return "sglang" if usable else "torch"


def make_engine(kind: str, model_path, tokenizer, **kw) -> Engine:
    """Build an engine. kind: "auto" (see `resolve_engine_kind`), "torch", "sglang" or "vllm"
    (with `server_url`: a `vllm serve` process). `model_path` is an HF directory (the torch engine
    also takes an nn.Module); `kw` goes to the backend, so with "auto" pass only arguments both
    backends take."""
    if kind == "auto":
        kind = resolve_engine_kind(kind)
        logger.info("make_engine(auto): using the %s engine", kind)
    if kind == "torch":
        from RL2.rollout.torch_engine import TorchEngine
        return TorchEngine(model_path, tokenizer, **kw)
    if kind == "vllm":
        from RL2.rollout import vllm_engine

        url = kw.pop("server_url", None)
        if url:  # a `vllm serve` process: HTTP only, vLLM need not be installed here
            from RL2.rollout.vllm_server import VLLMServerEngine
            return VLLMServerEngine(url, tokenizer, **kw)
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(vllm_engine.MISSING)
        return vllm_engine.VLLMEngine(model_path, tokenizer, **kw)
    if kind == "sglang":
        if importlib.util.find_spec("sglang") is None:
            raise ImportError(
                "engine 'sglang' needs the optional SGLang extra (GPU only), which is not "
                "installed; install it in its own environment or use engine=torch")
        from RL2.rollout.sglang_engine import SGLangEngine
        return SGLangEngine(model_path, tokenizer, **kw)
    raise ValueError(f"unknown engine kind {kind!r}; expected 'auto', 'torch', 'sglang' or 'vllm'")
