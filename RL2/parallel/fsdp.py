"""Applies FSDP2, activation checkpointing and the whole parallelisation plan to an HF model.

Order (torchtitan style): tensor parallel -> activation checkpointing -> FSDP2.
"""
import logging

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from RL2.parallel.mesh import ParallelDims

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF decoder (CausalLM or TokenClassification)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__}")
    return list(layers)


def apply_activation_checkpointing(model: nn.Module):
    """Recompute each decoder layer in backward (HF's own mechanism; non-reentrant)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logger.info("Applied activation checkpointing to the model")


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The modules `fully_shard` made into FSDP units (decoder layers and the root)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: nn.Module) -> None:
    """Free every unit's gathered parameters (FSDPModule.reshard is per unit, not recursive)."""
    for unit in fsdp_units(model):
        unit.reshard()


def resolve_reshard(value, device_type: str) -> bool:
    """`reshard_after_forward`: true, false, or "auto" = false on the CPU (host memory is
    plentiful and each all-gather is a copy through shared memory or TCP that the step waits
    for) and true on GPUs (memory is what runs out; NCCL is fast)."""
    if value == "auto":
        return device_type == "cuda"
    if not isinstance(value, bool):
        raise ValueError(f"reshard_after_forward={value!r}: expected true, false or auto")
    return value


def whole_on_one_rank(model: nn.Module, dims: ParallelDims, param_dtype: torch.dtype) -> bool:
    """True when FSDP would have nothing to do: one CPU rank holds every parameter (no data or
    tensor parallel peers) already in the compute dtype (no mixed-precision cast). FSDP2 on a
    one-rank mesh still copies every parameter into a fresh buffer before each forward and every
    gradient twice after each backward (torch 2.13, `FSDPParamGroup.wait_for_unshard` and
    `foreach_reduce`'s world-size-1 branch), and its DTensor parameters send the optimizer
    through DTensor dispatch: ~10% of a one-process CPU training step (benchmarks/README.md,
    fix 30). GPUs keep FSDP (its bf16 cast; not measured here)."""
    return (dims.device_type == "cpu" and dims.ddp * dims.fsdp * dims.tp == 1
            and all(p.dtype == param_dtype for p in model.parameters()))


def apply_fsdp(model: nn.Module, dims: ParallelDims, param_dtype: torch.dtype,
               offload_params: bool = False, reshard_after_forward: bool = True,
               cpu_comm: str = "shm"):
    """Shard with FSDP2.

    Steps:
    1. each decoder layer is its own FSDP unit (all-gathered just in time);
    2. the root unit keeps embeddings, final norm and the head together, so a tied
       embedding / lm_head stays one parameter;
    3. gradients are SUMMED over the data-parallel ranks (divide factor 1): losses are already
       normalised by global token / sequence counts, so averaging would divide twice;
    4. on the CPU with cpu_comm="shm", the units' all-gathers and reduce-scatters go through
       shared memory when the ranks share a host (RL2/parallel/host_comm.py), not gloo's TCP.
    """
    if whole_on_one_rank(model, dims, param_dtype):
        logger.info("Applied FSDP: skipped, one CPU rank holds the whole model in its compute dtype")
        return
    reduce_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mesh=dims.fsdp_mesh, mp_policy=mp)
    if offload_params and dims.device_type != "cpu":  # on CPU the parameters are there already
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    for unit in fsdp_units(model):
        # Plain SUM collectives with no scaling (gloo has no PREMUL_SUM). On a one-rank mesh
        # there is nothing to sum and no factor is set: torch 2.13's FSDP2 would otherwise divide
        # every gradient by 1.0 into a fresh copy (foreach_reduce's world-size-1 branch; ~2% of
        # a one-process update step on the CPU, benchmarks/README.md fix 22)
        if dims.ddp * dims.fsdp > 1:
            unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    if dims.device_type == "cpu" and cpu_comm == "shm" and dims.fsdp > 1:
        from RL2.parallel import host_comm

        host_comm.install(model)
    kind = "HSDP" if dims.ddp > 1 else "FSDP"
    logger.info(f"Applied {kind} to the model (ddp={dims.ddp}, fsdp={dims.fsdp}, "
                f"reshard_after_forward={reshard_after_forward})")


def parallelize(model: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype,
                gradient_checkpointing: bool = False, offload_params: bool = False,
                reshard_after_forward: bool = True, cpu_comm: str = "shm"):
    """The one place that decides how a model is parallelised."""
    if dims.tp > 1:
        from RL2.parallel.tensor_parallel import apply_tp

        apply_tp(model, dims.tp_mesh)  # validates head/vocab divisibility first
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, dims, param_dtype, offload_params, reshard_after_forward, cpu_comm)
    return model
