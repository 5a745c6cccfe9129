"""Hydra configs: compose `RL2/config/<name>.yaml` with `key=value` overrides (struct mode:
an unknown key is an error), with no per-rank output directories."""
import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf


def load_config(name: str, overrides: list[str] | None = None) -> DictConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    overrides = list(sys.argv[1:] if overrides is None else overrides)
    GlobalHydra.instance().clear()
    with initialize_config_module("RL2.config", version_base=None):
        try:
            cfg = compose(config_name=name, overrides=overrides)
        except HydraException as e:
            cause = e.__cause__ or e
            raise SystemExit(f"config error in {name}.yaml overrides {overrides}: {cause}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise SystemExit(f"missing required config keys: {', '.join(missing)} (set them as key=value)")
    OmegaConf.set_struct(cfg, True)
    return cfg


SCHEDULERS = ("constant", "cosine", "linear")  # RL2/workers/worker.py make_scheduler


def check_choice(value: str, key: str, choices: tuple) -> str:
    """`value` if it is one of `choices`, else a ValueError naming the key."""
    if value not in choices:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(choices)}")
    return value


def resolve_cpu_auto(worker_cfg, key: str, device: str, ring_reason: str, default="auto") -> bool:
    """A worker flag of true, false or auto (`default` where the config has no such key), where
    auto = on only where its path has run (the CPU) and never with ring attention (sp_size > 1),
    which `true` then refuses."""
    choice = worker_cfg.get(key, default)
    if choice not in (True, False, "auto"):
        raise SystemExit(f"{key}={choice!r}: use true, false or auto")
    if choice == "auto":
        return device == "cpu" and worker_cfg.sp_size == 1
    if choice and worker_cfg.sp_size > 1:
        raise SystemExit(f"{key}=true needs sp_size=1 (got {worker_cfg.sp_size}): {ring_reason}")
    return choice


def check_optimizer_config(cfg: DictConfig) -> None:
    """Optimizer keys of every worker section, checked before any model is built. Raises
    SystemExit naming each bad key and what to use."""
    problems = []
    for name in ("actor", "critic"):
        w = cfg.get(name)
        if w is None or "lr" not in w:
            continue
        if w.lr < 0:
            problems.append(f"{name}.lr={w.lr} must be >= 0")
        if w.scheduler not in SCHEDULERS:
            problems.append(f"{name}.scheduler={w.scheduler!r}: use one of {', '.join(SCHEDULERS)}")
        for key, low, high in (("warmup_ratio", 0, 1), ("min_lr_ratio", 0, 1)):
            if not low <= w[key] <= high:
                problems.append(f"{name}.{key}={w[key]} must be in [{low}, {high}]")
        if w.weight_decay < 0:
            problems.append(f"{name}.weight_decay={w.weight_decay} must be >= 0")
        if w.eps <= 0:
            problems.append(f"{name}.eps={w.eps} must be > 0")
        if not all(0 <= b < 1 for b in w.betas):
            problems.append(f"{name}.betas={list(w.betas)} must each be in [0, 1)")
        if w.max_grad_norm is not None and w.max_grad_norm <= 0:
            problems.append(f"{name}.max_grad_norm={w.max_grad_norm} must be > 0 (or null)")
    if problems:
        raise SystemExit("invalid config:\n  " + "\n  ".join(problems))


def count_problem(key: str, value, nullable: bool = False) -> list[str]:
    """[] if `value` is an integer >= 1 (or None where `nullable`), else the problem naming `key`.
    A count of 0 or below would crash after the model loads, or mean something else silently
    (a negative max_length cuts tokens, a negative frequency fires every step)."""
    if value is None and nullable:
        return []
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return []
    return [f"{key}={value!r} must be an integer >= 1" + (" (or null)" if nullable else "")]


def check_run_config(cfg: DictConfig) -> None:
    """trainer.* step counts and frequencies and data.* sizes of every trainer, checked before any
    data or model is loaded. Raises SystemExit naming each bad key."""
    t, problems = cfg.trainer, []
    problems += count_problem("trainer.n_epochs", t.n_epochs)
    for key in ("total_steps", "save_freq", "test_freq", "keep_last"):  # null: off / keep all
        problems += count_problem(f"trainer.{key}", t[key], nullable=True)
    for split in ("train", "test"):
        d = cfg.get("data", {}).get(split) or {}
        for key in ("batch_size", "max_length"):
            if key in d:
                problems += count_problem(f"data.{split}.{key}", d[key])
    if problems:
        raise SystemExit("invalid config:\n  " + "\n  ".join(problems))


def looks_local(path) -> bool:
    """A model path meant as a local directory (HF reads anything else as a hub repo id)."""
    return isinstance(path, str) and (os.path.isabs(path) or path in (".", "..", "~")
                                      or path.startswith(("./", "../", "~/")))


def missing_local_paths(paths: dict) -> list[str]:
    """{key: path} -> a problem for each local-looking path that does not exist (HF would report
    a malformed repo id instead, and only when that model is loaded)."""
    problems = []
    for key, path in paths.items():
        if not looks_local(path):
            continue
        full = os.path.expanduser(path)
        if not os.path.exists(full):
            problems.append(f"{key}={path!r}: no such local directory")
        elif full != path:  # HF loaders do not expand ~ (they take it for a repo id)
            problems.append(f"{key}={path!r}: give the full path {full!r} (~ is not expanded when loading)")
    return problems


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "float64": torch.float64, "fp64": torch.float64}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16, float16 or float64")
