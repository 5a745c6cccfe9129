"""Test doubles shared by the rollout tests and benchmarks (no model involved)."""
import asyncio
from types import SimpleNamespace

from RL2.rollout.engine import Engine, GenerationOutput, check_prompt


def traj(score, source):
    """A finished one-turn trajectory with reward = score from data source `source`: what
    `Rollout.metrics` reads."""
    return SimpleNamespace(reward=score, score=score, num_action_tokens=3, truncated=False, turns=[],
                           num_turns=1, failed=False, extra_info={"data_source": source})


class ScriptedEngine(Engine):
    """Answers call k with the tokenisation of texts[k], or of texts[pick(prompt_ids)] when
    `pick` is given (e.g. by turn, when many trajectories run at once); the logprob of token i of
    call k is -(k+1) - 0.01*i, so tests can tell which call and position each came from.
    `calls` records (prompt_ids, params) of every call. Prompts are checked as every RL2 engine
    checks them (`check_prompt`: none empty, none of `max_model_len` tokens or more)."""

    def __init__(self, tokenizer, texts, pick=None, max_model_len: int = 1 << 30):
        self.ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        self.pick, self.calls, self.max_model_len = pick, [], max_model_len

    async def generate(self, prompt_ids, params):
        check_prompt(prompt_ids, self.max_model_len)
        k = len(self.calls)
        self.calls.append((list(prompt_ids), params))
        ids = self.ids[self.pick(prompt_ids) if self.pick else k]
        await asyncio.sleep(0)  # a real engine yields to the loop
        return [GenerationOutput(list(ids), [-(k + 1) - 0.01 * i for i in range(len(ids))], "stop")]

    def update_weights(self, named_tensors):
        pass

    def release_memory(self, tags=None):
        pass

    def resume_memory(self, tags=None):
        pass

    def shutdown(self):
        pass


# ---------------------------------------------------------------------------------------------
# A fake `sglang.Engine` that enforces SGLang 0.5.23's rules (read from its source; file paths
# are inside the sglang wheel), so adapter mistakes fail on CPU:
# - srt/managers/scheduler_components/weight_updater.py: `release_memory_occupation` adds its
#   tags (None/[] = all of constants.GPU_MEMORY_ALL_TYPES) to `offload_tags`;
#   `resume_memory_occupation` does `offload_tags.remove(tag)` -> KeyError for a tag that is not
#   released (the scheduler process dies). Releasing needs an idle engine (an assert).
# - torch_memory_saver (0.0.10, C++): pausing a paused region fails ("Cannot pause allocation
#   that is not active"), resuming an active one too ("... not paused").
# - same file: `update_weights_from_tensor` outside `begin_weight_update()` /
#   `end_weight_update()` returns (False, "... must run between ..."); a second begin or an end
#   without begin returns (False, ...). The Engine methods return (success, message)
#   (srt/managers/tokenizer_control_mixin.py); release/resume return None.
# - srt/managers/tp_worker.py `deserialize_own_rank`: TP rank i deserialises payload i of a
#   `load_format="flattened_bucket"` update; there must be one payload per TP rank.
# - Writing or sampling with released weight / KV memory is undefined on a GPU (garbage or a
#   CUDA fault); the fake raises.
# - LoRA (srt/managers/tokenizer_control_mixin.py load/unload_lora_adapter, srt/lora/): without
#   `enable_lora` every load fails; a loaded name cannot be loaded again (lora_manager.py); an
#   adapter of a rank or modules beyond `max_lora_rank` / `lora_target_modules` does not fit the
#   memory pool; unloading or generating with a name that is not loaded fails (lora_registry.py).
#   Failures return LoRAUpdateOutput(success=False, error_message); generate raises ValueError.
# - Releasing "weights" frees the parameters without a copy (scheduler_components/
#   weight_updater.py keeps only buffers) unless `enable_weights_cpu_backup` (the weights region
#   is then backed up, load_model_utils.py): generating before the next full push is garbage.
# ---------------------------------------------------------------------------------------------
import json
import os
import pickle
from dataclasses import dataclass

SGLANG_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES
# The `sglang.Engine` methods RL2/rollout/sglang_engine.py (and FakeSGLang) use, with the keyword
# parameters passed to each: checked against the 0.5.23 source (tests/test_sglang_source.py) and,
# where sglang is installed, the imported class (tests/test_sglang_contract.py).
SGLANG_ENGINE_METHODS = {
    "async_generate": {"input_ids", "sampling_params", "return_logprob", "lora_path"},
    "load_lora_adapter": {"lora_name", "lora_path"},
    "unload_lora_adapter": {"lora_name"},
    "update_weights_from_tensor": {"named_tensors", "load_format", "flush_cache"},
    "begin_weight_update": set(),
    "end_weight_update": set(),
    "release_memory_occupation": {"tags"},
    "resume_memory_occupation": {"tags"},
    "flush_cache": set(),
    "shutdown": set(),
    "get_server_info": set(),
}


@dataclass
class LoRAUpdateOutput:
    """sglang/srt/managers/io_struct.py LoRAUpdateOutput (0.5.23), the fields RL2 reads."""
    success: bool
    error_message: str | None = None


class FakeSGLang:
    """Stands in for `sglang.Engine(**server_args)`; `calls` records every call."""

    def __init__(self, **server_args):
        self.server_args, self.calls = server_args, []
        self.env_at_start = dict(os.environ)
        self.loop = asyncio.new_event_loop()
        self.offload_tags: set[str] = set()   # the scheduler's set
        self.paused: set[str] = set()         # torch_memory_saver's regions
        self.session = False
        self.weights: dict = {}
        self.in_flight = 0
        self.fail_update = None  # a message: the next update returns (False, message)
        self.loras: dict[str, dict] = {}  # name -> adapter tensors (the LoRA registry)
        self.weights_lost = False  # released without enable_weights_cpu_backup, not pushed since
        self.context_len = server_args.get("context_length") or 4096  # the model's, else
        self.max_req_input_len = self.context_len - 1 - 5  # tp_worker.py (KV pool unbounded here)

    def get_server_info(self) -> dict:
        """engine.py get_server_info: the resolved server args (context_length stays the flag)
        and the scheduler's init info."""
        return {**self.server_args, "context_length": self.server_args.get("context_length"),
                "max_req_input_len": self.max_req_input_len}

    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False,
                             lora_path=None):
        if self.paused & {"weights", "kv_cache"}:
            raise RuntimeError(f"generate with released memory {sorted(self.paused)}")
        if self.weights_lost:
            raise RuntimeError("generate from weights released without a CPU backup and never pushed again")
        if lora_path is not None and lora_path not in self.loras:  # lora_registry.py acquire()
            raise ValueError(f"The following requested LoRA adapters are not loaded: {lora_path}")
        if len(input_ids) >= self.context_len:  # tokenizer_manager.py: the context check
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length")
        if len(input_ids) + sampling_params.get("max_new_tokens", 128) > self.context_len:
            raise ValueError("Requested token count exceeds the model's maximum context length")
        if len(input_ids) >= self.max_req_input_len:  # the scheduler's abort, status 400:
            # tokenizer_manager.py _handle_abort_finish_reason raises ValueError(message)
            raise ValueError(f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length")
        self.calls.append(("generate", input_ids, dict(sampling_params), return_logprob))
        if lora_path is not None:
            self.calls[-1] += (lora_path,)
        n = len([c for c in self.calls if c[0] == "generate"])
        self.in_flight += 1
        await asyncio.sleep(0)
        self.in_flight -= 1
        return {"text": "xy", "output_ids": [10 + n, 20 + n],
                "meta_info": {"output_token_logprobs": [(-0.5, 10 + n, None), (-0.25, 20 + n, None)],
                              "finish_reason": {"type": "stop" if n % 2 else "length", "matched": 3}}}

    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        if "weights" in self.paused:
            raise RuntimeError("begin_weight_update restores weights in released memory")
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.session:
            return (False, "update_weights_from_tensor must run between begin_weight_update() "
                           "and end_weight_update()")
        if "weights" in self.paused:
            raise RuntimeError("update_weights_from_tensor into released weight memory")
        if load_format == "flattened_bucket":
            tp = self.server_args.get("tp_size", 1)
            if len(named_tensors) != tp:
                raise IndexError(f"{len(named_tensors)} payloads for {tp} TP ranks")
            per_rank = [FakeFlattenedTensorBucket.load(p) for p in named_tensors]
            named = per_rank[0]
        else:
            per_rank, named = None, list(named_tensors)
        self.calls.append(("update", [n for n, _ in named], flush_cache, per_rank))
        if self.fail_update:
            message, self.fail_update = self.fail_update, None
            return False, message
        self.weights.update((n, t.clone()) for n, t in named)
        self.weights_lost = False  # (RL2 always pushes every weight)
        if flush_cache and self.in_flight:
            return False, "Weights were updated, but the cache was not flushed"
        return True, "Success"

    def release_memory_occupation(self, tags=None):
        assert self.in_flight == 0, "release_memory_occupation should be called only when server is idle."
        tags = list(tags) if tags else list(SGLANG_TAGS)
        self.calls.append(("release", tags))
        self.offload_tags.update(tags)
        for tag in tags:
            if tag in self.paused:
                raise RuntimeError("[torch_memory_saver.cpp] Cannot pause allocation that is not active.")
            self.paused.add(tag)
        if "weights" in tags and not self.server_args.get("enable_weights_cpu_backup"):
            self.weights_lost = True

    def resume_memory_occupation(self, tags=None):
        tags = list(tags) if tags else list(SGLANG_TAGS)
        self.calls.append(("resume", tags))
        for tag in tags:
            self.offload_tags.remove(tag)  # KeyError, as in SGLang
        for tag in tags:
            if tag not in self.paused:
                raise RuntimeError("[torch_memory_saver.cpp] Cannot resume allocation that is not paused.")
            self.paused.discard(tag)

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        """tokenizer_control_mixin.py load_lora_adapter / lora_manager.py validate_new_adapter
        (0.5.23): failures come back as LoRAUpdateOutput(success=False, error_message)."""
        from safetensors.torch import load_file

        self.calls.append(("load_lora", lora_name, lora_path))
        args = self.server_args
        if not args.get("enable_lora"):
            return LoRAUpdateOutput(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if lora_name in self.loras:
            return LoRAUpdateOutput(False, f"Failed to load LoRA adapter {lora_name} because it is already loaded")
        try:
            with open(os.path.join(lora_path, "adapter_config.json")) as f:
                config = json.load(f)
            tensors = load_file(os.path.join(lora_path, "adapter_model.safetensors"))
        except OSError as e:
            return LoRAUpdateOutput(False, str(e))
        # the LoRA memory pool is sized at start-up by max_lora_rank and lora_target_modules
        if config["r"] > args["max_lora_rank"] or not set(config["target_modules"]) <= set(args["lora_target_modules"]):
            return LoRAUpdateOutput(False, f"LoRA adapter {lora_name} with rank {config['r']} is incompatible")
        self.loras[lora_name] = tensors
        return LoRAUpdateOutput(True, None)

    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload_lora", lora_name))
        if lora_name not in self.loras:  # lora_registry.py unregister()
            return LoRAUpdateOutput(False, f"LoRA with name {lora_name} does not exist.")
        del self.loras[lora_name]
        return LoRAUpdateOutput(True, None)

    def flush_cache(self):
        return True

    def shutdown(self):
        self.calls.append(("shutdown",))


class FakeFlattenedTensorBucket:
    """sglang/srt/weight_sync/tensor_bucket.py FlattenedTensorBucket, same constructor and
    accessors; payloads are plain pickles instead of CUDA-IPC handles."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if not named_tensors:
            raise ValueError("Cannot create empty tensor bucket")
        self.named = [(n, t.detach().clone()) for n, t in named_tensors]

    def get_flattened_tensor(self):
        return self.named

    def get_metadata(self):
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.named]

    @staticmethod
    def load(payload):
        return pickle.loads(payload)["flattened_tensor"]


class FakeSerializer:
    @staticmethod
    def serialize(obj, output_str=False):
        return pickle.dumps(obj)


class FakeSamplingParams:
    def __init__(self, max_new_tokens=128, stop=None, stop_token_ids=None, temperature=1.0, top_p=1.0,
                 top_k=-1, skip_special_tokens=True, sampling_seed=None):
        pass


def install_fake_sglang(monkeypatch):
    """Put fake `sglang` modules into sys.modules (what the adapter imports)."""
    import sys
    import types

    names = ["sglang", "sglang.srt", "sglang.srt.sampling", "sglang.srt.sampling.sampling_params",
             "sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.utils.patch_torch",
             "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["sglang"].Engine = FakeSGLang
    mods["sglang.srt.sampling.sampling_params"].SamplingParams = FakeSamplingParams
    mods["sglang.srt.utils.common"].MultiprocessingSerializer = FakeSerializer
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: None
    mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorBucket = FakeFlattenedTensorBucket
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    return mods


LORA_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
               "bias": "none"}


def lora_tensors(seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn"
    return [(f"{prefix}.{m}.lora_{ab}.weight", torch.randn(shape, generator=g))
            for m in ("q_proj", "v_proj") for ab, shape in (("A", (4, 8)), ("B", (8, 4)))]
