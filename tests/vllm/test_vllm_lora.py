"""LoRA adapter-only weight sync into real vLLM engines (`actor.rollout.lora_sync`): every step
only the adapters move (sync/bytes), written as a PEFT directory that vLLM loads as a new
adapter; while the adapters move (lr 1e-2, the KL to the adapter-free reference grows), vLLM's
log-probs of its samples equal the trainer's (base + adapters) at every step (engine_kl; an
engine serving the base or a stale adapter would drift). In process (colocated AsyncLLM, 2 ranks,
FSDP2 shards gathered) and against a `vllm serve` (disaggregated, 1 rank)."""
import json
from urllib.request import urlopen

import pytest

from tests.run_utils import LENGTH_ENV, read_metrics, run_trainer
from tests.vllm.conftest import tiny_vllm_model
from tests.vllm.vllm_utils import connect, start_vllm_server, stop_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
STEPS, RANK, HIDDEN = 3, 8, 64


@pytest.fixture(scope="module")
def setup(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_lora")
    env = root / "env.py"
    env.write_text(LENGTH_ENV)
    return {"model": tiny_vllm_model(assets["tokenizer"], str(root / "model"), hidden=HIDDEN),
            "env": str(env), "data": assets["data"]}


def lora_args(s, *extra):
    # tis_coef: the trainer recomputes old log-probs, hence rollout/engine_kl, every step
    return [f"actor.model_name={s['model']}", f"data.train.path={s['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={s['env']}", f"actor.lora.rank={RANK}", "actor.lora.alpha=16",
            "actor.lr=1e-2", "actor.tis_coef=100.0", "kl.coef=0.1", "kl.type=loss",
            "actor.rollout.max_length=128", "actor.rollout.prompts_per_rollout=8",
            "actor.rollout.responses_per_prompt=4", "actor.rollout.train_sampling_params.max_new_tokens=6",
            f"trainer.total_steps={STEPS}", *extra]


def adapter_bytes() -> int:
    """fp32 lora_A (r x in) + lora_B (out x r) of the 7 targets in each of the 2 layers of
    tiny_vllm_model (q/o: hidden x hidden, k/v: hidden x 32 (1 kv head of 32), MLP: 2 * hidden)."""
    h, kv, mlp = HIDDEN, 32, 2 * HIDDEN
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, mlp), (h, mlp), (mlp, h)]  # (in, out)
    return 2 * sum(RANK * (i + o) * 4 for i, o in shapes)


def check(run_dir):
    rows = [r for r in read_metrics(run_dir) if "rollout/reward" in r]
    assert len(rows) == STEPS and all(r["rollout/failed"] == 0 for r in rows)
    # the adapters start as a no-op (B = 0) and move: the policy leaves the base model ...
    kl = [r["actor/kl_loss"] for r in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-12) and kl[-1] > 1e-5, kl
    # ... and vLLM follows it: fp32 on both sides, kernel rounding only
    assert max(abs(r["rollout/engine_kl"]) for r in rows) < 1e-4, [r["rollout/engine_kl"] for r in rows]
    # only adapter bytes travel (the initial sync is logged at start-up, not as a step)
    assert all(r["sync/bytes"] == adapter_bytes() for r in rows), [r["sync/bytes"] for r in rows]


def test_colocated_vllm_serves_the_synced_adapter(setup, tmp_path):
    run_trainer("ppo", 2, lora_args(setup, "actor.rollout.engine=vllm", "actor.rollout.tp_size=2",
                                    "actor.rollout.vllm.kv_cache_mb=64"), tmp_path, timeout=1500)
    check(tmp_path)


def test_vllm_serve_loads_each_adapter_over_http(setup, assets, tmp_path):
    log = tmp_path / "server.log"
    proc, url = start_vllm_server(setup["model"], log, "--enable-lora", "--max-lora-rank", str(RANK),
                                  "--max-cpu-loras", "2", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        connect(proc, url, assets["tokenizer"], log).shutdown()
        run_trainer("ppo", 1, lora_args(
            setup, "actor.rollout.placement=disaggregated", f"actor.rollout.servers=[{url.removeprefix('http://')}]",
            "actor.rollout.lora_sync=adapter", f"actor.rollout.lora_dir={tmp_path / 'adapters'}"),
            tmp_path / "run", timeout=1500)
        check(tmp_path / "run")
        assert json.load(urlopen(f"{url}/weight_info", timeout=30)) == {"weight_version": str(STEPS)}
        # every adapter was unloaded (each older one by the next sync, the last at shutdown: the
        # server may outlive the run), and the run's adapter directory is gone with it
        served = [m["id"] for m in json.load(urlopen(f"{url}/v1/models", timeout=30))["data"]]
        assert len(served) == 1, served
        assert list((tmp_path / "adapters").iterdir()) == []
    finally:
        stop_vllm_server(proc)
