"""What every trainer shares: process group, seeds, run directory, tokenizer, data, metrics,
checkpoint save/resume."""
import atexit
import gc
import logging
import os
import time

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from RL2.data.io import load_rows, split_train_test
from RL2.data.loader import StepSampler, eval_batches
from RL2.parallel.mesh import init_distributed
from RL2.utils import checkpoint
from RL2.utils.config import check_optimizer_config, check_run_config, load_config, missing_local_paths
from RL2.utils.logging import MetricLogger, drop_dumps_after, is_rank0, setup_logging
from RL2.utils.process import die_with_torchrun_agent
from RL2.utils.seeding import seed_everything
from RL2.workers.actor import Actor

logger = logging.getLogger("RL2")


def prepare_run_dir(cfg) -> str:
    """The run directory, save_dir/experiment_name. A fresh run refuses a non-empty one (its
    metrics and checkpoints would mix with the old run's); only a resume (trainer.load_ckpt_from)
    writes into an existing run, and only from a checkpoint of that run. The checkpoint path and
    trainer.log_dir are checked here too, before any model loads. Decided on rank 0 for every rank."""
    t = cfg.trainer
    run_dir = os.path.abspath(os.path.join(t.save_dir, t.experiment_name))
    error = [None]
    if is_rank0():
        error[0] = _run_dir_problem(t, run_dir)
        if error[0] is None:
            try:
                os.makedirs(run_dir, exist_ok=True)
            except OSError as e:
                error[0] = f"trainer.save_dir={t.save_dir!r}: cannot create the run directory {run_dir}: {e}"
        if error[0] is None:
            OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise SystemExit(error[0])
    return run_dir


def _run_dir_problem(t, run_dir: str) -> str | None:
    """Why the run cannot start in `run_dir` (rank 0; nothing is written), or None."""
    # A config.yaml alone is a run that stopped before its first step (e.g. on bad data).
    used = os.path.isdir(run_dir) and bool(set(os.listdir(run_dir)) - {"config.yaml"})
    src = t.load_ckpt_from
    if not src and used:
        return (f"the run directory {run_dir} is not empty: pick a new trainer.experiment_name "
                f"(or trainer.save_dir), delete it, or resume with trainer.load_ckpt_from=latest")
    if src:
        try:
            path = os.path.realpath(checkpoint.resolve_ckpt(src, run_dir))
        except FileNotFoundError as e:
            return str(e)
        # A resume cuts the run's metrics and dumps back to the checkpoint's step and rewrites
        # config.yaml and final/: another run's checkpoint would destroy this run's later steps.
        if used and os.path.commonpath([path, os.path.realpath(run_dir)]) != os.path.realpath(run_dir):
            return (f"trainer.load_ckpt_from={src} is a checkpoint of another run, but the run directory "
                    f"{run_dir} already holds a run that resuming would overwrite: start from it in a new "
                    f"trainer.experiment_name (or trainer.save_dir), or resume {run_dir} from its own "
                    f"checkpoint (trainer.load_ckpt_from=latest)")
    if t.log_dir:
        try:
            os.makedirs(t.log_dir, exist_ok=True)
        except OSError as e:
            return f"trainer.log_dir={t.log_dir!r} cannot be created: {e}"
    return None


def load_tokenizer(worker_cfg):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        worker_cfg.tokenizer_name or worker_cfg.model_name, trust_remote_code=worker_cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def row_hint(source, i: int, n_rows: int) -> str:
    """Where row `i` (of the `n_rows` read from `source`) is: its line in a JSON Lines file
    that holds exactly those rows (the loader skips blank lines), else how rows are counted."""
    path = os.path.expanduser(str(source))
    if os.path.splitext(path)[1].lower() in (".jsonl", ".json") and os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = [n for n, line in enumerate(text.split("\n"), 1) if line.strip()]
        if len(lines) == n_rows and not text.lstrip().startswith("["):  # not one JSON document
            return f"rows count from 0: row {i} is line {lines[i]} of {source}"
    return (f"rows count from 0 in file order, blank lines and a CSV header not counted, and after a "
            f"data.test_ratio split within that split's part: row {i} is data row number {i + 1}")


class AdaptersOff:
    """A LoRA worker seen as its frozen base model: every method runs with the adapters off."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        attr = getattr(self.worker, name)
        if not callable(attr):
            return attr

        def call(*args, **kw):
            with self.worker.adapters_disabled():
                return attr(*args, **kw)
        return call


class Trainer:
    """The loop every trainer shares: step, log, evaluate, save, resume, export.

    What a subclass provides (its `__init__` calls `super().__init__(cfg)` first, sets these
    attributes itself, then calls `self.maybe_resume()`):
      n_steps                      optimizer steps of the run (e.g. from `plan_steps`)
      trained_workers() -> dict    {name: Worker} of the models it trains, the exported one
                                   first (it becomes `final/` and the HF model of `step{N}/`)
      train_step(step) -> dict     one optimizer step (step counts from 0); metrics
      evaluate() -> dict           test metrics, {} without a test split
    Data-driven trainers also set `train_data`, `test_data` (from `load_splits`) and `sampler`
    (from `plan_steps`), and may use `batch(step)` and `timed_update`.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout)
        setup_logging()
        self.validate_layouts()
        seed_everything(cfg.trainer.seed)
        self.run_dir = prepare_run_dir(cfg)
        self.tokenizer = load_tokenizer(cfg.actor)
        logger.info(f"world size {dist.get_world_size()} on {self.device}; run dir {self.run_dir}")
        self.step = 0

    def validate_layouts(self):
        """Mesh sizes must divide the world size, optimizer keys must make sense: checked before
        any data or model is loaded."""
        from RL2.parallel.mesh import ParallelDims

        from RL2.workers import lora

        check_optimizer_config(self.cfg)
        check_run_config(self.cfg)
        problems = missing_local_paths(self.model_paths())
        if problems:
            raise SystemExit("invalid config:\n  " + "\n  ".join(problems))
        for name in ("actor", "critic"):
            w = self.cfg.get(name)
            if w is None:
                continue
            problems = lora.check_config(w, name)
            if problems:
                raise SystemExit("bad LoRA config: " + "; ".join(problems))
            try:
                ParallelDims(dist.get_world_size(), w.ddp_size, w.tp_size, w.sp_size)
            except ValueError as e:
                raise SystemExit(f"{name}: {e}".replace("actor.", f"{name}."))

    def model_paths(self) -> dict:
        """{config key: path} of every model and tokenizer the run loads (checked up front)."""
        a = self.cfg.actor
        return {"actor.model_name": a.model_name, "actor.tokenizer_name": a.tokenizer_name}

    # ----- data -----
    def load_splits(self, tokenize) -> tuple[list, list]:
        """Tokenise train and test rows up front (bad rows stop the run here, before any model
        is built, unless data.train.skip_bad_rows counts and skips them)."""
        data = self.cfg.data
        for split in ("train", "test"):
            if not isinstance(data[split].path, (str, type(None))):
                raise SystemExit(f"data.{split}.path is a list: a weighted mixture of datasets is supported "
                                 f"by the PPO trainer only; give one path (file, directory or hub name)")
        try:  # empty, malformed, missing: a message naming the file (and line), no traceback
            rows = load_rows(data.train.path)
            test_rows, test_source = None, None
            if data.test.path:
                test_rows, test_source = load_rows(data.test.path), data.test.path
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"bad data: {e}") from None
        if test_rows is None and data.test_ratio > 0:
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
                    raise SystemExit(f"bad data: {e}\n({row_hint(source, i, len(rows))}; set "
                                     f"data.train.skip_bad_rows=true to skip and count such rows)")
                skipped += 1
                if skipped <= 5:
                    logger.warning(f"skipping: {e}")
        if skipped:
            logger.warning(f"skipped {skipped} of {len(rows)} rows of {source} (data.train.skip_bad_rows=true)")
        if not out:
            raise SystemExit(f"no usable rows in {source}")
        return out

    def plan_steps(self, n_train: int, batch_size: int) -> tuple[StepSampler, int]:
        """(batch order, optimizer steps of the run): n_epochs over the data, or total_steps."""
        sampler = StepSampler(n_train, batch_size, self.cfg.trainer.seed)
        return sampler, self.cfg.trainer.total_steps or sampler.steps_per_epoch * self.cfg.trainer.n_epochs

    def batch(self, step: int) -> list:
        """The training examples of optimizer step `step` (a pure function of seed and step)."""
        return [self.train_data[i] for i in self.sampler.batch(step)]

    def chunked_eval(self, data: list, eval_fn) -> dict:
        """`eval_fn(indices) -> means over those examples`, over `data` in chunks of
        data.test.batch_size, combined into test/ means over all of it ({} without data)."""
        totals = {}
        for idx in eval_batches(len(data), self.cfg.data.test.batch_size):
            for k, v in eval_fn(idx).items():
                totals[k] = totals.get(k, 0.0) + v * len(idx)
        return {f"test/{k}": v / len(data) for k, v in totals.items()}

    def reference_model(self):
        """The frozen reference of DPO-style trainers: a copy of actor.model_name with the actor's
        layout and the `ref:` overrides, built after the actor with the same seed. With LoRA, the
        actor itself with its adapters disabled (no second model)."""
        if self.actor.peft is not None:
            return AdaptersOff(self.actor)
        ref = OmegaConf.merge(self.cfg.actor, self.cfg.ref)
        ref.gradient_checkpointing = False
        if self.device == "cpu":
            ref.offload_params = False  # parameters already live in host memory (FSDP2's offload needs a GPU)
        return Actor(ref, self.device, train=False, seed=self.cfg.trainer.seed)

    # ----- metrics / checkpoints -----
    def make_metric_logger(self, total_steps: int) -> MetricLogger:
        t = self.cfg.trainer
        return MetricLogger(
            t.log_dir or self.run_dir, OmegaConf.to_container(self.cfg, resolve=True), total_steps,
            use_wandb=t.use_wandb, use_tensorboard=t.use_tensorboard, project=t.project,
            name=t.experiment_name, initial_step=self.step)

    def trained_workers(self) -> dict:
        raise NotImplementedError

    def train_step(self, step: int) -> dict:
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    @staticmethod
    def timed_update(update, *args) -> dict:
        """`update(*args) -> metrics` of one optimizer step (with `tokens`, the tokens processed),
        plus step time and throughput, under train/."""
        start = time.perf_counter()
        metrics = update(*args)
        elapsed = time.perf_counter() - start
        metrics.update(step_time=elapsed, tokens_per_s=metrics["tokens"] / elapsed)
        return {f"train/{k}": v for k, v in metrics.items()}

    def save(self, step: int):
        checkpoint.save_checkpoint(self.run_dir, step, self.trained_workers(), self.tokenizer,
                                   {"config": OmegaConf.to_container(self.cfg, resolve=True)},
                                   keep_last=self.cfg.trainer.keep_last, extra_files=self.checkpoint_extras())

    def checkpoint_extras(self) -> dict:
        """{file name: object} a trainer adds to its checkpoints (torch.save by rank 0)."""
        return {}

    def maybe_resume(self):
        src = self.cfg.trainer.load_ckpt_from
        if src:
            path = checkpoint.resolve_ckpt(src, self.run_dir)
            state = checkpoint.load_checkpoint(path, self.trained_workers())
            self.step = state["step"]
            # the steps after the checkpoint are replayed: each must appear once in the dumps
            # (MetricLogger cuts metrics.jsonl back the same way)
            drop_dumps_after(os.path.join(self.run_dir, "rollouts"), self.step)

    def save_final(self):
        for i, (name, w) in enumerate(self.trained_workers().items()):
            out = os.path.join(self.run_dir, "final" if i == 0 else f"final_{name}")
            checkpoint.export_worker(w, out, self.tokenizer)
        logger.info(f"saved final model to {os.path.join(self.run_dir, 'final')}")

    def fit(self):
        """The outer loop every trainer shares: step, log, test, save, export."""
        t, total_steps = self.cfg.trainer, self.n_steps
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
        if not t.test_freq or self.step % t.test_freq:
            final_eval = self.evaluate()
            if final_eval:
                metrics_log.log(final_eval, self.step, advance=False)
        metrics_log.close()
        self.save_final()

    @classmethod
    def launch(cls, config_name: str) -> None:
        """`torchrun -m RL2.trainer.<config_name> key=value ...`: build, train, close."""
        die_with_torchrun_agent()  # stopping the job (killing torchrun) stops the workers
        trainer = cls(load_config(config_name))
        trainer.fit()
        trainer.close()
        # Everything is saved, closed and flushed. At exit the interpreter's last garbage
        # collections would walk every object of torch, transformers and the run: ~1 s of each
        # worker's exit, a seventh of a small run (benchmarks/README.md, "Test-suite timings").
        # Frozen first, those objects are left to the OS. At exit only: a process that goes on
        # (a notebook, a sweep) keeps collecting.
        atexit.register(gc.freeze)

    def close(self):
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
