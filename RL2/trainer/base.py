"""What every trainer shares: process group, seeds, run directory, tokenizer, data, metrics,
checkpoint save/resume."""
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from RL2.data.io import load_rows, split_train_test
from RL2.data.loader import StepSampler
from RL2.parallel.mesh import init_distributed
from RL2.utils import checkpoint
from RL2.utils.config import load_config
from RL2.utils.logging import MetricLogger, is_rank0, setup_logging

logger = logging.getLogger("RL2")


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Subclasses build their workers, then implement `train_step(step)` and `evaluate()`."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.device = init_distributed(cfg.trainer.device)
        setup_logging()
        self.validate_layouts()
        seed_everything(cfg.trainer.seed)
        self.run_dir = os.path.abspath(os.path.join(cfg.trainer.save_dir, cfg.trainer.experiment_name))
        if is_rank0():
            os.makedirs(self.run_dir, exist_ok=True)
            OmegaConf.save(cfg, os.path.join(self.run_dir, "config.yaml"))
        from transformers import AutoTokenizer

        actor = cfg.actor
        self.tokenizer = AutoTokenizer.from_pretrained(
            actor.tokenizer_name or actor.model_name, trust_remote_code=actor.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        logger.info(f"world size {dist.get_world_size()} on {self.device}; run dir {self.run_dir}")
        self.step = 0

    def validate_layouts(self):
        """Mesh sizes must divide the world size: checked before any data or model is loaded."""
        from RL2.parallel.mesh import ParallelDims

        for name in ("actor", "critic"):
            w = self.cfg.get(name)
            if w is None:
                continue
            try:
                ParallelDims(dist.get_world_size(), w.ddp_size, w.tp_size, w.sp_size)
            except ValueError as e:
                raise SystemExit(f"{name}: {e}".replace("actor.", f"{name}."))

    # ----- data -----
    def load_splits(self, tokenize) -> tuple[list, list]:
        """Tokenise train and test rows up front (bad rows stop the run here, before any model
        is built, unless data.train.skip_bad_rows counts and skips them)."""
        data = self.cfg.data
        rows = load_rows(data.train.path)
        test_rows, test_source = None, None
        if data.test.path:
            test_rows, test_source = load_rows(data.test.path), data.test.path
        elif data.test_ratio > 0:
            rows, test_rows = split_train_test(rows, data.test_ratio, self.cfg.trainer.seed)
            test_source = f"{data.train.path} (test_ratio split)"
        train = self._tokenize_all(rows, data.train.path, tokenize)
        test = self._tokenize_all(test_rows, test_source, tokenize) if test_rows is not None else []
        logger.info(f"data: {len(train)} train and {len(test)} test examples")
        return train, test

    def _tokenize_all(self, rows, source, tokenize) -> list:
        out, skipped = [], 0
        for i, row in enumerate(rows):
            try:
                out.append(tokenize(row, row_index=i, source=source))
            except ValueError as e:
                if not self.cfg.data.train.skip_bad_rows:
                    raise SystemExit(f"bad data: {e}\n(set data.train.skip_bad_rows=true to skip and count such rows)")
                skipped += 1
                if skipped <= 5:
                    logger.warning(f"skipping: {e}")
        if skipped:
            logger.warning(f"skipped {skipped} of {len(rows)} rows of {source} (data.train.skip_bad_rows=true)")
        if not out:
            raise SystemExit(f"no usable rows in {source}")
        return out

    def total_steps(self, n_train: int, batch_size: int) -> int:
        sampler = StepSampler(n_train, batch_size, self.cfg.trainer.seed)
        self.sampler = sampler
        steps = sampler.steps_per_epoch * self.cfg.trainer.n_epochs
        if self.cfg.trainer.total_steps:
            steps = self.cfg.trainer.total_steps
        return steps

    # ----- metrics / checkpoints -----
    def make_metric_logger(self, total_steps: int) -> MetricLogger:
        t = self.cfg.trainer
        return MetricLogger(
            t.log_dir or self.run_dir, OmegaConf.to_container(self.cfg, resolve=True), total_steps,
            use_wandb=t.use_wandb, use_tensorboard=t.use_tensorboard, project=t.project,
            name=t.experiment_name, initial_step=self.step)

    def trained_workers(self) -> dict:
        return {"actor": self.actor}

    def batch_step(self, step: int, update) -> dict:
        """One optimizer step of a supervised trainer: `update(batch) -> metrics` on this step's
        batch, plus timing and throughput."""
        start = time.perf_counter()
        metrics = update([self.train_data[i] for i in self.sampler.batch(step)])
        elapsed = time.perf_counter() - start
        metrics.update(step_time=elapsed, tokens_per_s=metrics["tokens"] / elapsed)
        return {f"train/{k}": v for k, v in metrics.items()}

    def save(self, step: int):
        checkpoint.save_checkpoint(self.run_dir, step, self.trained_workers(), self.tokenizer,
                                   {"config": OmegaConf.to_container(self.cfg, resolve=True)},
                                   keep_last=self.cfg.trainer.keep_last)

    def maybe_resume(self):
        src = self.cfg.trainer.load_ckpt_from
        if src:
            path = checkpoint.resolve_ckpt(src, self.run_dir)
            state = checkpoint.load_checkpoint(path, self.trained_workers())
            self.step = state["step"]

    def save_final(self):
        for name, w in self.trained_workers().items():
            out = os.path.join(self.run_dir, "final" if name == "actor" else f"final_{name}")
            checkpoint.save_hf(w.model, out, self.tokenizer)
        logger.info(f"saved final model to {os.path.join(self.run_dir, 'final')}")

    def fit(self, total_steps: int):
        """The outer loop every trainer shares: step, log, test, save."""
        t = self.cfg.trainer
        metrics_log = self.make_metric_logger(total_steps)
        if t.eval_only:
            metrics_log.log(self.evaluate(), self.step, advance=False)
            metrics_log.close()
            return
        if t.test_at_start and self.step == 0:  # where the run started (not repeated on resume)
            start_eval = self.evaluate()
            if start_eval:
                metrics_log.log(start_eval, 0, advance=False)
        while self.step < total_steps:
            metrics = self.train_step(self.step)
            self.step += 1
            if t.test_freq and self.step % t.test_freq == 0:
                metrics.update(self.evaluate())
            metrics_log.log(metrics, self.step)
            if t.save_freq and self.step % t.save_freq == 0:
                self.save(self.step)
            if os.environ.get("RL2_CRASH_AFTER_STEP") == str(self.step):
                os._exit(17)  # fault injection for the resume tests: die like a killed job
        if not t.test_freq or self.step % t.test_freq:
            final_eval = self.evaluate()
            if final_eval:
                metrics_log.log(final_eval, self.step, advance=False)
        metrics_log.close()
        self.save_final()

    @classmethod
    def launch(cls, config_name: str) -> None:
        """`torchrun -m RL2.trainer.<config_name> key=value ...`: build, train, close."""
        trainer = cls(load_config(config_name))
        trainer.fit(trainer.n_steps)
        trainer.close()

    def close(self):
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
