"""Disaggregated rollout: the trainer as a client of engine servers (`actor.rollout.placement=
disaggregated`, `actor.rollout.servers=[host:port, ...]`).

`RemotePool` is an `Engine` over N servers, each driven by a client of its protocol
(`actor.rollout.server_kind`; auto: a server answering GET /model_info is SGLang's, else vLLM's):
- vLLM's (`VLLMServerEngine`, vllm_server.py): `vllm serve` or `python -m RL2.rollout.server`.
- SGLang's (`SGLangServerEngine`, sglang_server.py): `python -m sglang.launch_server`, native
  routes. Refused at start-up when it cannot serve the run (--dp-size > 1, LoRA sync without
  --enable-lora / a large enough --max-lora-rank / the targets).
Both through one set of calls (generate, health, pause, resume, start_update, push, ...):
- generate: each call goes to the live server with the fewest calls in flight (ties: the first
  listed). The per-request seed travels with the request, so a trajectory does not depend on
  which server ran it (SGLang honours it only with --enable-deterministic-inference).
- in-flight updates (asynchronous rollout, `inflight_update=pause|abort`): `abort_requests`
  (called on the pool's loop at a step boundary) pauses every server aborting its running
  requests (`/pause?mode=abort`; SGLang: `/pause_generation` mode abort): they come back with
  "abort" and their tokens so far, new ones wait on the server; the weight push that follows
  runs on a helper thread's loop (this one is inside the callback) and ends with a resume.
- update_adapter (LoRA, `actor.rollout.lora_sync=adapter`): the adapter is written once under
  `actor.rollout.lora_dir` and every server loads it from there (its LoRA routes).
- update_weights: one transfer group per server (trainer rank 0 + that server's workers); one
  dtype per bucket (SGLang's flat buckets need aligned offsets), sent to every live server at
  once; start -> push per bucket -> finish with the version label (the trainer's step).
- faults: a server whose call fails and whose health probe then fails, or that misses a health
  probe while requests are in flight (probed every `health_timeout_s`), or fails in a weight
  sync, is dropped for good (its weights may be stale): its requests are retried on the others,
  a warning is logged and the loss counted (`pool_metrics`). With none left, the run stops with
  an error naming every server and its last error. Calls after `shutdown` are dropped.
"""
import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request

import torch

from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams, on_this_cuda_device
from RL2.rollout.weight_layout import make_buckets
from RL2.rollout.sglang_server import SGLangServerEngine, server_problems, with_last
from RL2.rollout.vllm_server import VLLMServerEngine
from RL2.workers.lora import AdapterVersions
from RL2.rollout.vllm_transfer import BACKEND, address_towards, cast_copies

logger = logging.getLogger(__name__)


class AllServersLost(RuntimeError):
    pass


class _ServerLost(Exception):
    pass


class _Transient(Exception):
    """A connection failed but the server answers /health: try the call again."""


MAX_TRANSIENT = 3  # connection failures on a healthy server tolerated per generate call


def normalize(address: str) -> str:
    """'host:port' or 'http://host:port' -> 'http://host:port'."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


SERVER_KINDS = ("auto", "vllm", "sglang")


def probe_kind(url: str, timeout_s: float) -> str:
    """sglang if the server answers GET /model_info with a weight_version (a route only SGLang
    has: vLLM 0.32 and RL2's server answer 404), else vllm; waits up to timeout_s for it to listen."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=max(1.0, min(5.0, timeout_s))) as r:
                body = json.loads(r.read() or b"{}")
            return "sglang" if isinstance(body, dict) and "weight_version" in body else "vllm"
        except urllib.error.HTTPError:
            return "vllm"  # it listens, but has no such route
        except (urllib.error.URLError, OSError, ValueError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout server {url} not reachable within {timeout_s:.0f} s: {e}") from None
            time.sleep(1)


class _Server:
    def __init__(self, index: int, client: VLLMServerEngine | SGLangServerEngine):
        self.index, self.client, self.url = index, client, client.url
        self.in_flight, self.served = 0, 0  # generate calls in flight / answered (dispatch spreads them)
        self.error: str | None = None  # set when the server is dropped


class RemotePool(Engine):
    def __init__(self, servers: list[str], tokenizer=None, *, max_model_len: int = 2048,
                 dtype: str = "float32", bucket_mb: float = 512, timeout_s: float = 600.0,
                 health_timeout_s: float = 30.0, connect_timeout_s: float | None = None,
                 transfer_host: str | None = None, transfer_backend: str = BACKEND,
                 lora_dir: str | None = None, server_kind: str = "auto", lora_rank: int = 0,
                 lora_targets=()):
        """`timeout_s` bounds every generate and weight-transfer call; `health_timeout_s` is how
        long a server may leave /health unanswered; `connect_timeout_s` (default timeout_s) how
        long to wait for every server to come up at start. `lora_dir`: where LoRA adapter-only
        syncs are written for the servers to load (a path they read; None: a temporary one).
        `server_kind`: vllm | sglang | auto (probed per server, `probe_kind`). `lora_rank`,
        `lora_targets`: the adapters synced (SGLang servers are checked for them at start)."""
        if not servers:
            raise ValueError("actor.rollout.servers is empty: disaggregated placement needs the "
                             "host:port of at least one engine server")
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s, self.health_timeout_s = timeout_s, health_timeout_s
        self.loop = asyncio.new_event_loop()
        self.servers: list[_Server] = []
        self.adapters, self._monitor = None, None  # adapters: made on the first adapter sync
        for i, address in enumerate(servers):
            url = normalize(address)
            kind = server_kind if server_kind != "auto" else probe_kind(url, connect_timeout_s or timeout_s)
            cls = SGLangServerEngine if kind == "sglang" else VLLMServerEngine
            client = cls(url, tokenizer, max_model_len=max_model_len, dtype=dtype, bucket_mb=bucket_mb,
                         timeout_s=timeout_s, connect_timeout_s=connect_timeout_s or timeout_s,
                         transfer_host=transfer_host or address_towards(url), transfer_backend=transfer_backend)
            client._close_loop()  # the pool's loop runs everything
            self.servers.append(_Server(i, client))
            problems = server_problems(client.info, lora_rank, lora_targets) if kind == "sglang" else []
            if problems:  # (the pool writes adapters itself: the clients were built without LoRA)
                self.shutdown()
                raise RuntimeError(f"SGLang server {url} cannot serve this run: " + "; ".join(problems))
            logger.info("rollout server %s: %s protocol", url, kind)
        self.next_version: str | None = None  # label of the next sync (the trainer's step)
        self.lora_dir = lora_dir
        self._syncs = 0
        self.counts = {"servers_lost": 0, "requests_retried": 0, "inflight_updates": 0}
        self._paused = False  # servers paused by abort_requests, resumed after the weight push
        self.closed = False  # set by shutdown: later pushes (queued on a rollout loop) are dropped

    # ------------------------------------------------------------------ bookkeeping
    def live(self) -> list[_Server]:
        return [s for s in self.servers if s.error is None]

    def pool_metrics(self) -> dict:
        """Live/lost servers, retries, and the fewest/most calls any live server has answered."""
        served = [s.served for s in self.live()] or [0]
        return {"servers_live": float(len(self.live())), **{k: float(v) for k, v in self.counts.items()},
                "server_requests_min": float(min(served)), "server_requests_max": float(max(served))}

    def _drop(self, server: _Server, reason: str) -> None:
        if server.error is not None:
            return
        server.error = reason
        self.counts["servers_lost"] += 1
        logger.warning("rollout server %s dropped (%s); %d server(s) left", server.url, reason,
                       len(self.live()))
        # its weight-transfer group goes now, not at shutdown: an NCCL broadcast to a dead peer
        # never ends on its own, and until its communicator is aborted it holds the stream the
        # pushes to the other servers queue on (vLLM 0.32 nccl_engine.py: the group "is unusable
        # either way and the caller has to tear it down"); no goodbye calls at shutdown either
        try:
            server.client.forget()
        except Exception as e:  # noqa: BLE001 - the server is dropped either way
            logger.warning("rollout server %s: releasing its transfer group failed: %s", server.url, e)

    def _check_any(self) -> list[_Server]:
        live = self.live()
        if not live:
            lost = "; ".join(f"{s.url}: {s.error}" for s in self.servers)
            raise AllServersLost(f"every rollout server is gone (actor.rollout.servers): {lost}")
        return live

    def _healthy(self, server: _Server) -> str | None:
        """None if /health answers within health_timeout_s, else why not (blocking)."""
        try:
            server.client.health(self.health_timeout_s)
            return None
        except RuntimeError as e:
            return str(e)

    async def _watch(self) -> None:
        """While requests are in flight, probe each busy server every health_timeout_s: a hung
        server (stopped, partitioned) is dropped within about two periods."""
        while True:
            await asyncio.sleep(self.health_timeout_s)
            busy = [s for s in self.live() if s.in_flight]
            problems = await asyncio.gather(*[asyncio.to_thread(self._healthy, s) for s in busy])
            for s, problem in zip(busy, problems):
                if problem:
                    self._drop(s, f"health probe failed: {problem}")

    # ------------------------------------------------------------------ generation
    async def _call(self, server: _Server, coro):
        """Run `coro` against `server`; _ServerLost if the server is (or turns out) dead."""
        task = asyncio.ensure_future(coro)
        while not task.done():  # polled: no loop-bound primitive shared between calls
            await asyncio.wait({task}, timeout=0.2)
            if server.error is not None and not task.done():
                task.cancel()
                raise _ServerLost(server.error)
        try:
            return task.result()
        except RuntimeError as e:  # refused, reset, timed out or an HTTP error: alive?
            problem = await asyncio.to_thread(self._healthy, server)
            if problem is None and ": HTTP " in str(e):
                raise  # the server is fine and answered: the request itself is bad
            if problem is None and "timed out" not in str(e):
                raise _Transient(str(e)) from None  # e.g. a reset connection
            self._drop(server, f"{e}" if problem is None else f"{e}; then {problem}")
            raise _ServerLost(server.error) from None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        if self._monitor is None or self._monitor.done() or self._monitor.get_loop() is not asyncio.get_running_loop():
            self._monitor = asyncio.ensure_future(self._watch())
        transient = 0
        while True:
            server = min(self._check_any(), key=lambda s: (s.in_flight, s.index))
            server.in_flight += 1
            try:
                out = await self._call(server, server.client.generate(prompt_ids, params))
                server.served += 1
                return out
            except _ServerLost:
                self.counts["requests_retried"] += 1
            except _Transient as e:
                transient += 1
                if transient > MAX_TRANSIENT:
                    raise RuntimeError(f"{e} ({transient} times; the server answers /health)") from None
                logger.warning("retrying a request after: %s", e)
                self.counts["requests_retried"] += 1
            finally:
                server.in_flight -= 1

    # ------------------------------------------------------------------ weight sync
    async def _guarded(self, server: _Server, coro) -> None:
        """A weight-transfer step: any failure drops the server (its weights are now unknown)."""
        try:
            await coro
        except Exception as e:  # noqa: BLE001 - reported through _drop and _check_any
            self._drop(server, f"weight sync failed: {e}")

    async def _each(self, fn) -> None:
        await asyncio.gather(*[self._guarded(s, fn(s)) for s in self._check_any()])
        self._check_any()

    async def _update(self, named_tensors) -> None:
        await self._each(lambda s: s.client.start_update())  # joins the transfer group first
        # one dtype per bucket: SGLang's flat buckets need aligned offsets (tensor_bucket.py)
        for bucket, last in with_last(make_buckets(cast_copies(named_tensors, self.dtype), self.bucket_bytes)):
            await self._each(lambda s: s.client.push(bucket, last))
        self._syncs += 1
        version = self.next_version if self.next_version is not None else str(self._syncs)
        await self._each(lambda s: s.client.finish_update(version))
        self.next_version = None

    def _run(self, coro, timeout: float):
        """Run a weight-sync coroutine to completion: on the pool's loop, or, when called from
        inside a running loop (an in-flight update at a rollout step boundary), on a fresh loop
        in a helper thread while that one waits. Then resume servers paused by `abort_requests`."""
        if self.closed:
            return coro.close()

        async def then_resume():
            try:
                return await asyncio.wait_for(coro, timeout)
            finally:
                if self._paused:
                    self._paused = False
                    await self._each(lambda s: asyncio.to_thread(s.client.resume))

        try:  # the rollout loop (the pool's, or Rollout's own) is running in this thread
            inside = asyncio.get_running_loop() is not None
        except RuntimeError:
            inside = False
        if not inside:
            return self.loop.run_until_complete(then_resume())
        set_device = on_this_cuda_device()  # a new thread starts on GPU 0, not this rank's

        def run():
            set_device()
            return asyncio.run(then_resume())

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl2-pool-sync") as helper:
            return helper.submit(run).result()

    def abort_requests(self) -> None:
        """New weights mid-rollout: pause every live server, aborting its running requests
        (they return "abort" with their tokens so far); the next weight sync resumes them."""
        if self.closed:
            return
        for s in self.live():
            try:
                s.client.pause(self.health_timeout_s)
            except RuntimeError as e:
                self._drop(s, f"pause failed: {e}")
        self._check_any()
        self._paused = True
        self.counts["inflight_updates"] += 1

    def update_weights(self, named_tensors) -> None:
        """Push full tensors (HF names) to every live server; their weight_version becomes
        `next_version` (set by the caller: the trainer's step), else the number of syncs."""
        start = time.monotonic()
        self._run(self._update(named_tensors), self.timeout_s * 4)
        logger.debug("weights pushed to %d server(s) in %.2f s", len(self.live()), time.monotonic() - start)

    def update_adapter(self, named_tensors, config: dict) -> None:
        """LoRA adapter-only sync: the adapter is written once and every live server loads it
        (its client's load_adapter); versions as in update_weights."""
        if self.adapters is None:
            self.adapters = AdapterVersions(self.lora_dir)
        self._syncs += 1
        version = self.next_version if self.next_version is not None else str(self._syncs)

        def load(new, previous):
            self._run(self._each(lambda s: s.client.load_adapter(new, previous, version)), self.timeout_s)

        self.adapters.sync(named_tensors, config, load)
        self.next_version = None

    def weight_versions(self) -> dict[str, str]:
        return {s.url: s.client.weight_version() for s in self.live()}

    def release_memory(self, tags=None) -> None:
        pass  # the servers keep their memory (the trainer runs elsewhere)

    def resume_memory(self, tags=None) -> None:
        pass

    def shutdown(self) -> None:
        self.closed = True
        for s in self.servers:
            s.client.shutdown()  # a dropped server's client was told to forget it: no goodbyes
        if self._monitor is not None:
            self._monitor.cancel()
            loop = self._monitor.get_loop()
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(asyncio.wait({self._monitor}))
        if not self.loop.is_closed():
            self.loop.close()
        if self.adapters is not None:
            self.adapters.close()


def transfer_backend(r, device: str) -> str:
    """`actor.rollout.transfer_backend` (r) resolved for a trainer on `device` (cpu | cuda)."""
    backend = r.get("transfer_backend", "auto")
    return backend if backend != "auto" else ("nccl" if device == "cuda" else BACKEND)


def make_pool(cfg, tokenizer, device: str, lora=None) -> RemotePool:
    """The pool of `actor.rollout` (cfg): servers and their protocol, timeouts, bucket size,
    wire dtype and backend; `lora`: the actor's lora config when adapters are synced."""
    return RemotePool(list(cfg.servers), tokenizer, max_model_len=cfg.max_model_len or cfg.max_length,
                      dtype=cfg.server_dtype, bucket_mb=cfg.bucket_mb, timeout_s=cfg.server_timeout,
                      health_timeout_s=cfg.health_timeout, transfer_host=cfg.transfer_host,
                      transfer_backend=transfer_backend(cfg, device), lora_dir=cfg.get("lora_dir"),
                      server_kind=cfg.get("server_kind", "auto"), lora_rank=lora.rank if lora else 0,
                      lora_targets=list(lora.target_modules) if lora else ())


def check_placement(r, device: str = "cpu") -> list[str]:
    """Config problems of the placement keys of `actor.rollout` (r), each naming the key, for a
    trainer on `device` (trainer.device: cpu | cuda | auto)."""
    if r.placement not in ("colocated", "disaggregated"):
        return [f"actor.rollout.placement={r.placement!r}: use colocated or disaggregated"]
    if r.placement == "colocated":
        if device == "cuda" and r.engine == "vllm" and not (r.get("vllm") or {}).get("server_url"):
            # vLLM's weight transfer to an engine on the trainer's own GPU would be NCCL between
            # two ranks on one GPU, which NCCL refuses at init (ncclInvalidUsage); the CUDA-IPC
            # path it needs instead is not written
            return ["actor.rollout.engine=vllm colocated on CUDA is not supported (its weight sync "
                    "would be NCCL between two ranks of one GPU): use actor.rollout.placement="
                    "disaggregated with vLLM servers on other GPUs, or engine=sglang / torch"]
        return []
    problems = []
    if not r.servers:
        problems.append("actor.rollout.placement=disaggregated needs actor.rollout.servers=[host:port,...]")
    for a in r.servers:
        parts = urllib.parse.urlsplit(normalize(str(a)))
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            problems.append(f"actor.rollout.servers: {a!r} is not host:port")
    for key in ("server_timeout", "health_timeout"):
        if not r[key] > 0:
            problems.append(f"actor.rollout.{key}={r[key]} must be > 0")
    backend, kind = r.get("transfer_backend", "auto"), r.get("server_kind", "auto")
    if backend not in ("auto", BACKEND, "nccl"):
        problems.append(f"actor.rollout.transfer_backend={backend!r}: use auto, {BACKEND} or nccl")
    elif backend == "nccl" and device == "cpu":
        problems.append("actor.rollout.transfer_backend=nccl needs a CUDA trainer (trainer.device=cpu): "
                        f"use {BACKEND} (the servers' --weight-transfer-config backend)")
    elif (transfer_backend(r, device) == "nccl" and kind != "sglang"
          and importlib.util.find_spec("vllm") is None):
        problems.append(f"actor.rollout.transfer_backend={backend} means vLLM's nccl on CUDA, whose "
                        "rendezvous needs vLLM on the trainer: pip install -e '.[vllm]', or set "
                        f"actor.rollout.transfer_backend={BACKEND} (SGLang servers: "
                        "actor.rollout.server_kind=sglang needs no vLLM)")
    if kind not in SERVER_KINDS:
        problems.append(f"actor.rollout.server_kind={kind!r}: use one of {SERVER_KINDS}")
    if not isinstance(getattr(torch, str(r.server_dtype), None), torch.dtype):
        problems.append(f"actor.rollout.server_dtype={r.server_dtype!r} is not a torch dtype")
    return problems
