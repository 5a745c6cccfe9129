"""Checkpoints: `run_dir/step{N}/` = the model in Hugging Face format (+ tokenizer), a sharded DCP
copy of model and optimizer (reshardable to any layout), scheduler, RNG and trainer state.

Written to `step{N}.tmp` and renamed only when complete, then `latest` is updated atomically, so a
crash while saving never touches the previous checkpoint.
"""
import json
import logging
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict)

logger = logging.getLogger(__name__)


def full_state_dict(model) -> dict:
    """Full (unsharded) CPU state dict on rank 0; empty elsewhere. A collective. Always copies:
    on one rank (a plain model, fsdp.whole_on_one_rank, or a one-rank FSDP mesh) the values
    would otherwise be the live parameters."""
    from torch.distributed.tensor import DTensor

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    live = {(p._local_tensor if isinstance(p, DTensor) else p).data_ptr() for p in model.parameters()}
    return {k: v.clone() if torch.is_tensor(v) and v.data_ptr() in live else v for k, v in state.items()}


def save_hf(model, out_dir: str, tokenizer=None, dtype: torch.dtype | None = None, state=None):
    """Gather the sharded model and write it as a plain HF checkpoint (rank 0 writes).
    state: the full state dict already gathered (rank 0), HF names."""
    state = full_state_dict(model) if state is None else state
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: HF re-creates it from the embedding
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(out_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
            check_tokenizer_reload(tokenizer, out_dir)
    dist.barrier()


def export_worker(worker, out_dir: str, tokenizer=None):
    """A worker's model for users: the HF model; with LoRA, the PEFT adapter in
    `out_dir/adapter` (+ the tokenizer) and, with lora.save_merged, the merged HF model in out_dir."""
    if worker.peft is None:
        return save_hf(worker.model, out_dir, tokenizer)
    from RL2.workers import lora

    state = full_state_dict(worker.model)
    if dist.get_rank() == 0:
        adapter_dir = os.path.join(out_dir, "adapter")
        lora.save_adapter(worker.peft, state, adapter_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(adapter_dir)
            check_tokenizer_reload(tokenizer, adapter_dir)  # users load it from here with the adapter
    if worker.cfg.lora.save_merged:
        merged = dict(lora.merged_items(state.items(), lora.scalings(worker.model))) if state else {}
        save_hf(worker.model, out_dir, tokenizer, state=merged)
    dist.barrier()


def _dcp_options(worker) -> StateDictOptions:
    """LoRA: the frozen base is the model_name checkpoint; only adapters (+ head) and their
    optimizer state are saved and restored."""
    lora = worker.peft is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


PROBE = "The answer is 12.  Ünïcode, tabs\tand 3,456 numbers; don't stop!\n<|im_end|>"


def check_tokenizer_reload(tokenizer, out_dir: str):
    """Warn if the tokenizer saved in `out_dir` reloads (with AutoTokenizer, as users load it)
    to a different tokenisation: transformers rebuilds some model types' tokenizers with their own
    pre-tokenizer whatever tokenizer.json says (e.g. qwen2)."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if reloaded.encode(PROBE) != tokenizer.encode(PROBE):
        logger.warning(
            f"the tokenizer saved in {out_dir} reloads as {type(reloaded).__name__} and splits text "
            f"differently from the {type(tokenizer).__name__} used for training; load the "
            f"tokenizer the run used (actor.tokenizer_name) instead")


def resolve_ckpt(path: str, run_dir: str) -> str:
    if path == "latest":
        latest = os.path.join(run_dir, "latest")
        if not os.path.exists(latest):
            raise FileNotFoundError(f"trainer.load_ckpt_from=latest but {latest} does not exist")
        with open(latest) as f:
            path = os.path.join(run_dir, f.read().strip())
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"trainer.load_ckpt_from: {path} is not a complete RL2 checkpoint "
                                f"(no trainer_state.json)")
    return path


def save_checkpoint(run_dir: str, step: int, workers: dict, tokenizer, trainer_state: dict,
                    keep_last: int | None = None, extra_files: dict | None = None):
    """Collective: every rank calls it. `workers` maps a name to a trained Worker; the first is
    written as the step directory's HF model, the others as HF models in `<name>/`.
    `extra_files`: {file name: object} written by rank 0 with torch.save (e.g. rollout buffers)."""
    hf_worker = next(iter(workers))
    final = os.path.join(run_dir, f"step{step}")
    tmp = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    for name, w in workers.items():
        export_worker(w, tmp if name == hf_worker else os.path.join(tmp, name), tokenizer)
        model_sd, optim_sd = get_state_dict(w.model, w.optimizer, options=_dcp_options(w))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp", name))
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        state = dict(trainer_state, step=step,
                     schedulers={n: w.scheduler.state_dict() for n, w in workers.items()})
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f)
        for name, obj in (extra_files or {}).items():
            torch.save(obj, os.path.join(tmp, name))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = os.path.join(run_dir, "latest.tmp")
        with open(latest_tmp, "w") as f:
            f.write(f"step{step}")
        os.replace(latest_tmp, os.path.join(run_dir, "latest"))
        if keep_last:
            _prune(run_dir, keep_last)
        logger.info(f"saved checkpoint {final}")
    dist.barrier()
    return final


def _prune(run_dir: str, keep_last: int):
    if keep_last < 1:  # steps[:-0] keeps none, steps[:-(-1)] all: every checkpoint would go
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    steps = sorted(int(d[4:]) for d in os.listdir(run_dir)
                   if d.startswith("step") and d[4:].isdigit())
    for s in steps[:-keep_last]:
        shutil.rmtree(os.path.join(run_dir, f"step{s}"), ignore_errors=True)


def load_checkpoint(path: str, workers: dict) -> dict:
    """Restore model/optimizer shards (any layout), schedulers and RNG; returns trainer state."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    for name, w in workers.items():
        options = _dcp_options(w)
        model_sd, optim_sd = get_state_dict(w.model, w.optimizer, options=options)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=os.path.join(path, "dcp", name))
        set_state_dict(w.model, w.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=options)
        w.scheduler.load_state_dict(state["schedulers"][name])
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng_file):  # absent when resuming with more ranks than were saved
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    logger.info(f"resumed from {path} at step {state['step']}")
    return state
