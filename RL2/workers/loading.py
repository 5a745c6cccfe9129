"""Building a worker's sharded model: the checkpoint is read once, on rank 0; every other rank
builds the model on the `meta` device, so a host holds one full copy instead of one per rank.

Steps (world > 1):
1. rank 0 reads the HF checkpoint on the host (its state dict is the one full copy);
2. every rank builds the architecture on meta and parallelises it (TP, activation
   checkpointing, FSDP2), then allocates its shards (`to_empty`);
3. each full tensor (parameters and every buffer, rotary `inv_freq` included) is broadcast from
   rank 0 in turn, and every rank copies its shard out of it.
"""
import torch
import torch.distributed as dist

from RL2.parallel.attention import register


def model_config(path: str, value_head: bool, trust_remote_code: bool):
    from transformers import AutoConfig

    if not value_head:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """HF token-classification heads apply dropout 0.1 by default; a value model is trained
    without it (values would be noisy and depend on the micro-batching). Recorded in the config
    too (not every config declares the key), so the saved checkpoint evaluates the same way."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.config.classifier_dropout = 0.0
    return model


def load_hf_model(path: str, value_head: bool, dtype: torch.dtype, trust_remote_code=False,
                  on_meta: bool = False):
    """The HF model of `path` (a causal LM, or a 1-label token classifier for values: a causal-LM
    checkpoint gets a fresh head). on_meta: the architecture only, no weights read."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    config = model_config(path, value_head, trust_remote_code)
    kw = dict(attn_implementation=register(), dtype=dtype, trust_remote_code=trust_remote_code)
    if on_meta:
        with torch.device("meta"):
            model = cls.from_config(config, **kw)
    else:
        model = cls.from_pretrained(path, config=config, **kw)
    return disable_dropout(model) if value_head else model


def load_sharded(path: str, value_head: bool, dtype: torch.dtype, trust_remote_code: bool,
                 parallelize, device: torch.device, prepare=None):
    """A model loaded once and sharded by `parallelize(model)`, its shards on `device`.
    prepare(model): changes every built model (real or meta) in place first (e.g. LoRA adapters,
    drawn on rank 0 and broadcast like the weights)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prepare = prepare or (lambda m: None)
    if world == 1:
        model = load_hf_model(path, value_head, dtype, trust_remote_code)
        prepare(model)
        parallelize(model)
        return model.to(device)
    full = {}
    if rank == 0:
        real = load_hf_model(path, value_head, dtype, trust_remote_code)
        prepare(real)
        full = {**real.state_dict(), **dict(real.named_buffers())}  # the only full copy on the host
        del real
    # Every rank shards a meta model: sharding real tensors (TP's distribute_tensor) would be
    # a collective that only rank 0 enters.
    model = load_hf_model(path, value_head, dtype, trust_remote_code, on_meta=True)
    prepare(model)
    parallelize(model)
    model.to_empty(device=device)
    broadcast_from_rank0(model, full)
    return model


@torch.no_grad()
def broadcast_from_rank0(model, full: dict) -> None:
    """Fill every parameter and buffer of a sharded `model` from rank 0's full tensors, one
    tensor at a time: a rank holds its shards plus one full tensor at most. (`set_model_state_dict(
    broadcast_from_rank0=True)` keeps each broadcast full tensor alive until the end, as its shard
    is a view of it: a whole model per rank at the peak.)"""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from RL2.parallel.collectives import group_device

    wire = group_device()
    targets = {**model.state_dict(keep_vars=True), **dict(model.named_buffers())}
    for name, target in targets.items():  # same names, same order on every rank
        if dist.get_rank() == 0:
            buf = full[name].detach().to(wire, target.dtype)
        else:
            buf = torch.empty(target.shape, dtype=target.dtype, device=wire)
        dist.broadcast(buf, src=0)
        if isinstance(target, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                target.shape, target.device_mesh, target.placements)
            target._local_tensor.copy_(buf[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        else:
            target.copy_(buf)
        del buf
