"""The flash-attn 2.8.3 and ring-flash-attn 0.1.8 functions RL2's CUDA attention calls, checked
against their real source (tests/sources.py: flash-attn's sdist, ring-flash-attn's wheel, cached
in $RL2_FLASH_CACHE, default ~/.cache/rl2/flash-sources; parsed with `ast`, no import, no GPU):
the exported name, the positional parameters RL2 fills by position, the keywords it passes, and
the documented layout. Skips (saying why) only when a download fails (offline)."""
import ast
import os
import tarfile
from pathlib import Path

import pytest

from tests.sources import cache_dir, download, find, params, positional, tree

ROOT = Path(__file__).resolve().parents[1]
CACHE = cache_dir("RL2_FLASH_CACHE", "flash-sources")
# flash-attn publishes no wheel on PyPI: the sdist's metadata step must not compile CUDA.
NO_BUILD = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}


def call_site(path: Path, callee: str) -> ast.Call:
    """The one call of the local name `callee` in an RL2 module."""
    calls = [n for n in ast.walk(tree(path)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == callee]
    assert len(calls) == 1, (path, callee, len(calls))
    return calls[0]


def check_call(call: ast.Call, fn: ast.FunctionDef, by_position: list[str]) -> None:
    """RL2's call fills exactly `by_position` positionally, and passes only known keywords."""
    assert positional(fn)[:len(call.args)] == by_position, positional(fn)
    keywords = {k.arg for k in call.keywords}
    assert keywords <= params(fn) and not keywords & set(by_position), keywords


def test_flash_attn_varlen_func():
    src = download("flash-attn==2.8.3", CACHE, env=NO_BUILD)
    assert "flash_attn_varlen_func," in (src / "__init__.py").read_text()
    fn = find(tree(src / "flash_attn_interface.py"), "flash_attn_varlen_func", ast.FunctionDef)
    call = call_site(ROOT / "RL2/parallel/attention.py", "flash")
    check_call(call, fn, ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"])
    doc = ast.get_docstring(fn)
    # The layout RL2 hands over: (tokens, heads, head_dim), K/V with fewer heads (GQA).
    assert "q: (total_q, nheads, headdim)" in doc and "k: (total_k, nheads_k, headdim)" in doc
    assert "grouped-query attention" in doc
    assert "cu_seqlens_q: (batch_size + 1,), dtype torch.int32" in doc
    # shared prompts hand it fewer queries than keys (tests/test_attention.py's fake follows this)
    assert "If causal=True, the causal mask is aligned to the bottom right corner of the attention matrix." in doc


def test_flash_attn_varlen_one_query_path():
    """The kernel rule tests/test_attention.py's fake copies from mha_varlen_fwd (the sdist's
    csrc/flash_attn/flash_api.cpp): with one query at most per sequence and more query than K/V
    heads, RL2's call (causal, no window: the wrapper's default, no dropout) takes the path that
    reshapes q to (batch, heads_k, groups, d), which needs exactly one query per sequence; the
    pruned last layer leaves sequences without queries out for it."""
    src = download("flash-attn==2.8.3", CACHE, env=NO_BUILD)
    fn = find(tree(src / "flash_attn_interface.py"), "flash_attn_varlen_func", ast.FunctionDef)
    defaults = dict(zip([a.arg for a in fn.args.args][-len(fn.args.defaults):], fn.args.defaults))
    assert ast.literal_eval(defaults["window_size"]) == (-1, -1)
    with tarfile.open(CACHE / "wheels" / "flash_attn-2.8.3.tar.gz") as t:
        cpp = t.extractfile("flash_attn-2.8.3/csrc/flash_attn/flash_api.cpp").read().decode()
    varlen = cpp[cpp.index("\nmha_varlen_fwd("):cpp.index("\nmha_bwd(")]
    # one query: causal is dropped (one query sees every key either way), so the window stays -1
    assert "if (max_seqlen_q == 1 && !alibi_slopes_.has_value()) { is_causal = false; }" in varlen
    assert ("const int seqlenq_ngroups_swapped = max_seqlen_q == 1 && num_heads > num_heads_k && "
            "window_size_left < 0 && window_size_right < 0 && p_dropout == 0.f") in varlen
    assert "q = q.reshape({batch_size, num_heads_k, ngroups, head_size})" in varlen


def test_flash_attn_varlen_backward_rules():
    """What the fake's backward in tests/test_attention.py copies from flash-attn 2.8.3: the
    wrapper saves `causal` for the backward and declares the lengths as ints; mha_varlen_bwd has
    no one-query path (the general causal kernel, reading softmax_lse as (heads, total_q)), the
    forward's one-query path hands back its softmax_lse as (heads, batch) (the same layout when
    every sequence has one query), and the backward checks out/dout like q."""
    src = download("flash-attn==2.8.3", CACHE, env=NO_BUILD)
    py = (src / "flash_attn_interface.py").read_text()
    cls = py[py.index("class FlashAttnVarlenFunc("):]
    cls = cls[:cls.index("\ndef ")]
    assert "ctx.causal = causal" in cls and "ctx.causal," in cls[cls.index("def backward"):]
    for op in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"):
        fn = find(tree(src / "flash_attn_interface.py"), op, ast.FunctionDef)
        ints = {a.arg for a in fn.args.args if isinstance(a.annotation, ast.Name) and a.annotation.id == "int"}
        assert {"max_seqlen_q", "max_seqlen_k"} <= ints, (op, ints)
    with tarfile.open(CACHE / "wheels" / "flash_attn-2.8.3.tar.gz") as t:
        cpp = t.extractfile("flash_attn-2.8.3/csrc/flash_attn/flash_api.cpp").read().decode()
    fwd = cpp[cpp.index("\nmha_varlen_fwd("):cpp.index("\nmha_bwd(")]
    assert "softmax_lse = softmax_lse.reshape({num_heads * max_seqlen_q, batch_size});" in fwd
    bwd = cpp[cpp.index("\nmha_varlen_bwd("):cpp.index("\nmha_fwd_kvcache(")]
    assert "seqlenq_ngroups_swapped" not in bwd
    assert "if (is_causal) { window_size_right = 0; }" in bwd
    assert "const at::Tensor &softmax_lse,    // h x total_q, softmax logsumexp" in bwd
    for rule in ('TORCH_CHECK(out.dtype() == q_dtype', 'TORCH_CHECK(dout.dtype() == q_dtype',
                 'TORCH_CHECK(out.stride(-1) == 1', 'TORCH_CHECK(dout.stride(-1) == 1',
                 "CHECK_SHAPE(dout, total_q, num_heads, head_size);"):
        assert rule in bwd, rule


def test_ring_flash_attn_zigzag_varlen_func():
    src = download("ring-flash-attn==0.1.8", CACHE)
    assert "zigzag_ring_flash_attn_varlen_func," in (src / "__init__.py").read_text()
    path = src / "zigzag_ring_flash_attn_varlen.py"
    fn = find(tree(path), "zigzag_ring_flash_attn_varlen_func", ast.FunctionDef)
    call = call_site(ROOT / "RL2/parallel/ring_attention.py", "fn")
    check_call(call, fn, ["q", "k", "v", "cu_seqlens", "max_seqlen"])
    assert "group" in params(fn)
    # Zig-zag shards: each local sequence is two halves (cu_seqlens // 2), as RL2 splits them.
    assert "half_cu_seqlens = cu_seqlens // 2" in path.read_text()


# What ring-flash-attn 0.1.8 imports from flash_attn (its *_flash_attn*.py modules): names only,
# since importing the package runs none of them; the real flash_attn needs CUDA to build.
FLASH_STUB = "\n".join(f"def {name}(*args, **kwargs): raise RuntimeError('stub')" for name in (
    "_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward"))


def test_ring_flash_attn_imports_with_this_transformers(tmp_path):
    """ring-flash-attn 0.1.8's package import goes through its HF adapter, which imports a name
    transformers 5 no longer has where it looks: RL2 supplies it, so `_ring_flash_varlen`
    returns the real function (without it: None and the pure-torch ring on GPU)."""
    import subprocess
    import sys

    src = download("ring-flash-attn==0.1.8", CACHE)
    stub = tmp_path / "flash_attn"
    stub.mkdir()
    (stub / "__init__.py").write_text("")
    (stub / "flash_attn_interface.py").write_text(FLASH_STUB + "\n")
    code = ("from RL2.parallel.ring_attention import _ring_flash_varlen\n"
            "fn = _ring_flash_varlen()\n"
            "import ring_flash_attn\n"
            "assert fn is ring_flash_attn.zigzag_ring_flash_attn_varlen_func, fn\n"
            "print(ring_flash_attn.__file__)\n")
    path = os.pathsep.join([str(tmp_path), str(src.parent), str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(str(src))  # the downloaded release, not another copy


@pytest.mark.parametrize("module", ["attention.py", "ring_attention.py"])
def test_modules_name_the_checked_versions(module):
    text = (ROOT / "RL2/parallel" / module).read_text()
    assert "tests/test_flash_source.py" in text
