"""LoRA adapters (`<worker>.lora.*`), defined by PEFT on the plain HF model before it is sharded.

`get_peft_model` replaces each target Linear in place by a PEFT `lora.Linear` (`base_layer` +
`lora_A`/`lora_B`), so the worker keeps the HF model (with the adapters injected) and FSDP2 shards
it as usual: FSDP2 allows frozen and trainable parameters in one unit and only needs a uniform
dtype among the trainable ones, so the frozen base may be held in a lower precision.

State-dict names are the HF names with `.base_layer` inserted and `.lora_{A,B}.default` added;
`merged_items` turns them back into plain HF weights (W + scale * B @ A), for engines and for the
merged export.
"""
import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Iterable, Iterator

import torch

from RL2.utils.config import resolve_dtype

ADAPTER_MARKS = (".lora_A.default.", ".lora_B.default.")
VALUE_HEAD = "score"  # AutoModelForTokenClassification's head: trained in full (PEFT modules_to_save)


def enabled(cfg) -> bool:
    lora = cfg.get("lora")
    return lora is not None and lora.rank > 0


def check_config(cfg, name: str) -> list[str]:
    """Start-up problems of `<name>.lora.*` (before any model is loaded)."""
    if not enabled(cfg):
        return []
    lora, problems = cfg.lora, []
    if importlib.util.find_spec("peft") is None:
        problems.append(f"{name}.lora.rank={lora.rank} needs PEFT, which is not installed: "
                        f"pip install -e '.[peft]'")
    if cfg.tp_size > 1:
        problems.append(
            f"{name}.lora.rank > 0 does not compose with {name}.tp_size={cfg.tp_size}: the TP plans "
            f"shard base Linears, not PEFT's lora_A/lora_B; use {name}.tp_size=1 (FSDP/HSDP/sp work)")
    if lora.alpha <= 0:
        problems.append(f"{name}.lora.alpha={lora.alpha} must be > 0")
    if not 0 <= lora.dropout < 1:
        problems.append(f"{name}.lora.dropout={lora.dropout} must be in [0, 1)")
    if not lora.target_modules:
        problems.append(f"{name}.lora.target_modules is empty")
    return problems


def base_dtype(lora_cfg, device: str, master: torch.dtype) -> torch.dtype:
    """Storage dtype of the frozen base: auto = bfloat16 on CUDA, the master dtype on CPU."""
    if lora_cfg.base_dtype in (None, "auto"):
        return torch.bfloat16 if device == "cuda" else master
    return resolve_dtype(lora_cfg.base_dtype, device)


def apply_lora(model: torch.nn.Module, lora_cfg, value_head: bool, frozen_dtype: torch.dtype):
    """Inject adapters into `model` in place (works on `meta` models too); freeze the rest (the
    value head stays trainable) and cast frozen parameters to `frozen_dtype`. Returns the
    PeftModel wrapping `model` (used for adapter switches and export)."""
    from peft import LoraConfig, get_peft_model

    missing = [m for m in lora_cfg.target_modules
               if not any(n.split(".")[-1] == m for n, _ in model.named_modules())]
    if missing:
        raise SystemExit(f"lora.target_modules: no module named {missing} in {type(model).__name__}")
    if value_head and not hasattr(model, VALUE_HEAD):
        raise SystemExit(f"lora: {type(model).__name__} has no '{VALUE_HEAD}' value head")
    config = LoraConfig(
        r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        modules_to_save=[VALUE_HEAD] if value_head else None)
    peft_model = get_peft_model(model, config)
    config.base_model_name_or_path = getattr(model, "name_or_path", None)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.dtype != frozen_dtype:
                p.data = p.data.to(frozen_dtype)
    return peft_model


@contextlib.contextmanager
def adapters_disabled(peft_model):
    """The base model (adapters and the trained head copy bypassed) inside the block."""
    peft_model.base_model.disable_adapter_layers()
    try:
        yield
    finally:
        peft_model.base_model.enable_adapter_layers()


def scalings(model) -> dict[str, float]:
    """module path -> alpha / rank of every LoRA layer of `model` (none without PEFT installed:
    weight sync calls this for every model, and the vLLM venv has no PEFT)."""
    if importlib.util.find_spec("peft") is None:
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m.scaling["default"] for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_items(items: Iterable[tuple[str, torch.Tensor]], scaling: dict[str, float],
                 copy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model from a (LoRA name, full tensor) stream in state-dict
    order (a module's base_layer comes before its lora_A, lora_B). copy: clone what is held back
    (the input tensors are views reused later, e.g. shared-memory buckets)."""
    held: dict[str, torch.Tensor] = {}
    for name, t in items:
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.")
            if leaf == "weight":
                held[prefix + ".W"] = t.clone() if copy else t
            else:
                yield f"{prefix}.{leaf}", t
        elif ".lora_A.default." in name:
            held[name.split(".lora_A.")[0] + ".A"] = t.clone() if copy else t
        elif ".lora_B.default." in name:
            prefix = name.split(".lora_B.")[0]
            w, a = held.pop(prefix + ".W"), held.pop(prefix + ".A")
            dtype = torch.promote_types(w.dtype, t.dtype)
            delta = (t.to(dtype) @ a.to(dtype)) * scaling[prefix]
            yield f"{prefix}.weight", w.to(dtype) + delta
        elif ".original_module." in name:
            continue  # the untrained copy of the value head
        elif ".modules_to_save.default." in name:
            yield name.replace(".modules_to_save.default", ""), t
        else:
            yield name, t
    if held:
        raise RuntimeError(f"LoRA merge: base weights without adapters: {sorted(held)[:3]}")


def save_adapter(peft_model, state: dict, out_dir: str):
    """PEFT format (`PeftModel.from_pretrained(base, out_dir)` loads it) from the full state
    dict of the injected HF model (rank 0)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    prefixed = {f"base_model.model.{k}": v for k, v in state.items()}
    adapter = get_peft_model_state_dict(peft_model, state_dict=prefixed, save_embedding_layers=False)
    save_file({k: v.contiguous() for k, v in adapter.items()},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(out_dir)  # adapter_config.json


# ---------------------------------------------------------------------- adapter-only weight sync
def is_adapter(name: str) -> bool:
    """A lora_A / lora_B weight of the injected model's state dict."""
    return any(m in name for m in ADAPTER_MARKS)


def peft_name(name: str) -> str:
    """State-dict name -> the name PEFT saves (`PeftModel.save_pretrained`): the PeftModel's
    `base_model.model.` prefix, without the adapter name."""
    for mark in ADAPTER_MARKS:
        name = name.replace(mark, mark.replace("default.", ""))
    return "base_model.model." + name


def adapter_config(model) -> dict | None:
    """The adapter_config.json fields (PEFT's LoraConfig) of the adapters injected into `model`,
    for engines that load adapters; None without LoRA layers."""
    if importlib.util.find_spec("peft") is None:
        return None
    from peft.tuners.lora import LoraLayer

    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not layers:
        return None
    ranks = {m.r["default"] for m in layers.values()}
    alphas = {m.lora_alpha["default"] for m in layers.values()}
    if len(ranks) > 1 or len(alphas) > 1:  # RL2 sets one rank/alpha for every target
        raise ValueError(f"LoRA layers with mixed ranks {ranks} / alphas {alphas}")
    return {"peft_type": "LORA", "r": ranks.pop(), "lora_alpha": alphas.pop(), "lora_dropout": 0.0,
            "target_modules": sorted({n.rsplit(".", 1)[-1] for n in layers}), "bias": "none",
            "base_model_name_or_path": getattr(model, "name_or_path", None)}


def write_adapter(out_dir: str, named_tensors, config: dict) -> int:
    """Write (PEFT name, tensor) pairs and their config as a PEFT adapter directory (what
    `PeftModel.from_pretrained` and vLLM's LoRA loader read); returns the bytes written. Needs
    no PEFT (engine environments may lack it)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in named_tensors}
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_root(lora_dir: str | None) -> str:
    """A new directory of this engine's own for its synced adapters (the engine deletes it at
    shutdown): inside `lora_dir`, so engines and runs sharing one never collide, or by default
    a temporary one (in /dev/shm when there is one: the engine reads it back at once)."""
    if lora_dir:  # absolute: the engine (maybe a server in another directory) reads the path
        lora_dir = os.path.abspath(os.path.expanduser(lora_dir))
        os.makedirs(lora_dir, exist_ok=True)
    return tempfile.mkdtemp(prefix="rl2-lora-", dir=lora_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None))


class AdapterVersions:
    """The synced adapters of one engine or server pool, in a directory of its own
    (`adapter_root`). Each sync writes a PEFT directory under a new name "<root>-v<n>" (vLLM and
    SGLang key cached adapters and prefix blocks by name, and SGLang refuses a loaded name);
    once the engine has loaded it, the previous one's files are deleted."""

    def __init__(self, lora_dir: str | None):
        self.root = adapter_root(lora_dir)
        self.count = 0
        self.current: tuple[str, int, str] | None = None  # (name, id, path) loaded last

    def sync(self, named_tensors, config: dict, load) -> tuple[str, int, str]:
        """Write the adapter, `load(new, previous)` it (the engine's own calls; previous: the
        one to unload, or None), then delete the previous files. Returns the new one."""
        self.count += 1
        name = f"{os.path.basename(self.root)}-v{self.count}"  # unique across engines and runs
        new = (name, self.count, os.path.join(self.root, name))  # id: vLLM's cache key, > 0
        write_adapter(new[2], named_tensors, config)
        previous = self.current
        load(new, previous)
        self.current = new
        if previous is not None:
            shutil.rmtree(previous[2], ignore_errors=True)
        return new

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
