"""The HTTP side of engine servers: the clients' one bounded call (`http_call`, used by the
vLLM-protocol and SGLang clients), and the request bodies of the RL2 engine server
(RL2/rollout/server.py): vLLM's JSON shapes checked and turned into RL2 types. Every rejection is
a `BadRequest` naming the field, which the server answers with a 400 in vLLM's `ErrorResponse`
shape."""
import http.client
import json
import time
import urllib.error
import urllib.request

from RL2.rollout.engine import SamplingParams

# vLLM SamplingParams keys this server honours; anything else is a 400 naming the key.
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed",
                 "logprobs", "n", "include_stop_str_in_output", "skip_special_tokens",
                 "ignore_eos", "detokenize"}
# cache_salt: vLLM keys its prefix cache by it (RL2's vLLM clients send the weight version);
# accepted and not needed here: the torch engine drops its cached KV at every weight update
GENERATE_KEYS = {"request_id", "token_ids", "sampling_params", "model", "output_mode", "stream",
                 "return_token_ids", "priority", "cache_salt"}


def http_call(url: str, method: str, path: str, body=None, timeout: float = 600.0, text: bool = False,
              who: str = "server"):
    """One bounded JSON request; any failure (refused, timeout, HTTP error, a body cut short) is
    a RuntimeError naming `who`, the server and the route (the pool retries or drops on it).
    The answer parsed as JSON, or as text when `text` (vLLM's LoRA routes)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise RuntimeError(f"{who} {url}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        # HTTPException: e.g. IncompleteRead when the server dies while sending its answer
        raise RuntimeError(f"{who} {url}{path} failed: {e}") from None
    if text:
        return raw.decode(errors="replace")
    try:
        return json.loads(raw) if raw else None
    except ValueError as e:
        raise RuntimeError(f"{who} {url}{path} failed: bad JSON ({e})") from None


def wait_until_up(url: str, who: str, timeout_s: float, probe_timeout_s: float) -> None:
    """GET /health every second until it answers (a server still loading its model refuses or
    answers 503), at most `timeout_s`; then a RuntimeError with the last failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http_call(url, "GET", "/health", timeout=probe_timeout_s, who=who)
            return
        except RuntimeError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{who} {url} not reachable within {timeout_s:.0f} s: {e}") from None
            time.sleep(1)


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_generate(body: dict, vocab_size: int) -> tuple[list[int], SamplingParams, bool]:
    """A vLLM GenerateRequest body -> (prompt ids, RL2 sampling params, want log-probs).
    Raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_KEYS)
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown}", unknown[0])
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise BadRequest("token_ids must be a non-empty list of ints", "token_ids")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise BadRequest(f"token_ids must be in [0, {vocab_size})", "token_ids")
    if body.get("output_mode", "tokens") != "tokens" or body.get("stream"):
        raise BadRequest("this server answers output_mode='tokens' without streaming", "output_mode")
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object", "sampling_params")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unsupported sampling_params {unknown}", f"sampling_params.{unknown[0]}")
    for key, ok, why in [
            ("n", sp.get("n", 1) == 1, "one sample per request (send n requests)"),
            ("ignore_eos", not sp.get("ignore_eos", False), "ignore_eos=true is not supported"),
            ("include_stop_str_in_output", sp.get("include_stop_str_in_output", True) is True,
             "stop strings are always included in the output"),
            ("logprobs", sp.get("logprobs") in (None, 0), "only the sampled token's log-prob (0)")]:
        if not ok:
            raise BadRequest(f"sampling_params.{key}: {why}", f"sampling_params.{key}")
    top_k = sp.get("top_k", 0)
    seed = sp.get("seed")
    try:
        params = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
            top_k=-1 if top_k in (0, -1, None) else top_k, max_new_tokens=sp.get("max_tokens", 16),
            stop=list(sp.get("stop") or []), stop_token_ids=[int(t) for t in sp.get("stop_token_ids") or []],
            seed=None if seed is None else int(seed))
        params.validate()
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling_params: {e}", "sampling_params") from None
    return ids, params, sp.get("logprobs") is not None


def field(body, key: str, kind):
    value = (body or {}).get(key) if isinstance(body, dict) else None
    if not isinstance(value, kind):
        raise BadRequest(f"body needs {key!r} ({kind.__name__})", key)
    return value
