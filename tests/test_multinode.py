"""Multi-node is the same command: two torchrun launches (--nnodes=2, node_rank 0 and 1) on this
machine reproduce the single-process SFT run."""
import os
import subprocess
import sys

import pytest

from tests.dist_utils import free_port
from tests.run_utils import assert_close, sft_args, train_rows


@pytest.mark.slow
def test_two_node_sft_equals_serial(assets, serial, tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    args = sft_args(assets, "actor.dtype=float64", "actor.max_length_per_device=64",
                    f"trainer.save_dir={tmp_path}", "trainer.experiment_name=run", "trainer.device=cpu")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
         "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
         "-m", "RL2.trainer.sft", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for node in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "world size 2" in outs[0]
    for key in ("train/loss", "train/grad_norm"):
        assert_close(train_rows(tmp_path, key), train_rows(serial["float64"], key), 1e-10, key)
