"""`VLLMServerEngine`: a `vllm serve` process (or `python -m RL2.rollout.server`) reached over
HTTP: `/inference/v1/generate` (token ids in/out; needs `--enable-scale-out`) and the RL routes
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, `/weight_info`; need `VLLM_SERVER_DEV_MODE=1`). Every request has a
bounded timeout; a dead server is a clear error. Sampling mapping and the weight-update protocol
are shared with the in-process engine (`vllm_engine._VLLMBase`). Only the standard library talks
to the server: the trainer needs no vLLM.
"""
import asyncio
import concurrent.futures
import logging

from RL2.rollout.engine import GenerationOutput
from RL2.rollout.server_protocol import http_call, wait_until_up
from RL2.rollout.vllm_engine import _VLLMBase, _finish
from RL2.rollout.vllm_transfer import (BACKEND, SPLIT_DP, GlooSender, NcclSender, address_towards,
                                       split_dp_mode)
from RL2.workers.lora import AdapterVersions

logger = logging.getLogger(__name__)


class VLLMServerEngine(_VLLMBase):
    """A running `vllm serve` (started with `VLLM_SERVER_DEV_MODE=1`, `--enable-scale-out`,
    `--logprobs-mode processed_logprobs`, and on CPU `--weight-transfer-config
    '{"backend": "rl2_gloo"}' --no-enable-chunked-prefill --max-num-batched-tokens 8192`). Only the standard library is used here: the trainer needs no vLLM."""

    def __init__(self, url: str, tokenizer=None, *, max_model_len: int = 2048,
                 dtype: str = "float32", bucket_mb: float = 512, timeout_s: float = 600.0,
                 connect_timeout_s: float = 30.0, transfer_host: str | None = None,
                 transfer_backend: str = BACKEND, lora_rank: int = 0, lora_dir: str | None = None, **_):
        """`connect_timeout_s`: how long to wait for the server's /health at start.
        `transfer_host`: this machine's address as the server sees it (weight-sync group);
        None: the address on this machine's route to `url`.
        `transfer_backend`: the server's `--weight-transfer-config` backend: `rl2_gloo` (CPU
        tensors; the server needs RL2's plugin) or vLLM's `nccl` (CUDA trainer and server;
        the trainer then needs vLLM installed for its rendezvous helper; NOT RUN).
        `lora_rank` > 0: LoRA adapter-only sync (`update_adapter`) through the server's
        /v1/load_lora_adapter (started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 --enable-lora
        --max-lora-rank R`); the adapters are written under `lora_dir`, which the server must
        be able to read at the same path (another host: a shared filesystem)."""
        if transfer_backend not in (BACKEND, "nccl"):
            raise ValueError(f"transfer_backend={transfer_backend!r}: use {BACKEND} or nccl")
        self._setup(tokenizer, max_model_len, dtype, bucket_mb, timeout_s)
        self.url = url.rstrip("/")
        self.transfer_host = transfer_host  # None: found at the first sync (the server is up)
        self.transfer_backend = transfer_backend
        if lora_rank:
            self.adapters = AdapterVersions(lora_dir)
        # blocking HTTP calls run here: the default executor has only cores + 4 threads
        self._pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="rl2-vllm-http")
        wait_until_up(self.url, "vLLM server", connect_timeout_s, max(1.0, min(5.0, connect_timeout_s)))
        self.n_workers = int(self._http("GET", "/get_world_size")["world_size"])  # all DP ranks
        self._refuse_split_dp()

    def _refuse_split_dp(self) -> None:
        """With DP > 1 behind this URL, refuse vLLM's external/hybrid LB modes at start (their
        weight group could never fill: vllm_transfer.SPLIT_DP). Only then is /server_info read
        (a dev route, like the RL ones; its first call collects the server's environment)."""
        if int(self._http("GET", "/get_world_size?include_dp=false")["world_size"]) == self.n_workers:
            return
        pc = self._http("GET", "/server_info?config_format=json")["vllm_config"]["parallel_config"]
        mode = split_dp_mode(pc)
        if mode is not None:
            raise RuntimeError(f"vLLM server {self.url}: " + SPLIT_DP.format(mode=mode))

    def _http(self, method: str, path: str, body=None, timeout: float | None = None, text: bool = False):
        return http_call(self.url, method, path, body, timeout or self.timeout_s, text, "vLLM server")

    async def _generate_one(self, prompt: list[int], sampling: dict) -> GenerationOutput:
        body = {"token_ids": prompt, "sampling_params": sampling, "output_mode": "tokens"}
        if self._lora is not None:
            body["model"] = self._lora[0]  # the served LoRA adapter's name

        def send():  # the salt (_VLLMBase._setup) as the request leaves: a call queued for a
            # thread across a weight sync runs on the new weights
            return self._http("POST", "/inference/v1/generate", {**body, "cache_salt": self.cache_salt})

        out = await asyncio.get_running_loop().run_in_executor(self._pool, send)
        c = out["choices"][0]
        ids = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content") or []
        return GenerationOutput(ids, [float(e["logprob"]) for e in content], _finish(c.get("finish_reason")))

    async def _control(self, method: str, payload=None):
        body = {"init_weight_transfer_engine": {"init_info": payload},
                "update_weights": {"update_info": payload},
                "finish_weight_update": {"weight_version": payload}}.get(method)
        return await asyncio.to_thread(self._http, "POST", "/" + method, body)

    async def _load_adapter(self, lora: tuple, previous: tuple | None, version: str) -> None:
        def call(path, body):
            return self._http("POST", path, body, text=True)

        await asyncio.to_thread(call, "/v1/load_lora_adapter", {"lora_name": lora[0], "lora_path": lora[2]})
        self._lora = lora
        if previous is not None:
            await asyncio.to_thread(call, "/v1/unload_lora_adapter", {"lora_name": previous[0]})
        await asyncio.to_thread(self._http, "POST", "/update_weight_version", {"new_version": version})

    def unload_adapter(self) -> None:
        """Unload the served adapter (the server may outlive this run; best effort)."""
        if self._lora is not None:
            try:
                self._http("POST", "/v1/unload_lora_adapter", {"lora_name": self._lora[0]}, timeout=10, text=True)
            except RuntimeError as e:
                logger.warning("%s", e)
            self._lora = None

    # what RemotePool calls besides start_update/push/finish_update (as on SGLangServerEngine)
    def health(self, timeout: float) -> None:
        self._http("GET", "/health", timeout=timeout)

    def pause(self, timeout: float) -> None:
        self._http("POST", "/pause?mode=abort", timeout=timeout)

    def resume(self) -> None:
        self._http("POST", "/resume")

    load_adapter = _load_adapter

    def forget(self) -> None:
        """The server is gone: no goodbye calls at shutdown."""
        try:
            self._drop_sender()
        finally:
            self._lora = None

    def _new_sender(self) -> GlooSender | NcclSender:
        cls = NcclSender if self.transfer_backend == "nccl" else GlooSender
        return cls(n_workers=self.n_workers, timeout_s=self.timeout_s,
                   host=self.transfer_host or address_towards(self.url))

    def weight_version(self) -> str:
        return self._http("GET", "/weight_info")["weight_version"]

    def release_memory(self, tags: list[str] | None = None) -> None:
        self._released = True  # the server keeps its memory (it may serve others)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._released = False

    def shutdown(self) -> None:
        if self._sender is not None:
            try:
                self._http("POST", "/shutdown_weight_transfer_engine", timeout=10)
            except RuntimeError as e:
                logger.warning("%s", e)
        self._drop_sender()
        self.unload_adapter()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.adapters is not None:
            self.adapters.close()
        self._close_loop()
