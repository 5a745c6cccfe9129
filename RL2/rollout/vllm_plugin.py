"""Worker side of the `rl2_gloo` weight-transfer backend (loaded inside vLLM's worker processes
through the factory entry registered by `RL2.rollout.vllm_transfer.register`). Wire format and
trainer side: RL2/rollout/vllm_transfer.py."""
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from RL2.rollout.vllm_transfer import open_group, unpack, layout, worker_rank


@dataclass
class GlooInitInfo:
    host: str
    port: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo:
    names: list
    dtype_names: list
    shapes: list

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("rl2_gloo update_info: names, dtype_names and shapes differ in length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = worker_rank(self.parallel_config, init_info.world_size)
        self.group = open_group(init_info.host, init_info.port, rank, init_info.world_size,
                                init_info.timeout_s)

    # As vLLM's NCCL backend: the checkpoint-format weights load inside vLLM's layerwise-reload
    # bracket, which restores the loaders that post-load processing (e.g. the CPU backend's
    # repacked linear weights) removed, and re-runs that processing at the end.
    def start_weight_update(self) -> None:
        if self.group is None:
            raise RuntimeError("rl2_gloo: init_weight_transfer_engine was not called")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), meaningless on CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        _, size = layout(info.shapes, dtypes)
        buffer = torch.empty(size, dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()
        weights = unpack(buffer, info.names, info.shapes, dtypes)
        self.model.load_weights([(n, t.to(self.device)) for n, t in weights])

    def shutdown(self) -> None:
        self.group = None
