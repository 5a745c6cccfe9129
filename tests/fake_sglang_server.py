"""`python -m tests.fake_sglang_server --model DIR --port 0`: RL2's torch engine behind SGLang
0.5.23's HTTP routes and JSON shapes, for testing `SGLangServerEngine` on CPU (no sglang can
be installed here). It joins the trainer's weight-update group the way SGLang does and refuses
what SGLang refuses, with SGLang's status codes. Citations are to the 0.5.23 source
(python/sglang/...; "hs" = srt/entrypoints/http_server.py, "wu" = srt/managers/
scheduler_components/weight_updater.py, "mwu" = srt/model_executor/model_runner_components/
weight_updater.py, "tm" = srt/managers/tokenizer_manager.py); tests/test_sglang_server.py
checks the quoted facts in that source.

Not modelled: LoRA adapters change no logits here (the registry rules are enforced: which
names are loaded, refusals), tensor parallelism (tp_size 1), streaming, text prompts.
"""
import argparse
import datetime
import json
import logging
import os
import threading
import time
import urllib.parse
import uuid
from http.server import ThreadingHTTPServer

import torch
import torch.distributed as dist

from RL2.rollout.engine import SamplingParams
from RL2.rollout.server import EngineServer, ServedEngine
from RL2.rollout.server import Handler as ServerHandler

logger = logging.getLogger("fake_sglang")

# api/v1/api_types.py:177 SamplingParams: "JSON object (unknown keys rejected)"
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                 "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                 "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag",
                 "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                 "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params",
                 "beam_width", "watermark", "choice")
HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # hs:218


class HTTPError(Exception):
    def __init__(self, status: int, payload):
        super().__init__(str(payload))
        self.status, self.payload = status, payload


def value_error(message: str) -> HTTPError:
    """A ValueError in a route: 400 {"error": {"message"}} (hs:2246 _create_error_response)."""
    return HTTPError(400, {"error": {"message": message}})


def failed(message: str) -> HTTPError:
    """A weight call that returned success=False: 400 {"success", "message"} (hs:1404-1505)."""
    return HTTPError(400, {"success": False, "message": message})


def required(body, *keys) -> dict:
    """Missing request fields fail FastAPI's validation: 400 (hs:636 replaces the 422)."""
    if not isinstance(body, dict) or any(k not in body for k in keys):
        raise HTTPError(400, {"object": "error", "message": f"field required: {keys}", "code": 400})
    return body


class FakeSGLang(EngineServer):
    def __init__(self, engine: ServedEngine, args):
        super().__init__(engine, args.model)
        self.args = args
        self.context_len = engine.max_model_len
        # tp_worker.py: min(context_len - 1, KV capacity - 1) - 5 (the fake's KV pool is unbounded)
        self.max_req_input_len = self.context_len - 1 - 5
        self.is_pause = False  # tm:2267: new requests wait at tm:938 while set
        self.session = False   # wu:80 _WeightUpdateSession
        self.groups = {}       # mwu:98 _model_update_group
        self.loras = {}        # lora_registry: name -> path
        self.update_lock = threading.Lock()
        # SGLang's own TP group is the default process group; mwu:121 asserts one exists
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    # ------------------------------------------------------------------ generate
    def check_generate(self, body) -> tuple[list[int], dict]:
        body = required(body, "input_ids")
        sp = body.get("sampling_params") or {}
        for key in sp:  # hs:937 contract check: 400 {"error": "<serde text>"}
            if key not in SAMPLING_KEYS:
                raise HTTPError(400, {"error": f"unknown field `{key}`, expected one of {SAMPLING_KEYS}"})
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise value_error("input_ids must be a non-empty list of ints (this fake takes no text)")
        if len(ids) >= self.context_len:  # tm:1339
            raise value_error(f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_len} tokens).")
        if len(ids) + sp.get("max_new_tokens", 128) > self.context_len:  # tm:1353
            raise value_error("Requested token count exceeds the model's maximum context length")
        if len(ids) >= self.max_req_input_len:  # scheduler.py validate_input_length: aborted, 400
            raise value_error(f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
                              f"({self.max_req_input_len} tokens).")
        lora = body.get("lora_path")
        if lora is not None and lora not in self.loras:  # lora_registry.py acquire()
            raise value_error(f"The following requested LoRA adapters are not loaded: {lora}")
        return ids, sp

    def to_params(self, sp: dict) -> SamplingParams:
        """SGLang's sampling semantics in RL2 terms (srt/sampling/sampling_params.py)."""
        temperature, top_k = sp.get("temperature", 1.0), sp.get("top_k", -1)
        if not temperature >= 0 or not 0 < sp.get("top_p", 1.0) <= 1 or (top_k < 1 and top_k != -1):
            raise value_error(f"bad sampling params {sp}")  # SamplingParams.verify
        # sampling_seed is used only with --enable-deterministic-inference (sampling_batch_info.py:128-170)
        seed = sp.get("sampling_seed") if self.args.enable_deterministic_inference else None
        return SamplingParams(temperature=0.0 if temperature < 1e-6 else temperature, top_p=sp.get("top_p", 1.0),
                              top_k=-1 if top_k >= 2**30 else top_k, max_new_tokens=sp.get("max_new_tokens", 128),
                              stop=list(sp.get("stop") or []), stop_token_ids=list(sp.get("stop_token_ids") or []),
                              seed=seed)

    def generate_route(self, body) -> dict:
        ids, sp = self.check_generate(body)
        params = self.to_params(sp)
        while self.is_pause:  # tm:938: wait for continue_generation
            time.sleep(0.01)
        with self.update_lock:  # tm:941 reader side of model_update_lock: counted in flight
            self.in_flight += 1
        try:
            out = self._call(self.engine.generate(ids, params))[0]
        finally:
            self.in_flight -= 1
        if out.finish_reason == "abort":  # schedule_batch.py:332 FINISH_ABORT().to_json()
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        elif out.finish_reason == "length":
            reason = {"type": "length", "length": len(out.token_ids)}
        else:
            reason = {"type": "stop", "matched": out.token_ids[-1] if out.token_ids else None}
        meta = {"id": uuid.uuid4().hex, "finish_reason": reason, "prompt_tokens": len(ids),
                "completion_tokens": len(out.token_ids), "weight_version": self.engine.version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(out.token_ids, out.logprobs)]
        return {"text": "", "output_ids": list(out.token_ids), "meta_info": meta}

    def health(self) -> None:
        start = time.monotonic()
        while self.is_pause:  # the health request is a generation: it waits for the pause (tm:938)
            if time.monotonic() - start > HEALTH_CHECK_TIMEOUT:
                raise HTTPError(503, None)  # hs:795
            time.sleep(0.05)
        time.sleep(1)  # hs:777: polls once a second for the detokenizer's answer

    # ------------------------------------------------------------------ pause
    def pause_generation(self, body) -> dict:
        mode = (body or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):  # io_struct.py PauseGenerationReqInput Literal
            raise HTTPError(400, {"object": "error", "message": f"bad mode {mode!r}", "code": 400})
        self.is_pause = True
        if mode == "abort":  # tm:2273: abort all until nothing holds the update lock
            while self.in_flight:
                self._call(self._abort())
                time.sleep(0.05)
        else:  # the scheduler stops stepping; running requests keep their state
            self.pause("keep")
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body) -> dict:
        self.is_pause = False
        self.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ------------------------------------------------------------------ weights
    def init_group(self, body) -> dict:
        b = required(body, "master_address", "master_port", "rank_offset", "world_size")
        name, backend = b.get("group_name", "weight_update_group"), b.get("backend", "nccl")
        assert dist.is_initialized(), "Default torch process group must be initialized"  # mwu:121
        rank = b["rank_offset"] + 0  # mwu:126: rank_offset + tp_rank
        try:  # utils/common.py:2859 init_custom_process_group, as SGLang calls it (mwu:135)
            from torch.distributed.distributed_c10d import (PrefixStore, _new_process_group_helper,
                                                            _world, rendezvous)
            timeout = datetime.timedelta(seconds=self.args.group_timeout)
            store, rank, world = next(rendezvous(f"tcp://{b['master_address']}:{b['master_port']}",
                                                 rank, b["world_size"], timeout=timeout))
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(backend), PrefixStore(name, store),
                                              group_name=name, backend_options=None, timeout=timeout)
            _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        except Exception as e:  # noqa: BLE001 - mwu:142: reported as success=False
            raise failed(f"Failed to initialize custom process group: {e}.") from None
        self.groups[name] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body) -> dict:
        name = (body or {}).get("group_name", "weight_update_group")
        if name not in self.groups:  # mwu:146
            raise failed("The group to be destroyed does not exist.")
        dist.destroy_process_group(self.groups.pop(name))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin(self, body) -> dict:
        if self.session:  # wu:311
            raise failed("a weight-update session is already open; call end_weight_update() first")
        self.session = True
        return {"success": True, "message": "Success"}

    def end(self, body) -> dict:
        if not self.session:  # wu:327
            raise failed("no weight-update session is open; call begin_weight_update() first")
        self.session = False
        return {"success": True, "message": "Success"}

    def receive(self, b: dict) -> list:
        """mwu:260 receive_weights_from_distributed, flattened_bucket branch (mwu:297)."""
        name = b.get("group_name", "weight_update_group")
        assert name in self.groups, (f"Group {name} not in {list(self.groups)}. "
                                     "Please call `init_weights_update_group` first.")
        assert b.get("load_format") in (None, "flattened_bucket"), b.get("load_format")
        names, dtypes, shapes = b["names"], [getattr(torch, d) for d in b["dtypes"]], b["shapes"]
        if b.get("load_format") is None:  # one broadcast per tensor
            out = [(n, torch.empty(s, dtype=d)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
            for _, t in out:
                dist.broadcast(t, src=0, group=self.groups[name])
            return out
        offsets, offset = [], 0
        for n, d, s in zip(names, dtypes, shapes, strict=True):  # weight_sync/tensor_bucket.py empty()
            if any(x < 0 for x in s):
                raise ValueError(f"Negative dimension in received tensor {n}: {s}")
            if offset % d.itemsize:
                raise ValueError(f"Unaligned received tensor {n}: byte offset {offset}, dtype {d}")
            offsets.append(offset)
            offset += torch.Size(s).numel() * d.itemsize
        flat = torch.empty(offset, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=self.groups[name])
        return [(n, flat[o:o + torch.Size(s).numel() * d.itemsize].view(d).reshape(s))
                for n, d, s, o in zip(names, dtypes, shapes, offsets)]

    def update_from_distributed(self, body) -> dict:
        b = required(body, "names", "dtypes", "shapes")
        if not self.session:  # wu:192: refused before anything is received
            raise failed("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
        with self.update_lock:  # tm:525: not paused -> model_update_lock's writer side
            while self.in_flight and not self.is_pause:
                time.sleep(0.01)
            try:
                weights = self.receive(b)
            except Exception as e:  # noqa: BLE001 - wu:209
                raise failed(f"Failed to receive weights: {e}") from None
            try:  # mwu:332 model.load_weights; SGLang's loaders copy_ (cast) into params of the same shape
                with self.parked():
                    self.engine.update_weights(weights)
            except (KeyError, ValueError) as e:
                raise failed(f"Failed to update parameter online: {e}. The full weights of the "
                             "ModelRunner are partially updated. Please discard the whole weights.") from None
            if b.get("weight_version") is not None:
                self.set_version(b["weight_version"])
            if b.get("flush_cache", True) and self.in_flight:  # wu:127 flush needs an idle scheduler
                raise failed("Weights were updated, but the cache was not flushed because requests "
                             "are still running or queued. Retract or finish them, then call /flush_cache.")
        return {"success": True, "message": "Succeeded to update parameter online."}

    def update_version(self, body) -> dict:
        b = required(body, "new_version")
        if b.get("abort_all_requests", True):  # hs:1533; io_struct.py default True
            self._call(self._abort())
        self.set_version(str(b["new_version"]))
        return {"success": True, "message": f"Weight version updated to {b['new_version']}",
                "new_version": b["new_version"]}

    # ------------------------------------------------------------------ LoRA
    def load_lora(self, body) -> dict:
        b = required(body, "lora_name", "lora_path")
        if not self.args.enable_lora:  # tokenizer_control_mixin.py:667
            raise HTTPError(400, lora_result(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."))
        if b["lora_name"] in self.loras:  # lora_manager.py validate_new_adapter
            raise HTTPError(400, lora_result(False, f"Failed to load LoRA adapter {b['lora_name']} because it is already loaded"))
        try:
            with open(os.path.join(b["lora_path"], "adapter_config.json")) as f:
                config = json.load(f)
        except OSError as e:
            raise HTTPError(400, lora_result(False, str(e))) from None
        # the LoRA memory pool is sized at start by --max-lora-rank / --lora-target-modules
        if config["r"] > self.args.max_lora_rank or not set(config["target_modules"]) <= set(self.args.lora_target_modules):
            raise HTTPError(400, lora_result(False, f"LoRA adapter {b['lora_name']} with rank {config['r']} is incompatible"))
        self.loras[b["lora_name"]] = b["lora_path"]
        return lora_result(True, None, self.loras)

    def unload_lora(self, body) -> dict:
        name = required(body, "lora_name")["lora_name"]
        if name not in self.loras:  # lora_registry.py unregister()
            raise HTTPError(400, lora_result(False, f"LoRA with name {name} does not exist."))
        del self.loras[name]
        return lora_result(True, None, self.loras)

    def server_info(self) -> dict:
        a = self.args
        return {"model_path": a.model, "tp_size": 1, "pp_size": 1, "dp_size": 1, "context_length": a.context_length,
                "enable_lora": a.enable_lora, "max_lora_rank": a.max_lora_rank,
                "lora_target_modules": a.lora_target_modules,
                "enable_deterministic_inference": a.enable_deterministic_inference,
                "weight_version": "default", "version": "0.5.23-fake-rl2",
                "max_req_input_len": self.max_req_input_len}  # scheduler.py get_init_info


def lora_result(success: bool, error, loaded=None) -> dict:
    """io_struct.py LoRAUpdateOutput, as hs:1652 returns it (400 when not success)."""
    return {"success": success, "error_message": error, "loaded_adapters": dict(loaded) if loaded else None}


def routes(s: FakeSGLang) -> tuple[dict, dict]:
    info = lambda q, b: s.server_info()  # noqa: E731
    model = lambda q, b: {"model_path": s.args.model, "weight_version": s.engine.version,  # noqa: E731
                          "is_generation": True}
    health = lambda q, b: s.health()  # noqa: E731
    get = {"/health": health, "/health_generate": health, "/model_info": model, "/get_model_info": model,
           "/server_info": info, "/get_server_info": info}
    post = {"/generate": lambda q, b: s.generate_route(b),
            "/pause_generation": lambda q, b: s.pause_generation(b),
            "/continue_generation": lambda q, b: s.continue_generation(b),
            "/init_weights_update_group": lambda q, b: s.init_group(b),
            "/destroy_weights_update_group": lambda q, b: s.destroy_group(b),
            "/begin_weight_update": lambda q, b: s.begin(b), "/end_weight_update": lambda q, b: s.end(b),
            "/update_weights_from_distributed": lambda q, b: s.update_from_distributed(b),
            "/update_weight_version": lambda q, b: s.update_version(b),
            "/load_lora_adapter": lambda q, b: s.load_lora(b), "/unload_lora_adapter": lambda q, b: s.unload_lora(b)}
    return get, post


class Handler(ServerHandler):
    """RL2's server handler (access log, JSON answers) with SGLang's (FastAPI's) error shapes."""

    def _dispatch(self, routes):
        url = urllib.parse.urlsplit(self.path)
        if url.path not in routes:  # FastAPI: {"detail": "Not Found"}
            return self._send(404, {"detail": "Not Found"})
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length)) if length else None
            self._send(200, routes[url.path](urllib.parse.parse_qs(url.query), body))
        except HTTPError as e:
            self._send(e.status, e.payload)
        except Exception as e:  # noqa: BLE001 - e.g. an AssertionError in SGLang's code: a 500
            logger.exception("%s failed", url.path)
            self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    def do_GET(self):
        self._dispatch(self.get_routes)

    def do_POST(self):
        self._dispatch(self.post_routes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=0)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    p.add_argument("--group-timeout", type=float, default=120.0, help="weight-update group timeout (s)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    engine = ServedEngine(args.model, args.model, device="cpu", dtype="float32", max_model_len=args.context_length)
    server = FakeSGLang(engine, args)
    get, post = routes(server)
    ThreadingHTTPServer.request_queue_size = 1024
    httpd = ThreadingHTTPServer((args.host, args.port), type("H", (Handler,), {"get_routes": get, "post_routes": post}))
    httpd.daemon_threads = True
    print(f"fake SGLang listening on http://{args.host}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        server.close()


if __name__ == "__main__":
    main()
