"""Hydra configs: compose `RL2/config/<name>.yaml` with `key=value` overrides (struct mode:
an unknown key is an error), with no per-rank output directories."""
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


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "float64": torch.float64, "fp64": torch.float64}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16, float16 or float64")
