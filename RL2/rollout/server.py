"""`python -m RL2.rollout.server --model DIR --host H --port P`: RL2's torch engine as an HTTP
server speaking the subset of vLLM 0.32's server protocol that RL2 uses, so one client
(`RL2.rollout.vllm_server.VLLMServerEngine`, pooled by `RL2.rollout.remote.RemotePool`) drives a
real `vllm serve` and this server alike (CPU stand-in for vLLM; no new dependency: stdlib HTTP).

Routes and JSON shapes (vLLM source cited per route; errors are vLLM's `ErrorResponse`
`{"error": {"message", "type", "param", "code"}}`, vllm/entrypoints/serve/engine/protocol.py):
  GET  /health                        200, empty body (serve/instrumentator/health.py)
  GET  /get_world_size                {"world_size": 1} (rl/online/api_router.py)
  POST /inference/v1/generate         GenerateRequest -> GenerateTokensResponse, output_mode
       "tokens", no streaming, n = 1 (scale_out/token_in_token_out/{api_router,protocol}.py)
  POST /pause?mode=abort|wait|keep    {"status": "paused"}   /resume {"status": "resumed"}
  GET  /is_paused                     {"is_paused": bool}
  POST /init_weight_transfer_engine   {"init_info": {...}}    (rl2_gloo init info)
  POST /start_weight_update, /update_weights {"update_info": {names, dtype_names, shapes}},
       /finish_weight_update {"weight_version": str|null}, /shutdown_weight_transfer_engine
  POST /update_weight_version         {"new_version": str}
  GET  /weight_info                   {"weight_version": str} ("default" until set, as vLLM)
Weights arrive over the `rl2_gloo` wire format (RL2/rollout/vllm_transfer.py): this server is
worker rank `rank_offset` (default 1) of the trainer's gloo group. Request bodies are checked in
RL2/rollout/server_protocol.py.

Threads: HTTP handlers run in threads; the engine lives on one asyncio loop in its own thread.
Weight loads and pause(keep) "park" that loop (a callback blocks it between decode steps), so the
engine is never touched by two threads at once.
"""
import argparse
import asyncio
import json
import logging
import threading
import time
import urllib.parse
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from RL2.rollout.server_protocol import BadRequest, field, parse_generate
from RL2.rollout.torch_engine import TorchEngine
from RL2.rollout.vllm_transfer import open_group, layout, unpack

logger = logging.getLogger("RL2.server")

class ServedEngine(TorchEngine):
    """TorchEngine with vLLM's request semantics: a request's seed is its sample's seed (vLLM
    seeds one generator per request), and each output carries the weight versions that produced
    its tokens (vLLM's `weight_versions` spans, vllm/outputs.py WeightVersionSpan)."""

    version = "default"

    raw_seeds = True

    def _append(self, seq, token: int, logprob: float) -> bool:
        spans = seq.__dict__.setdefault("spans", [])
        n = len(seq.tokens)
        if spans and spans[-1]["version"] == self.version:
            spans[-1]["end"] = n + 1
        else:
            spans.append({"version": self.version, "start": n, "end": n + 1})
        return super()._append(seq, token, logprob)

    def abort_all(self) -> None:
        self._abort_all()  # in-flight requests end now with their tokens so far, "abort"


class EngineServer:
    """The engine, its loop thread, and the weight-transfer state behind the routes."""

    def __init__(self, engine: ServedEngine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rl2-engine", daemon=True)
        self.thread.start()
        self.gate = None  # asyncio.Event on the loop: set = requests may start
        self._call(self._make_gate())
        self.in_flight = 0
        self.group = None
        # replaced groups are kept, not dropped: ProcessGroupGloo's destructor waits for its
        # pending work, so dropping one stuck in a receive would block this handler until timeout
        self._retired = []
        self.paused = None  # None | "abort" | "wait" | "keep"
        self._park_lock = threading.Lock()  # one parker at a time
        self._release = None  # set to unpark the loop

    async def _make_gate(self):
        self.gate = asyncio.Event()
        self.gate.set()

    def _call(self, coro, timeout: float | None = None):
        """Run a coroutine on the engine loop from a handler thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ------------------------------------------------------------------ parking
    def _park(self) -> threading.Event:
        entered, release = threading.Event(), threading.Event()
        self.loop.call_soon_threadsafe(lambda: (entered.set(), release.wait()))
        entered.wait()
        return release

    @contextmanager
    def parked(self):
        """The loop stands still (between decode steps) inside this block."""
        with self._park_lock:
            if self._release is not None:  # already parked by pause(keep)
                yield
                return
            release = self._park()
            try:
                yield
            finally:
                release.set()

    # ------------------------------------------------------------------ generation
    async def _generate(self, prompt, params):
        await self.gate.wait()  # paused with abort/wait: new requests wait for /resume
        self.in_flight += 1
        try:
            return (await self.engine.generate(prompt, params))[0]
        finally:
            self.in_flight -= 1

    def generate(self, body) -> dict:
        prompt, params, want_logprobs = parse_generate(body, self.engine.vocab_size)
        if len(prompt) >= self.engine.max_model_len:
            raise BadRequest(f"prompt has {len(prompt)} tokens; max_model_len="
                             f"{self.engine.max_model_len} leaves no room", "token_ids")
        out = self._call(self._generate(prompt, params))
        logprobs = None
        if want_logprobs:
            logprobs = {"content": [{"token_id": t, "logprob": lp, "top_logprobs": []}
                                    for t, lp in zip(out.token_ids, out.logprobs)]}
        choice = {"index": 0, "finish_reason": out.finish_reason, "stop_reason": None,
                  "token_ids": list(out.token_ids), "logprobs": logprobs,
                  "weight_versions": out.weight_versions or []}
        n_out = len(out.token_ids)
        return {"request_id": body.get("request_id") or uuid.uuid4().hex, "model": self.model_name,
                "created": int(time.time()), "output_mode": "tokens", "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                          "total_tokens": len(prompt) + n_out}}

    # ------------------------------------------------------------------ pause / resume
    def pause(self, mode: str) -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise BadRequest(f"mode must be abort, wait or keep, got {mode!r}", "mode")
        if self.paused == "keep":
            return {"status": "paused"}
        self.loop.call_soon_threadsafe(self.gate.clear)
        if mode == "abort":
            self._call(self._abort())  # on the loop: it completes the requests' futures
        elif mode == "wait":
            while self._call(self._count()) > 0:
                time.sleep(0.01)
        else:
            with self._park_lock:
                self._release = self._park()
        self.paused = mode
        return {"status": "paused"}

    async def _abort(self) -> None:
        self.engine.abort_all()

    async def _count(self) -> int:
        return self.in_flight

    def resume(self) -> dict:
        with self._park_lock:
            if self._release is not None:
                self._release.set()
                self._release = None
        self.loop.call_soon_threadsafe(self.gate.set)
        self.paused = None
        return {"status": "resumed"}

    # ------------------------------------------------------------------ weight transfer
    def init_transfer(self, body) -> dict:
        info = field(body, "init_info", dict)
        if "master_address" in info or "nccl_unique_id_b64" in info:
            raise BadRequest("this RL2 server receives weights over rl2_gloo only, not nccl: set "
                             "actor.rollout.transfer_backend=rl2_gloo", "init_info")
        try:
            host, port, world = str(info["host"]), int(info["port"]), int(info["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"init_info needs host, port, world_size (rl2_gloo): {e!r}", "init_info") from None
        rank = int(info.get("rank_offset", 1))
        if not 0 < rank < world:
            raise BadRequest(f"rank_offset {rank} outside the group of {world}", "init_info")
        self.retire_group()
        # blocks until every rank joined; bounded by the trainer's timeout
        self.group = open_group(host, port, rank, world, float(info.get("timeout_s", 300.0)))
        return {"message": "Weight transfer initialized"}

    def retire_group(self) -> dict:
        if self.group is not None:
            self._retired.append(self.group)
            self.group = None
        return {"message": "Weight transfer shut down"}

    def _need_group(self):
        if self.group is None:
            raise BadRequest("init_weight_transfer_engine was not called")

    def update_weights(self, body) -> dict:
        self._need_group()
        info = field(body, "update_info", dict)
        names, dnames, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
        if not (isinstance(names, list) and isinstance(dnames, list) and isinstance(shapes, list)
                and len(names) == len(dnames) == len(shapes)):
            raise BadRequest("update_info needs names, dtype_names, shapes: lists of one length", "update_info")
        dtypes = [getattr(torch, d, None) for d in dnames]
        if any(not isinstance(d, torch.dtype) for d in dtypes):
            raise BadRequest(f"unknown dtype in {dnames}", "update_info.dtype_names")
        _, size = layout(shapes, dtypes)
        buffer = torch.empty(size, dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()  # received first, so the trainer never waits on a 4xx
        with self.parked():
            try:
                self.engine.update_weights(unpack(buffer, names, shapes, dtypes))
            except (KeyError, ValueError) as e:
                raise BadRequest(str(e), "update_info.names") from None
        return {"message": "Weights updated"}

    def finish(self, body) -> dict:
        self._need_group()
        version = (body or {}).get("weight_version")
        if version is not None:
            self.set_version(str(version))
        return {"message": "Weight update finished"}

    def set_version(self, version: str) -> dict:
        with self.parked():
            self.engine.version = version
        return {"success": True, "new_version": version}

    def close(self):
        self.resume()
        self._call(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _shutdown(self):
        self.engine.shutdown()


class Handler(BaseHTTPRequestHandler):
    """Routes one request to its EngineServer call; `make_handler` binds the routes."""

    get_routes: dict = {}   # path -> f(query, body) -> JSON payload (None: empty body)
    post_routes: dict = {}

    def log_message(self, fmt, *args):  # access log at debug level only
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, payload) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, param=None) -> None:
        phrase = {400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}.get(code, "Internal Server Error")
        self._send(code, {"error": {"message": message, "type": phrase, "param": param, "code": code}})

    def _dispatch(self, routes, other):
        url = urllib.parse.urlsplit(self.path)
        if url.path not in routes:
            if url.path in other:
                return self._error(405, f"{self.command} not allowed on {url.path}")
            return self._error(404, f"no route {url.path}")
        body = None
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError as e:
                return self._error(400, f"invalid JSON body: {e}")
        try:
            result = routes[url.path](urllib.parse.parse_qs(url.query), body)
        except BadRequest as e:
            return self._error(400, str(e), e.param)
        except Exception as e:  # noqa: BLE001 - reported to the client, logged here
            logger.exception("%s failed", url.path)
            return self._error(500, f"{type(e).__name__}: {e}")
        self._send(200, result)

    def do_GET(self):
        self._dispatch(self.get_routes, self.post_routes)

    def do_POST(self):
        self._dispatch(self.post_routes, self.get_routes)


def make_handler(server: EngineServer) -> type[Handler]:
    """A Handler class whose routes call `server` (the HTTP server builds one per request)."""
    s = server
    get_routes = {
        "/health": lambda q, b: None,
        "/get_world_size": lambda q, b: {"world_size": 1},
        "/is_paused": lambda q, b: {"is_paused": s.paused is not None},
        "/weight_info": lambda q, b: {"weight_version": s.engine.version},
    }
    post_routes = {
        "/inference/v1/generate": lambda q, b: s.generate(b),
        "/pause": lambda q, b: s.pause(q.get("mode", ["abort"])[0]),
        "/resume": lambda q, b: s.resume(),
        "/init_weight_transfer_engine": lambda q, b: s.init_transfer(b),
        "/start_weight_update": lambda q, b: (s._need_group(), {"message": "Weight update started"})[1],
        "/update_weights": lambda q, b: s.update_weights(b),
        "/finish_weight_update": lambda q, b: s.finish(b),
        "/update_weight_version": lambda q, b: s.set_version(str(field(b, "new_version", str))),
        "/shutdown_weight_transfer_engine": lambda q, b: s.retire_group(),
    }
    return type("BoundHandler", (Handler,), {"get_routes": get_routes, "post_routes": post_routes})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="for requests without a seed")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cpu-matmul", default="onednn", choices=["onednn", "aten"],
                   help="linear layers on the CPU: oneDNN-packed weights or PyTorch's default BLAS")
    p.add_argument("--no-small-gemm", dest="small_gemm", action="store_false",
                   help="CPU: decode-step products on oneDNN, not RL2's AVX-512 kernel")
    p.add_argument("--compile-decode", action="store_true",
                   help="CPU: decode steps run one torch.compile'd graph (first step compiles)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = ServedEngine(args.model, args.tokenizer or args.model, device=args.device,
                          dtype=args.dtype, max_model_len=args.max_model_len,
                          max_batch_size=args.max_batch_size, seed=args.seed,
                          cpu_matmul=args.cpu_matmul, compile_decode=args.compile_decode,
                          small_gemm=args.small_gemm)
    server = EngineServer(engine, args.model)
    # listen backlog: the stdlib default (5) resets connections when a trainer sends a burst
    ThreadingHTTPServer.request_queue_size = 1024
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(server))
    httpd.daemon_threads = True
    # the address line is what launch scripts (and tests) wait for
    print(f"RL2 engine server listening on http://{args.host}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        server.close()


if __name__ == "__main__":
    main()
