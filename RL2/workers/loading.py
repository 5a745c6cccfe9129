"""Building a worker's sharded model: the checkpoint is read once, on rank 0; every other rank
builds the model on the `meta` device, so a host holds one full copy instead of one per rank.

Steps (world > 1):
1. rank 0 reads the HF checkpoint on the host (its state dict is the one full copy);
2. every rank builds the architecture on meta and parallelises it (TP, activation
   checkpointing, FSDP2), then allocates its shards (`to_empty`);
3. `set_model_state_dict(..., broadcast_from_rank0=True)` sends each full tensor from rank 0
   and every rank keeps its shard;
4. buffers outside the state dict (rotary `inv_freq`, ...) are broadcast from rank 0 as well.
"""
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from RL2.parallel.attention import register


def _config(path: str, value_head: bool, trust_remote_code: bool):
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
    config = _config(path, value_head, trust_remote_code)
    kw = dict(attn_implementation=register(), dtype=dtype, trust_remote_code=trust_remote_code)
    if on_meta:
        with torch.device("meta"):
            model = cls.from_config(config, **kw)
    else:
        model = cls.from_pretrained(path, config=config, **kw)
    return disable_dropout(model) if value_head else model


def load_sharded(path: str, value_head: bool, dtype: torch.dtype, trust_remote_code: bool,
                 parallelize, device: torch.device):
    """A model loaded once and sharded by `parallelize(model)`, its shards on `device`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        model = load_hf_model(path, value_head, dtype, trust_remote_code)
        parallelize(model)
        return model.to(device)
    full, extra = {}, {}
    if rank == 0:
        real = load_hf_model(path, value_head, dtype, trust_remote_code)
        full = real.state_dict()  # the only full copy on the host
        extra = {n: b for n, b in real.named_buffers() if n not in full}
        del real
    # Every rank shards a meta model: sharding real tensors (TP's distribute_tensor) would be
    # a collective that only rank 0 enters.
    model = load_hf_model(path, value_head, dtype, trust_remote_code, on_meta=True)
    parallelize(model)
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    del full
    box = [{n: b.cpu() for n, b in extra.items()}]
    dist.broadcast_object_list(box, src=0)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in box[0].items():
            buffers[name].copy_(value)
    return model
