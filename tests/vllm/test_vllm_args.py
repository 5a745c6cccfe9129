"""The CUDA path's engine arguments, checked against vLLM 0.32's own `AsyncEngineArgs` without a
GPU (NOT RUN on CUDA): a rollout group's engine is tensor parallel over the group's GPUs
(`actor.rollout.tp_size` -> `tensor_parallel_size`, the group's GPUs -> `device_ids`), and every
key RL2 passes on CPU or CUDA is an argument vLLM 0.32 accepts."""
import dataclasses

import pytest
import torch

from RL2.rollout.rollout import engine_kwargs
from RL2.rollout.vllm_engine import engine_args
from RL2.utils.config import load_config

pytestmark = pytest.mark.vllm


def rollout_cfg(*overrides):
    return load_config("ppo", ["actor.model_name=m", "data.train.path=x", "actor.rollout.env_path=x",
                               "actor.rollout.engine=vllm", *overrides]).actor.rollout


def test_cuda_groups_get_tensor_parallel_engines_on_their_own_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = rollout_cfg("actor.rollout.tp_size=2")

    def on_device(d):  # the worker set each rank's device from LOCAL_RANK
        monkeypatch.setattr(torch.cuda, "current_device", lambda: d)

    # 8 ranks on 2 nodes of 4 GPUs: group leaders are ranks 0, 2, 4, 6 on local devices 0, 2, 0, 2
    groups = []
    for rank in (0, 2, 4, 6):
        on_device(rank % 4)
        groups.append(engine_kwargs("vllm", cfg)["device_ids"])
    assert groups == [[0, 1], [2, 3], [0, 1], [2, 3]]
    on_device(1)  # a launch whose ranks do not follow the node's device order
    assert engine_kwargs("vllm", cfg)["device_ids"] == [1, 2]
    assert engine_kwargs("vllm", cfg)["tp_size"] == 2
    # a `vllm serve` process has its own placement
    assert "tp_size" not in engine_kwargs("vllm", rollout_cfg("actor.rollout.tp_size=2",
                                                             "actor.rollout.vllm.server_url=http://h:1"))


def test_cpu_groups_share_one_single_worker_engine():
    kw = engine_kwargs("vllm", rollout_cfg("actor.rollout.tp_size=2"))
    assert "tp_size" not in kw and "device_ids" not in kw  # VLLMEngine's default tp_size=1


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_every_argument_is_one_vllm_0_32_accepts(cuda):
    from vllm.config.parallel import ParallelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = engine_args("/m", cuda=cuda, dtype="bfloat16" if cuda else "float32", max_model_len=256,
                       tp_size=2 if cuda else 1, seed=3, kv_cache_mb=64, device_ids=[2, 3], lora_rank=4)
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(args) <= fields, set(args) - fields
    built = AsyncEngineArgs(**args)  # the dataclass vLLM builds its config from
    assert built.enable_lora and built.max_lora_rank == 8 and built.max_cpu_loras == 2  # rank 4 -> 8
    if cuda:
        assert built.tensor_parallel_size == 2 and built.device_ids == [2, 3]
        assert built.weight_transfer_config.backend == "nccl" and built.enable_sleep_mode
        # where vLLM 0.32 turns device_ids into each worker's GPU (arg_utils -> ParallelConfig)
        assert hasattr(AsyncEngineArgs, "_resolve_device_ids")
        assert "assigned_physical_gpu_ids" in {f.name for f in dataclasses.fields(ParallelConfig)}
    else:
        assert "device_ids" not in args and built.tensor_parallel_size == 1
        assert built.kv_cache_memory_bytes == 64 << 20 and built.enable_chunked_prefill is False


def test_servers_on_cuda_get_vllms_nccl_init_info(monkeypatch):
    """Disaggregated on CUDA (NOT RUN): `transfer_backend=auto` resolves to vLLM's `nccl` for a
    CUDA trainer, and the init info the server client sends is one vLLM 0.32's NCCL engine
    parses (the server's `init_weight_transfer_engine` builds this dataclass from the JSON)."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    from RL2.rollout.remote import transfer_backend
    from RL2.rollout.vllm_server import VLLMServerEngine
    from RL2.rollout.vllm_transfer import GlooSender, NcclSender

    cfg = rollout_cfg("actor.rollout.placement=disaggregated", "actor.rollout.servers=[h:1]")
    assert transfer_backend(cfg, "cuda") == "nccl" and transfer_backend(cfg, "cpu") == "rl2_gloo"
    client = object.__new__(VLLMServerEngine)  # the sender choice only: no server handshake
    client.n_workers, client.timeout_s, client.transfer_host = 2, 30.0, "127.0.0.1"
    client.transfer_backend = "nccl"
    sender = client._new_sender()
    assert isinstance(sender, NcclSender)
    info = NCCLWeightTransferInitInfo(**sender.init_info())
    assert (info.rank_offset, info.world_size, info.master_address) == (1, 3, "127.0.0.1")
    assert info.packed is False  # NcclSender broadcasts tensor by tensor (vLLM's unpacked mode)
    client.transfer_backend = "rl2_gloo"
    gloo = client._new_sender()
    assert isinstance(gloo, GlooSender) and gloo.init_info()["world_size"] == 3
    gloo.close()


def test_nccl_senders_communicator_is_freed_by_destroy():
    """NcclSender.close calls destroy() on what `trainer_init` returns: vLLM's PyNcclCommunicator,
    whose destroy takes no argument (its abort runs in a daemon thread joined for 5 s)."""
    import inspect

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    assert "PyNcclCommunicator" in str(inspect.signature(trainer_init).return_annotation)
    assert list(inspect.signature(PyNcclCommunicator.destroy).parameters) == ["self"]
    assert "join(timeout=" in inspect.getsource(PyNcclCommunicator.destroy)


def test_lora_ranks_are_vllms_max_lora_rank_choices():
    import typing

    from vllm.config.lora import MaxLoRARanks

    from RL2.rollout.vllm_engine import LORA_RANKS, max_lora_rank

    assert LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(ValueError, match="exceeds"):
        max_lora_rank(513)
