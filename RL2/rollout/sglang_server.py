"""`SGLangServerEngine`: a running SGLang HTTP server (`python -m sglang.launch_server`, 0.5.23)
driven over its native routes with the standard library only (the trainer needs no sglang).
`RemotePool` (RL2/rollout/remote.py) pools it beside `VLLMServerEngine` through the same calls.

Routes (sglang 0.5.23, python/sglang/srt/entrypoints/http_server.py, "hs:<line>"):
- generate: POST /generate {input_ids, sampling_params, return_logprob, lora_path} (hs:928);
  token ids and log-probs from meta_info.output_token_logprobs [logprob, token_id, text],
  finish_reason {"type": stop|length|abort}. Seeds go in as `sampling_params.sampling_seed`,
  which SGLang only honours when started with --enable-deterministic-inference
  (srt/sampling/sampling_batch_info.py:128-170); without it a warning says runs will not repeat.
- weights: one process group per server, SGLang's `update_weights_from_distributed` path:
  POST /init_weights_update_group (hs:1404) -> the server joins as ranks 1..tp of a group this
  trainer leads (rank 0); per sync POST /begin_weight_update (hs:1458), per bucket
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
  load_format="flattened_bucket"} (hs:1488) while the bucket is broadcast as one flat byte
  tensor, the last bucket with flush_cache, then POST /end_weight_update (hs:1473) and
  POST /update_weight_version (hs:1527). Read back from GET /model_info (hs:812).
- in-flight updates: POST /pause_generation {"mode": "abort"} (hs:1831: running requests return
  "abort" with their tokens so far, new ones wait), POST /continue_generation (hs:1844).
- LoRA: POST /load_lora_adapter {lora_name, lora_path}, /unload_lora_adapter (hs:1652, 1676).
- health: GET /health runs a one-token generation (hs:721); while paused it waits for the pause
  and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT, so a paused server is probed on /model_info.
Backends: gloo on CPU; on GPU SGLang receives into CUDA tensors over NCCL, so the trainer's side
is NCCL with CUDA tensors (NOT RUN: no GPU here).
"""
import asyncio
import concurrent.futures
import datetime
import logging
import uuid

import torch
import torch.distributed as dist

from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams, check_prompt, close_loop, in_daemon_thread
from RL2.rollout.server_protocol import http_call, wait_until_up
from RL2.rollout.weight_layout import make_buckets
from RL2.rollout.vllm_transfer import cast_copies, gloo_group
from RL2.utils.seeding import derive_seed
from RL2.workers.lora import AdapterVersions

logger = logging.getLogger(__name__)


class UpdateGroup:
    """Rank 0 of an SGLang weight-update group. The server joins with `init_custom_process_group`
    (srt/utils/common.py:2859): a tcp:// rendezvous (the trainer serves the TCPStore), then
    PrefixStore(group_name) and torch's `_new_process_group_helper`, which prefixes
    "<group_name>/" and "<device>/" again: the same key space is built here explicitly."""

    def __init__(self, host: str, n_workers: int, backend: str, timeout_s: float):
        self.host, self.world_size, self.backend = host, 1 + n_workers, backend
        self.name = f"rl2-{uuid.uuid4().hex[:12]}"  # a re-used name is refused by torch
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, self.world_size, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)  # port 0: the OS picks a free one
        self.group = None

    def request(self) -> dict:
        """The body of /init_weights_update_group (io_struct.py InitWeightsUpdateGroupReqInput)."""
        return {"master_address": self.host, "master_port": self.store.port, "rank_offset": 1,
                "world_size": self.world_size, "group_name": self.name, "backend": self.backend}

    def connect(self) -> None:
        """Blocks until every server rank joined (run while the init call is in flight)."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        store = dist.PrefixStore(f"{device}/", dist.PrefixStore(
            f"{self.name}/", dist.PrefixStore(self.name, self.store)))
        if self.backend == "nccl":  # NOT RUN
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(store, 0, self.world_size, options)
        else:
            self.group = gloo_group(store, 0, self.world_size, self.timeout, self.host)  # host: ours

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One broadcast of the bucket as SGLang's FlattenedTensorBucket lays it out: each
        tensor's bytes back to back (srt/weight_sync/tensor_bucket.py `empty`)."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        flat = torch.cat([t.detach().to(device).contiguous().view(-1).view(torch.uint8) for _, t in bucket])
        self.group.broadcast(flat, 0).wait()
        if device == "cuda":  # NOT RUN
            torch.cuda.current_stream().synchronize()

    def abort(self) -> None:
        """NCCL (NOT RUN): abort the communicator, which ends a broadcast stuck on a peer that
        refused or died (a server that answers a push without joining it: no session, an
        unknown group after a restart); gloo's broadcast ends at its timeout by itself."""
        if self.backend == "nccl" and self.group is not None:
            self.group.abort()  # ProcessGroupNCCL.abort (torch 2.13)


def context_limit(info: dict, max_model_len: int) -> int:
    """The tokens a request may hold on this server (prompt + new tokens), from its
    /server_info. `context_length` is only the launch flag (None unless given); what the
    server enforces is `max_req_input_len`, min(context - 1, KV pool - 1) - 5 (managers/
    tp_worker.py): its scheduler aborts prompts that long or longer (scheduler.py
    validate_input_length), and a request within it also stays within the context
    (tokenizer_manager.py). Capped there, RL2 refuses or shortens a request itself."""
    limits = [int(max_model_len)] + [int(info[k]) for k in ("context_length", "max_req_input_len") if info.get(k)]
    return min(limits)


def update_request(bucket, group_name: str, last: bool) -> dict:
    """The body of /update_weights_from_distributed for one bucket (io_struct.py
    UpdateWeightsFromDistributedReqInput); the radix cache is flushed after the last one."""
    return {"names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": bool(last)}


def with_last(items):
    """(item, is_last) pairs of an iterator, looking one item ahead."""
    items = iter(items)
    current = next(items, None)
    while current is not None:
        following = next(items, None)
        yield current, following is None
        current = following


def _finish(meta: dict) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


class SGLangServerEngine(Engine):
    def __init__(self, url: str, tokenizer=None, *, max_model_len: int = 2048,
                 dtype: str = "float32", bucket_mb: float = 512, timeout_s: float = 600.0,
                 connect_timeout_s: float = 30.0, transfer_host: str = "127.0.0.1",
                 transfer_backend: str = "gloo", lora_rank: int = 0, lora_targets=(),
                 lora_dir: str | None = None, **_):
        """`transfer_backend`: gloo (CPU tensors) or nccl (CUDA; NOT RUN). `lora_rank` > 0: LoRA
        adapter-only sync (the server needs --enable-lora --max-lora-rank R
        --lora-target-modules ...); adapters are written under `lora_dir`, a path the server reads."""
        self.url, self.transfer_host, self.timeout_s = url.rstrip("/"), transfer_host, timeout_s
        self.backend = "nccl" if transfer_backend == "nccl" else "gloo"
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes, self.version = int(bucket_mb * 2**20), 0
        self.group: UpdateGroup | None = None
        self._retired = []  # dropped groups are kept: a gloo group's destructor waits for its work
        self.paused = False
        self._lora = None  # (name, id, path) of the adapter every request names; None = the base
        # /generate calls wait on their own threads; the weight and control calls get others: a
        # paused server holds new generates until /continue_generation (tm:938), so with more
        # requests than generate threads, control calls queued behind them would never run
        self._pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="rl2-sglang-http")
        self._control_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="rl2-sglang-ctl")
        self.loop = asyncio.new_event_loop()
        self._wait_until_up(connect_timeout_s)
        info = self._http("GET", "/server_info")
        self.info = info
        self.n_workers = int(info.get("tp_size") or 1)
        self.max_model_len = context_limit(info, max_model_len)
        problems = server_problems(info, lora_rank, lora_targets)
        if problems:
            raise RuntimeError(f"SGLang server {self.url} cannot serve this run: " + "; ".join(problems))
        if not info.get("enable_deterministic_inference"):
            logger.warning("SGLang server %s runs without --enable-deterministic-inference: it ignores "
                           "sampling_seed, so rollouts will not repeat with the same seed", self.url)
        self.adapters = AdapterVersions(lora_dir) if lora_rank else None

    def _wait_until_up(self, connect_timeout_s: float) -> None:
        # 503 while the server is starting (hs:735)
        wait_until_up(self.url, "SGLang server", connect_timeout_s, max(2.0, min(30.0, connect_timeout_s)))

    def _http(self, method: str, path: str, body=None, timeout: float | None = None):
        return http_call(self.url, method, path, body, timeout or self.timeout_s, who="SGLang server")

    async def _post(self, path: str, body=None, pool=None):
        return await asyncio.get_running_loop().run_in_executor(
            pool or self._control_pool, self._http, "POST", path, body)

    # ------------------------------------------------------------------ generation
    def _sampling(self, prompt_len: int, params: SamplingParams, seed: int | None) -> dict:
        # only SGLang's SamplingParams keys: /generate refuses unknown ones (api/v1/api_types.py:178)
        out = {"temperature": params.temperature, "top_p": params.top_p,
               "top_k": params.top_k if params.top_k > 0 else -1,
               "max_new_tokens": min(params.max_new_tokens, self.max_model_len - prompt_len),
               "skip_special_tokens": False}
        if params.stop:
            out["stop"] = list(params.stop)
        if params.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        if seed is not None and params.temperature >= 1e-6:
            out["sampling_seed"] = seed
        return out

    async def _generate_one(self, prompt: list[int], sampling: dict) -> GenerationOutput:
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        if self._lora is not None:
            body["lora_path"] = self._lora[0]  # the loaded adapter's name (lora_registry.py)
        out = await self._post("/generate", body, self._pool)
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        return GenerationOutput([int(e[1]) for e in entries], [float(e[0]) for e in entries], _finish(meta))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        params.validate()
        prompt = check_prompt(prompt_ids, self.max_model_len)
        seeds = [None if params.seed is None else derive_seed(params.seed, i) for i in range(params.n)]
        return list(await asyncio.gather(*[
            self._generate_one(prompt, self._sampling(len(prompt), params, s)) for s in seeds]))

    # ------------------------------------------------------------------ the pool's calls
    def health(self, timeout: float) -> None:
        self._http("GET", "/model_info" if self.paused else "/health", timeout=timeout)

    def pause(self, timeout: float) -> None:
        self._http("POST", "/pause_generation", {"mode": "abort"}, timeout=timeout)
        self.paused = True

    def resume(self) -> None:
        self._http("POST", "/continue_generation", {})
        self.paused = False

    async def _connect(self) -> None:
        group = UpdateGroup(self.transfer_host, self.n_workers, self.backend, self.timeout_s)
        await asyncio.gather(self._post("/init_weights_update_group", group.request()),
                             in_daemon_thread(group.connect))
        self.group = group

    async def start_update(self) -> None:
        if self.group is None:
            await self._connect()
        await self._post("/begin_weight_update", {})

    async def push(self, bucket, last: bool) -> None:
        # the server's receive (inside its HTTP call) and our broadcast meet in one collective
        await asyncio.gather(self._post("/update_weights_from_distributed",
                                        update_request(bucket, self.group.name, last)),
                             in_daemon_thread(self.group.send, bucket))

    async def finish_update(self, version: str) -> None:
        await self._post("/end_weight_update", {})
        await self._set_version(version)

    async def _set_version(self, version: str) -> None:
        # abort_all_requests defaults to True (io_struct.py UpdateWeightVersionReqInput)
        await self._post("/update_weight_version", {"new_version": version, "abort_all_requests": False})

    async def load_adapter(self, lora: tuple, previous: tuple | None, version: str) -> None:
        await self._post("/load_lora_adapter", {"lora_name": lora[0], "lora_path": lora[2]})
        self._lora = lora  # requests name it from now on, even if the unload below fails
        if previous is not None:
            await self._post("/unload_lora_adapter", {"lora_name": previous[0]})
        await self._set_version(version)

    def weight_version(self) -> str:
        return self._http("GET", "/model_info")["weight_version"]

    def _close_loop(self) -> None:
        close_loop(self.loop)

    def forget(self) -> None:
        """The server is gone: its group aborted (NCCL), no goodbye calls at shutdown."""
        group, self.group, self._lora = self.group, None, None
        if group is not None:
            self._retired.append(group)
            group.abort()

    # ------------------------------------------------------------------ Engine (standalone)
    def _run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, self.timeout_s))

    async def _update(self, named_tensors, version: str) -> None:
        await self.start_update()
        for bucket, last in with_last(make_buckets(cast_copies(named_tensors, self.dtype), self.bucket_bytes)):
            await self.push(bucket, last)
        await self.finish_update(version)

    def update_weights(self, named_tensors) -> None:
        """Full tensors (HF names) in dtype buckets of <= bucket_mb; the server's weight version
        becomes str(number of syncs)."""
        self.version += 1
        self._run(self._update(named_tensors, str(self.version)))

    def update_adapter(self, named_tensors, config: dict) -> None:
        """LoRA adapter-only sync: written under lora_dir, loaded under a new name per sync
        (SGLang refuses a loaded name: lora_manager.py), the previous one unloaded."""
        if self.adapters is None:
            raise RuntimeError("this SGLang client was built without LoRA (lora_rank=0)")
        self.version += 1
        version = str(self.version)
        self.adapters.sync(named_tensors, config, lambda new, old: self._run(self.load_adapter(new, old, version)))

    def release_memory(self, tags=None) -> None:
        pass  # the server keeps its memory (it may serve others)

    def resume_memory(self, tags=None) -> None:
        pass

    def shutdown(self) -> None:
        for path, body, done in [
                ("/destroy_weights_update_group", {"group_name": getattr(self.group, "name", "")}, self.group is None),
                ("/unload_lora_adapter", {"lora_name": (self._lora or ("",))[0]}, self._lora is None)]:
            if not done:
                try:
                    self._http("POST", path, body, timeout=10)
                except RuntimeError as e:
                    logger.warning("%s", e)
        if self.group is not None:
            self._retired.append(self.group)
        self.group, self._lora = None, None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        if self.adapters is not None:
            self.adapters.close()
        close_loop(self.loop)


def server_problems(info: dict, lora_rank: int = 0, lora_targets=()) -> list[str]:
    """What an SGLang server (its /server_info) lacks for this run, each with the flag to set."""
    problems = []
    if int(info.get("dp_size") or 1) != 1:  # tokenizer_control_mixin.py:451 asserts dp_size == 1
        problems.append(f"dp_size={info['dp_size']}: SGLang updates weights from distributed only "
                        "with --dp-size 1 (start one server per replica)")
    if int(info.get("pp_size") or 1) != 1:  # the group rank is rank_offset + tp_rank only
        problems.append(f"pp_size={info['pp_size']}: weight-update groups rank tp ranks only; use --pp-size 1")
    if lora_rank:
        if not info.get("enable_lora"):
            problems.append("LoRA adapter sync (actor.rollout.lora_sync=adapter) needs --enable-lora")
        elif int(info.get("max_lora_rank") or 0) < lora_rank:
            problems.append(f"--max-lora-rank {info.get('max_lora_rank')} < the actor's LoRA rank {lora_rank}")
        missing = set(lora_targets) - set(info.get("lora_target_modules") or ())
        if info.get("enable_lora") and missing and "all" not in (info.get("lora_target_modules") or ()):
            problems.append(f"--lora-target-modules lacks {sorted(missing)} (actor.lora.target_modules)")
    return problems
