"""The SGLang facts RL2's adapter and `tests/fakes.py::FakeSGLang` rely on, checked against the
real sglang 0.5.23 source (tests/sources.py: the wheel, cached in $RL2_SGLANG_CACHE, default
~/.cache/rl2/sglang-0.5.23, parsed with `ast`; no import, no GPU). Skips (saying why) only when
the wheel cannot be downloaded (offline)."""
import ast
import zipfile
from pathlib import Path

import pytest

from RL2.rollout import sglang_engine
from tests.fakes import SGLANG_ENGINE_METHODS
from tests.sources import CACHE, SGLANG, download, find, params, tree

MEMORY_SAVER = "torch_memory_saver==0.0.10"  # what sglang 0.5.23 (>=0.0.9.post1) resolves to today


@pytest.fixture(scope="module")
def src() -> Path:
    return download(SGLANG, CACHE)


def fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)}


def source_of(path: Path, node) -> str:
    return ast.get_source_segment(path.read_text(), node)


def test_engine_methods_and_parameters(src):
    init = (src / "__init__.py").read_text()
    assert 'Engine = LazyImport("sglang.srt.entrypoints.engine", "Engine")' in init
    engine = find(tree(src / "srt/entrypoints/engine.py"), "Engine", ast.ClassDef)
    methods = {f.name: f for f in engine.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name, needed in SGLANG_ENGINE_METHODS.items():
        assert name in methods, name
        assert needed <= params(methods[name]), (name, params(methods[name]))
    assert isinstance(methods["async_generate"], ast.AsyncFunctionDef)
    assert "self.loop = " in source_of(src / "srt/entrypoints/engine.py", methods["__init__"])


def test_server_args_and_sampling_params(src):
    declared = set()
    for path in (src / "srt/arg_groups/fields").glob("*.py"):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ClassDef):
                declared |= fields(node)
    assert {"model_path", "tp_size", "mem_fraction_static", "enable_memory_saver", "base_gpu_id",
            "port", "nccl_port", "dtype", "log_level", "enable_deterministic_inference"} <= declared
    # no nccl_port: a random free one from 22000-29999, bound later (RL2 passes its own slice's)
    port_args = (src / "srt/server_args.py").read_text()
    assert "if server_args.nccl_port is None:" in port_args
    assert "def get_free_port_below_ephemeral(low=22000, high=29999" in (src / "srt/utils/network.py").read_text()
    sampling = fields(find(tree(src / "srt/sampling/sampling_params.py"), "SamplingParams", ast.ClassDef))
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
            "skip_special_tokens", "sampling_seed"} <= sampling
    # the seed reaches the sampler only in deterministic-inference mode (the adapter warns)
    batch_info = (src / "srt/sampling/sampling_batch_info.py").read_text()
    assert "enable_deterministic_inference" in batch_info and "sampling_seed" in batch_info


def test_memory_tags_and_their_state_machine(src):
    """The rules FakeSGLang enforces: released tags go into a set, resume removes them
    (KeyError when absent), None means all tags, release asserts an idle engine."""
    constants = (src / "srt/constants.py").read_text()
    for tag in sglang_engine.ALL_TAGS:
        assert f'= "{tag}"' in constants
    assert "GPU_MEMORY_ALL_TYPES = [" in constants
    path = src / "srt/managers/scheduler_components/weight_updater.py"
    module = tree(path)
    release = source_of(path, find(module, "release_memory_occupation"))
    resume = source_of(path, find(module, "resume_memory_occupation"))
    assert "self.offload_tags.add(tag)" in release and "is_fully_idle" in release
    assert "self.offload_tags.remove(tag)" in resume
    for body in (release, resume):
        assert "tags = GPU_MEMORY_ALL_TYPES" in body


def test_weight_update_session_and_results(src):
    path = src / "srt/managers/scheduler_components/weight_updater.py"
    module = tree(path)
    update = source_of(path, find(module, "update_weights_from_tensor"))
    assert "if self._session is None:" in update and "success=False" in update
    assert "begin_weight_update() and end_weight_update()" in update
    assert "a weight-update session is already open" in source_of(path, find(module, "begin_weight_update"))
    assert "no weight-update session is open" in source_of(path, find(module, "end_weight_update"))
    mixin = src / "srt/managers/tokenizer_control_mixin.py"
    for name in ("update_weights_from_tensor", "begin_weight_update", "end_weight_update"):
        fn = find(tree(mixin), name)
        assert ast.unparse(fn.returns) == "Tuple[bool, str]", name


def test_flattened_bucket_payloads(src):
    """One serialised {"flattened_tensor", "metadata"} payload per TP rank; rank i reads payload i."""
    bucket = find(tree(src / "srt/weight_sync/tensor_bucket.py"), "FlattenedTensorBucket", ast.ClassDef)
    names = {f.name: f for f in bucket.body if isinstance(f, ast.FunctionDef)}
    assert {"named_tensors", "flattened_tensor", "metadata"} <= params(names["__init__"])
    assert {"get_flattened_tensor", "get_metadata"} <= set(names)
    runner = src / "srt/model_executor/model_runner_components/weight_updater.py"
    text = source_of(runner, find(tree(runner), "_update_weights_from_flattened_bucket"))
    assert 'flattened_tensor_bucket_dict["flattened_tensor"]' in text
    assert 'flattened_tensor_bucket_dict["metadata"]' in text
    worker = src / "srt/managers/tp_worker.py"
    own = source_of(worker, find(tree(worker), "deserialize_own_rank"))
    assert "serialized_named_tensors[get_parallel().tp_rank]" in own
    common = tree(src / "srt/utils/common.py")
    assert "serialize" in {f.name for f in find(common, "MultiprocessingSerializer", ast.ClassDef).body
                           if isinstance(f, ast.FunctionDef)}
    find(tree(src / "srt/utils/patch_torch.py"), "monkey_patch_torch_reductions")


def test_engine_dtype_rule(src):
    """`engine_dtype` mirrors `_get_and_verify_dtype`: fp32 checkpoints are served in fp16."""
    path = src / "srt/configs/model_config.py"
    text = source_of(path, find(tree(path), "_get_and_verify_dtype"))
    assert 'if dtype == "auto":' in text and "torch_dtype = torch.float16" in text
    assert 'model_type.startswith("gemma")' in text and "torch_dtype = torch.bfloat16" in text


def test_torchrun_agent_store_variable():
    """Why SGLang starts with TORCHELASTIC_* scrubbed: torch's c10d store creation turns every
    process into a client when this variable says True."""
    import importlib.util

    path = importlib.util.find_spec("torch.distributed.rendezvous").origin
    assert 'os.environ.get("TORCHELASTIC_USE_AGENT_STORE", None) == str(True)' in Path(path).read_text()


def test_memory_saver_refuses_double_pause_and_resume():
    """The torch_memory_saver rules FakeSGLang enforces, from its compiled messages."""
    root = download(MEMORY_SAVER, CACHE).parent
    blobs = b"".join(p.read_bytes() for p in root.glob("torch_memory_saver_hook_mode_*.so"))
    if not blobs:  # the .so files sit next to the package in this wheel
        with zipfile.ZipFile(next((CACHE / "wheels").glob("torch_memory_saver-*.whl"))) as z:
            blobs = b"".join(z.read(m) for m in z.namelist() if m.endswith(".so"))
    assert b"Cannot pause allocation that is not active." in blobs
    assert b"Cannot resume allocation that is not paused." in blobs


def test_lora_adapter_loading_rules(src):
    """What the adapter-only sync (SGLangEngine.update_adapter) and FakeSGLang's LoRA rules
    rely on: the start-up arguments, the result type and the refusals."""
    declared = set()
    for path in (src / "srt/arg_groups/fields").glob("*.py"):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ClassDef):
                declared |= fields(node)
    assert {"enable_lora", "max_lora_rank", "lora_target_modules", "enable_weights_cpu_backup"} <= declared
    # releasing "weights" keeps only the buffers; the parameters survive only with the CPU backup
    updater = src / "srt/managers/scheduler_components/weight_updater.py"
    release = source_of(updater, find(tree(updater), "release_memory_occupation"))
    assert "stashed_model_static_state = _export_static_state(" in release
    loading = (src / "srt/model_executor/model_runner_components/load_model_utils.py").read_text()
    assert "GPU_MEMORY_TYPE_WEIGHTS,\n        enable_cpu_backup=enable_cpu_backup," in loading
    hook = (src / "srt/arg_groups/lora_hook.py").read_text()
    assert "you need to specify both --max-lora-rank and --lora-target-modules" in hook
    out = find(tree(src / "srt/managers/io_struct.py"), "LoRAUpdateOutput", ast.ClassDef)
    assert {"success", "error_message"} <= fields(out)
    mixin = src / "srt/managers/tokenizer_control_mixin.py"
    load = source_of(mixin, find(tree(mixin), "load_lora_adapter"))
    assert "LoRA is not enabled" in load and "success=False" in load
    assert "because it is already loaded" in (src / "srt/lora/lora_manager.py").read_text()
    registry = src / "srt/lora/lora_registry.py"
    assert "are not loaded" in source_of(registry, find(tree(registry), "acquire"))
    assert "does not exist" in source_of(registry, find(tree(registry), "unregister"))
    engine = src / "srt/entrypoints/engine.py"
    for name in ("load_lora_adapter", "unload_lora_adapter"):  # synchronous: called outside the loop
        assert "self.loop.run_until_complete(" in source_of(engine, find(tree(engine), name))
