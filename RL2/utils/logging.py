"""Rank-0 console logging, a tqdm progress bar and metric sinks (JSONL always; wandb and
TensorBoard when enabled)."""
import json
import logging
import os
import re
import time

import torch.distributed as dist


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def setup_logging(level=logging.INFO):
    """Console lines from rank 0 only; other ranks log warnings and errors."""
    logging.basicConfig(
        level=level if is_rank0() else logging.WARNING, force=True,
        format="%(asctime)s [RL2] %(message)s" if is_rank0() else "%(asctime)s [RL2 rank %(rank)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Per-file progress bars of datasets/transformers drown the training bar.
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def keep_rows_up_to(path: str, step: int):
    """Drop the rows of `metrics.jsonl` logged after `step` (by a run that went on past its last
    checkpoint before it died), so a resumed run's file holds every step once. A line cut off by
    the kill is dropped too; the file is replaced atomically."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # blank, or the half-written last line of a killed run
            if row.get("step", 0) <= step:
                kept.append(json.dumps(row) + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


_DUMP = re.compile(r"(?:test_)?step(\d+)\.jsonl")


def drop_dumps_after(rollout_dir: str, step: int) -> None:
    """On resume from the checkpoint of `step`: delete the rollout dumps `{,test_}step{N}.jsonl`
    with N > step written by the crashed run (the replayed steps write them again). Rank 0 only."""
    if not is_rank0() or not os.path.isdir(rollout_dir):
        return
    for name in os.listdir(rollout_dir):
        m = _DUMP.fullmatch(name)
        if m and int(m.group(1)) > step:
            os.remove(os.path.join(rollout_dir, name))


class MetricLogger:
    """Writes each step's metrics to `metrics.jsonl` (and wandb / TensorBoard) on rank 0."""

    def __init__(self, log_dir: str, config: dict, total_steps: int, use_wandb=False,
                 use_tensorboard=False, project="RL2", name="run", initial_step=0):
        self.active = is_rank0()
        self.wandb = self.tb = self.bar = None
        if not self.active:
            return
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, "metrics.jsonl")
        if initial_step and os.path.exists(path):
            keep_rows_up_to(path, initial_step)  # a resume: rows after the checkpoint are redone
        self.file = open(path, "a")
        if use_wandb:
            import wandb

            self.wandb = wandb.init(project=project, name=name, config=config, dir=log_dir)
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=initial_step, desc=name, dynamic_ncols=True)

    def log(self, metrics: dict, step: int, advance: bool = True):
        if not self.active:
            return
        metrics = {k: (float(v) if hasattr(v, "item") or isinstance(v, (int, float)) else v)
                   for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)
        if advance and self.bar is not None:
            self.bar.update(1)
            shown = {k.split("/")[-1]: f"{v:.4g}" for k, v in metrics.items()
                     if isinstance(v, float) and k.split("/")[-1] in ("loss", "grad_norm", "accuracy", "reward")}
            self.bar.set_postfix(shown, refresh=False)
        line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        logging.getLogger("RL2").info(f"step {step}: {line}")

    def close(self):
        if not self.active:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
