"""TRL side of bench_vs_trl: one workload (sft | dpo | grpo) on TRL's trainers, one process.

    python benchmarks/vs_trl_trl.py --workload sft --assets DIR --steps 4 --out result.json

Run by bench_vs_trl.py in a fresh process (threads set before torch starts). Times every
optimizer step with a TrainerCallback (wall clock and process CPU time, step begin -> step end); GRPO also times
`_generate_and_score_completions` (generation + rewards + advantages, RL2's `time/rollout`).
Writes {"steps": [{"time", "tokens", ...}, ...]} with the first step (warm-up) included.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.vs_trl_data import load_rows  # noqa: E402


def _common(args, **extra) -> dict:
    return dict(output_dir=os.path.join(args.assets, f"trl_{args.workload}"), report_to=[],
                use_cpu=True, save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True,
                max_steps=args.steps, learning_rate=1e-5, lr_scheduler_type="constant",
                warmup_steps=0, max_grad_norm=1.0, gradient_accumulation_steps=1, seed=0,
                dataloader_num_workers=0, dataloader_drop_last=True,
                # TRL's configs default to bf16=True (on CPU: every matmul under bf16 autocast);
                # --dtype says which side of the comparison runs: fp32, or bf16 on both
                bf16=args.dtype == "bfloat16", fp16=False, **extra)


def _timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps, self._start = [], None

        def on_step_begin(self, args, state, control, **kw):
            self._start = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kw):
            self.steps.append({"time": time.perf_counter() - self._start[0],
                               "cpu": time.process_time() - self._start[1]})

    return StepTimer()


def _model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _count_tokens(trainer_cls, sink: list):
    """A subclass recording the non-padding tokens of every training_step's inputs."""
    class Counting(trainer_cls):
        def training_step(self, model, inputs, *a, **kw):
            mask = inputs.get("attention_mask")
            ids = inputs.get("input_ids")
            if ids is None:  # DPO: chosen and rejected sides of a pair batch
                ids = inputs.get("prompt_input_ids")
            sink.append(int(mask.sum()) if mask is not None else int(ids.numel()))
            return super().training_step(model, inputs, *a, **kw)
    return Counting


def run_sft(args, tok, timer, tokens):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = [{"input_ids": r["input_ids"]} for r in load_rows(args.assets, "sft")]
    cfg = SFTConfig(**_common(args, per_device_train_batch_size=1, packing=True, packing_strategy="bfd",
                  max_length=args.sft_max_length, dataset_num_proc=None))
    trainer = _count_tokens(SFTTrainer, tokens)(
        model=_model(args.model), args=cfg, train_dataset=Dataset.from_list(rows),
        processing_class=tok, callbacks=[timer])
    trainer.train()


def run_dpo(args, tok, timer, tokens):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = load_rows(args.assets, "dpo")
    cfg = DPOConfig(**_common(args, per_device_train_batch_size=args.pairs, precompute_ref_log_probs=False,
                  max_length=2048, beta=0.1))
    trainer = _count_tokens(DPOTrainer, tokens)(
        model=_model(args.model), ref_model=_model(args.model), args=cfg,
        train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
    trainer.train()


def run_grpo(args, tok, timer, tokens):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = [{"prompt": r["prompt"]} for r in load_rows(args.assets, "grpo")]
    n = args.responses
    cfg = GRPOConfig(**_common(args, per_device_train_batch_size=args.prompts * n, num_generations=n,
                  max_completion_length=args.new_tokens, beta=0.0, num_iterations=1,
                  temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False))
    gen_times, gen_tokens = [], []

    def reward(completions, **kw):  # the same cheap verifier as the RL2 env (parity of length)
        return [float(len(c) % 2) for c in completions]

    trainer = GRPOTrainer(model=_model(args.model), reward_funcs=reward, args=cfg,
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          callbacks=[timer])
    inner = trainer._generate_and_score_completions

    def timed(inputs):
        start, cpu = time.perf_counter(), time.process_time()
        out = inner(inputs)
        gen_times.append((time.perf_counter() - start, time.process_time() - cpu))
        gen_tokens.append(int(out["completion_mask"].sum()))
        tokens.append(gen_tokens[-1] + int(out["prompt_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    return gen_times, gen_tokens


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["sft", "dpo", "grpo"], required=True)
    p.add_argument("--assets", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--sft-max-length", type=int, default=1024)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    args.model = os.path.join(args.assets, "model")
    tok = AutoTokenizer.from_pretrained(args.model)
    timer, tokens = _timer(), []
    runner = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo}[args.workload]
    extra = runner(args, tok, timer, tokens)
    steps = timer.steps
    if args.workload == "grpo":
        gen_times, gen_tokens = extra
        for s, (g, g_cpu), n in zip(steps, gen_times, gen_tokens):
            s.update(generation=g, generation_cpu=g_cpu, generated_tokens=n)
    # SFT/DPO: one training_step per optimizer step (no accumulation); GRPO: one generation.
    for s, n in zip(steps, tokens):
        s["tokens"] = n
    with open(args.out, "w") as f:
        json.dump({"steps": steps}, f)


if __name__ == "__main__":
    main()
