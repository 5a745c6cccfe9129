"""Real upstream sources for the GPU-only code paths, read without importing them: a pinned
release is downloaded once with `pip download --no-deps` into a cache directory and its Python
files are parsed with `ast`. An API change in the pinned version fails a test here instead of a
user's first GPU run. A test skips (saying why) only when the download fails (offline)."""
import ast
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest


def cache_dir(env_var: str, name: str) -> Path:
    """$env_var, default ~/.cache/rl2/<name>."""
    return Path(os.environ.get(env_var, Path.home() / ".cache" / "rl2" / name))


# sglang 0.5.23, the version RL2's SGLang code is written against (its wheel's Python files)
SGLANG = "sglang==0.5.23"
CACHE = cache_dir("RL2_SGLANG_CACHE", "sglang-0.5.23")


def download(spec: str, cache: Path, package: str | None = None, env: dict | None = None) -> Path:
    """The unpacked Python package `package` (default: the distribution name with '-' as '_')
    of `spec` ("name==version"), from its wheel or, when PyPI has none, its sdist. `env` is added
    to pip's environment (an sdist's metadata step runs its setup code)."""
    name = spec.split("==")[0]
    package = package or name.replace("-", "_")
    done = cache / f".{name}-unpacked"
    if not done.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--no-build-isolation", spec, "-d", str(cache / "wheels")]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=600,
                           env={**os.environ, **(env or {})})
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot download {spec} (offline?): {getattr(e, 'stderr', b'')[-300:]!r}")
        _unpack(cache, name.replace("-", "_"), package)
        done.touch()
    return cache / package


def _unpack(cache: Path, dist: str, package: str) -> None:
    wheels = sorted((cache / "wheels").glob(f"{dist}-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(cache, [m for m in z.namelist() if m.startswith(f"{package}/")])
        return
    sdist = next((cache / "wheels").glob(f"{dist}-*.tar.gz"))
    with tarfile.open(sdist) as t:  # members are "<dist>-<version>/<package>/..."
        for member in t.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and len(parts) > 2 and parts[1] == package:
                member.name = str(Path(*parts[1:]))
                t.extract(member, cache, filter="data")


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def find(module: ast.AST, name: str, kind=(ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    for node in ast.walk(module):
        if isinstance(node, kind) and node.name == name:
            return node
    raise AssertionError(f"{name} not found")


def params(fn) -> set[str]:
    a = fn.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}


def positional(fn) -> list[str]:
    """The names of `fn`'s positional parameters, in order."""
    return [x.arg for x in fn.args.posonlyargs + fn.args.args]
