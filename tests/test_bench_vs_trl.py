"""bench_vs_trl: the ratio table's structure and arithmetic (no timings asserted), and one slow
smoke run of the real script in its tiny mode."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks.bench_vs_trl import (ALONE, FIGURES, combine_rounds, merge_alone, parse_args, ratio_table,
                                     rounds_table, summarize)
from benchmarks.vs_trl_rl2 import pair_part, parse_part, part_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _steps(times, tokens=1000, **extra):
    return [dict({"time": t, "cpu": t / 2, "tokens": tokens}, **extra) for t in times]


def test_summarize_medians_skip_warmup_and_flops():
    # warm-up step (100 s) dropped; median of 1, 2, 4 s = 2 s
    r = summarize("sft", _steps([100.0, 1.0, 4.0, 2.0]), n_params=10)
    assert r["s/step"] == 2.0 and r["tokens/s"] == 500.0
    assert r["flop/s"] == 6 * 10 * 1000 / 2.0  # 6N per trained token
    cpu = summarize("sft", _steps([100.0, 1.0, 4.0, 2.0]), n_params=10, clock="cpu")
    assert cpu["s/step"] == 1.0
    g = summarize("grpo", _steps([9.0, 3.0], generation=1.0, generated_tokens=500), n_params=10)
    assert g["update s"] == 2.0  # TRL: the step minus its rollout
    assert g["gen tokens/s"] == 500.0 and g["update s/1k tokens"] == 2.0
    g = summarize("grpo", _steps([9.0, 3.0], generation=1.0, update=1.5, generated_tokens=500), 10)
    assert g["update s"] == 1.5  # RL2: actor_update's own timer


def test_ratio_table_structure_and_speedups():
    base = _steps([1.0, 2.0])
    results = {"sft": {"TRL": summarize("sft", base, 10),
                       "RL2 1x2": summarize("sft", _steps([1.0, 1.0]), 10)},
               "grpo": {"RL2 1x2": summarize("grpo", _steps([1.0, 2.0], generation=1.0,
                                                            update=0.5, generated_tokens=64), 10)}}
    columns = ["TRL", "RL2 1x2", "RL2 2x1"]
    peaks = {c: 1e6 for c in columns}
    lines = ratio_table(results, peaks, columns).splitlines()
    assert lines[0] == "| workload | TRL | RL2 1x2 | RL2 2x1 |"
    rows = [line.split(" | ") for line in lines[2:]]
    assert len(rows) == len(FIGURES["sft"]) + len(FIGURES["grpo"])
    sft = rows[0]
    assert "SFT" in sft[0] and "% peak" in sft[1]
    assert "**2.00x**" in sft[2]  # twice TRL's tokens/s
    assert sft[3].startswith("skipped")  # a column that did not run
    assert all("**" not in r[2] for r in rows[1:])  # no TRL row for grpo: no speed-up claimed
    assert rows[1][1].startswith("skipped")


def test_rounds_pair_each_rl2_run_with_the_trl_run_of_its_round():
    """`--rounds`: a speed-up is taken within a round, then the median over rounds; each figure
    is its median over rounds. Here TRL slows down in round 2 and RL2 with it: the per-round
    speed-ups are 2.0, 2.0, 1.5 (median 2.0), where the ratio of the medians would read 1.5."""
    trl = [1.0, 2.0, 1.0]   # TRL s/step per round (tokens/s 1000, 500, 1000)
    rl2 = [0.5, 1.0, 2 / 3]  # RL2 in the same rounds
    rounds = [{"sft": {"TRL": summarize("sft", _steps([9.0, t]), 10),
                       "RL2 1x2": summarize("sft", _steps([9.0, r]), 10)}} for t, r in zip(trl, rl2)]
    merged, ratios = combine_rounds(rounds)
    assert merged["sft"]["TRL"]["s/step"] == 1.0 and merged["sft"]["RL2 1x2"]["s/step"] == 2 / 3
    assert ratios["sft"]["RL2 1x2"]["tokens/s"] == pytest.approx([2.0, 2.0, 1.5])
    columns = ["TRL", "RL2 1x2"]
    row = ratio_table(merged, {c: 1e6 for c in columns}, columns, ratios).splitlines()[2]
    assert "**2.00x**" in row  # the median of the rounds' speed-ups, not 1.5 from the medians
    per = rounds_table(ratios, columns).splitlines()
    assert per[0] == "| speed-up over TRL, each round | RL2 1x2 |"
    assert "2.00, 2.00, 1.50 (median **2.00x**)" in per[2]
    # no TRL: figures only, no speed-up
    merged, ratios = combine_rounds([{"sft": {"RL2 1x2": r["sft"]["RL2 1x2"]}} for r in rounds])
    assert "**" not in ratio_table(merged, {c: 1e6 for c in columns}, columns, ratios)
    assert parse_args([]).rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_run_interleaves_the_rounds(monkeypatch):
    """run() with `--rounds 3` and stand-in runs (no processes, no timings): TRL and every RL2
    layout (the "alone" pair included) run once per round, round after round, and the tables
    show the per-round ratios."""
    import benchmarks.bench_vs_trl as B

    calls = []

    def fake(who):
        def run(workload, *a, **kw):
            calls.append((who, workload))
            r = sum(c[0] == "trl" for c in calls) - 1  # this round
            return _steps([9.0, [1.0, 2.0, 4.0][r] if who == "trl" else [0.5, 0.5, 1.0][r]])
        return run
    monkeypatch.setattr(B, "trl_available", lambda: True)
    monkeypatch.setattr(B, "run_trl", fake("trl"))
    monkeypatch.setattr(B, "run_rl2", fake("rl2"))
    monkeypatch.setattr(B, "run_rl2_alone", fake("alone"))
    monkeypatch.setattr(B, "matmul_peak", lambda *a, **kw: 1e9)
    text = B.run(B.parse_args(["--quick", "--rounds", "3", "--only", "sft", "--threads", "2"]))
    n = len(B.layouts(2)) - 1  # rg1 is GRPO only
    one_round = [("trl", "sft")] + [("rl2", "sft")] * n + [("alone", "sft")]
    assert calls == one_round * 3
    assert "then of 3 rounds" in text
    # RL2 0.5, 0.5, 1 s against TRL 1, 2, 4 s: speed-ups 2, 4, 4 in that order (rounds paired
    # in reverse would read 8, 4, 1)
    assert "2.00, 4.00, 4.00 (median **4.00x**)" in text


def _side(prompt: int, response: int, token: int) -> dict:
    import torch

    ids = torch.cat([torch.zeros(prompt, dtype=torch.long), torch.full((response,), token)])
    return {"input_ids": ids, "labels": ids.clone(),
            "action_mask": torch.cat([torch.zeros(prompt), torch.ones(response)])}


def test_alone_parts_split_each_batch_as_the_ranks_would():
    """--part H/N: the N shares cover the batch once, as the Worker plans it. SFT: whole
    sequences balanced (the layouts docstring's step: 600 alone against 250 + 100 + 50 + 20).
    DPO: pairs weighed as dpo_update packs them, a rejected side with a shared prompt only as
    its tail: pair A (a 100-token prompt, 10-token answers) weighs 120 shared, 220 not; B 120
    (nothing shared); C 200 (nothing shared)."""
    lengths = [250, 600, 20, 100, 50]
    shares = [part_of(lengths, (h, 2), 4096) for h in (0, 1)]
    assert sorted(shares[0] + shares[1]) == list(range(5))
    assert sorted(sum(lengths[i] for i in s) for s in shares) == [420, 600]
    three = [part_of(lengths, (h, 3), 4096) for h in range(3)]
    assert sorted(i for s in three for i in s) == list(range(5))
    pairs = [{"chosen": _side(100, 10, 1), "rejected": _side(100, 10, 2)},
             {"chosen": _side(0, 60, 1), "rejected": _side(0, 60, 2)},
             {"chosen": _side(0, 100, 1), "rejected": _side(0, 100, 2)}]
    shared = sorted(pair_part(pairs, (h, 2), 4096, True) for h in (0, 1))
    assert shared == [[0, 1], [2]]  # 240 | 200
    whole = sorted(pair_part(pairs, (h, 2), 4096, False) for h in (0, 1))
    assert whole == [[0], [1, 2]]  # 220 | 320
    # a small capacity: a rank's share is all its micro-batches
    assert sorted(pair_part(pairs, (h, 2), 230, True) for h in (0, 1)) == [[0, 1], [2]]
    assert parse_part("1/2") == (1, 2)
    for bad in ("2/2", "-1/2", "1", "a/b"):
        with pytest.raises(Exception, match="H/N"):
            parse_part(bad)


def test_alone_steps_merge_as_the_slower_process():
    """A merged step: the slower wall time, the larger CPU time (not necessarily the same
    process's), the tokens of both."""
    a = [{"time": 3.0, "cpu": 1.0, "tokens": 600}, {"time": 1.0, "cpu": 0.9, "tokens": 600}]
    b = [{"time": 2.0, "cpu": 1.8, "tokens": 420}, {"time": 1.5, "cpu": 0.5, "tokens": 420}]
    merged = merge_alone([a, b])
    assert [s["time"] for s in merged] == [3.0, 1.5]
    assert [s["cpu"] for s in merged] == [1.8, 0.9]
    assert all(s["tokens"] == 1020 for s in merged)


def test_alone_run_reports_a_failing_part_and_stops_the_other(monkeypatch, tmp_path):
    """run_rl2_alone: a part that fails is named with its log; a part still running when the
    timeout ends is killed, not left behind."""
    import time

    import benchmarks.bench_vs_trl as bench

    def fake(script):
        def torchrun(nproc, root):
            return [sys.executable, "-c", script, "--"]  # the real arguments follow, ignored
        return torchrun
    args = SimpleNamespace(repeats=1, dtype="float32", rl2_override=[], timeout=60.0)
    monkeypatch.setattr(bench, "_torchrun", fake(
        "import sys; a = sys.argv; h = a[a.index('--part') + 1]\n"
        "if h == '1/2': sys.exit('part one broke')\n"
        "import time; time.sleep(0.5)\n"
        "open(a[a.index('--out') + 1], 'w').write('{\"steps\": []}')"))
    with pytest.raises(RuntimeError, match="part 1/2 failed:(.|\n)*part one broke"):
        bench.run_rl2_alone("dpo", str(tmp_path), args)
    monkeypatch.setattr(bench, "_torchrun", fake(
        "import os, sys, time; open(sys.argv[sys.argv.index('--out') + 1] + '.pid', 'w')"
        ".write(str(os.getpid())); time.sleep(600)"))
    args.timeout = 3.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="part 0/2: timed out(.|\n)*part 1/2: timed out"):
        bench.run_rl2_alone("sft", str(tmp_path), args)
    assert time.monotonic() - start < 30  # one deadline for both parts
    for h in (0, 1):
        pid = int((tmp_path / f"rl2_sft_alone_{h}.json.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (killed and reaped)


@pytest.mark.slow
def test_bench_vs_trl_quick_runs_end_to_end(tmp_path):
    """The real script (tiny model, 1 measured step, TRL skipped to keep it short): every
    workload row and every RL2 layout appears, with a % of peak in each cell."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_vs_trl", "--quick", "--no-trl",
                          "--threads", "1"], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert ("| workload | TRL | RL2 1x1 | RL2 2x1 | RL2 2x1 ddp | RL2 2x1 sp | RL2 2x1 rg1 | "
            f"{ALONE} |") in text
    assert "TRL skipped: --no-trl" in text
    for workload in ("sft", "dpo", "grpo"):
        for label, *_ in FIGURES[workload]:
            row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
            cells = row.strip("| ").split(" | ")
            # rg1 (an engine per rank): GRPO only; alone (no communication): SFT and DPO only
            ran = cells[2:-1] if workload == "grpo" else cells[2:-2] + cells[-1:]
            assert cells[1] == "skipped" and all("% peak)" in c for c in ran), row
            assert cells[-1 if workload == "grpo" else -2] == "skipped", row


def test_assets_from_a_checkpoint_link_it_and_fit_its_tokenizer(assets, tmp_path):
    """`--model DIR`: root/model is the checkpoint itself and every row is in its vocabulary."""
    from transformers import AutoTokenizer

    from benchmarks.vs_trl_data import build_assets, load_rows

    model = build_assets(str(tmp_path), assets["model"], n_sft=1, n_pairs=2, n_prompts=2)
    assert os.path.realpath(model) == os.path.realpath(assets["model"])
    tok = AutoTokenizer.from_pretrained(model)
    ids = [i for r in load_rows(str(tmp_path), "sft") for i in r["input_ids"]]
    assert ids and max(ids) < len(tok)
    assert len(load_rows(str(tmp_path), "dpo")) == 2 and len(load_rows(str(tmp_path), "grpo")) == 2
