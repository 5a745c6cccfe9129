"""Training curves from metrics.jsonl, one PNG, several runs overlaid.

    python -m RL2.tools.plot RUN_DIR [RUN_DIR ...] [--out curves.png]

RUN_DIR is a run directory (save_dir/experiment_name, holding metrics.jsonl) or the JSONL file
itself. Panels without data in any run are left out, so the same command serves SFT, RM, DPO and
PPO runs. Needs matplotlib (`pip install 'RL2[plot]'`).
"""
import argparse
import json
import os
from collections import defaultdict

# (title, y label, keys): each key a line per run; "test/" keys get markers (sparse points).
PANELS = [
    ("reward", "mean reward", ["rollout/reward", "test/reward"]),
    ("loss", "loss", ["train/loss", "test/loss", "actor/loss", "critic/value_loss"]),
    ("entropy", "nats / token", ["actor/entropy"]),
    ("KL", "KL / token", ["actor/approx_kl", "actor/kl_loss", "rollout/engine_kl", "adv/kl_reward"]),
    ("response length", "tokens", ["rollout/response_length", "test/response_length"]),
    ("turns", "turns / trajectory", ["rollout/turns", "test/turns"]),
    ("accuracy", "accuracy", ["train/accuracy", "test/accuracy"]),
    ("step time", "seconds", ["time/rollout", "time/ref_logps", "time/values", "time/old_logps",
                              "time/advantages", "time/update", "time/sync", "time/step", "train/step_time"]),
]
# Drawn only when some value changes: single-turn runs always have 1 turn, and approx_kl is 0
# with one update per rollout.
SKIP_IF_CONSTANT = {"turns", "KL"}
STEP_TOTALS = ("time/step", "train/step_time")


def metrics_path(run: str) -> str:
    path = run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"no metrics file at {path} (pass a run directory or its metrics.jsonl)")
    return path


def read_series(path: str) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] sorted by step; a step logged twice (a resumed run repeats the steps
    after its last checkpoint) keeps its last value."""
    by_key = defaultdict(dict)
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON ({e})") from None
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    by_key[k][row["step"]] = float(v)
    return {k: sorted(v.items()) for k, v in by_key.items()}


def run_names(runs: list[str]) -> list[str]:
    """Short legend names: a run directory's name, or as much of its path as tells it apart."""
    parts = [(os.path.dirname(os.path.abspath(r)) if r.endswith(".jsonl") else os.path.abspath(r)).split(os.sep)
             for r in runs]

    def name(p, depth):
        return os.path.join(*p[-depth:])

    out = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(name(q, depth) == name(p, depth) for j, q in enumerate(parts) if j != i):
            depth += 1
        out.append(name(p, depth))
    return out


def panels_with_data(series: list[dict]) -> list[tuple[str, str, list[str]]]:
    out = []
    for title, ylabel, keys in PANELS:
        values = [v for s in series for k in keys for _, v in s.get(k, [])]
        if not values or (title in SKIP_IF_CONSTANT and len(set(values)) == 1):
            continue
        out.append((title, ylabel, [k for k in keys if any(k in s for s in series)]))
    return out


def plot(runs: list[str], out: str):
    """Draw every panel with data; write the PNG to `out`; return the matplotlib Figure."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'RL2[plot]'") from None
    series = [read_series(metrics_path(r)) for r in runs]
    panels = panels_with_data(series)
    if not panels:
        raise SystemExit(f"no plottable metrics in {', '.join(runs)}")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5 * cols, 3.6 * rows + 0.4 * (len(runs) > 1)), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    names = run_names(runs)
    for ax, (title, ylabel, keys) in zip(axes, panels):
        if title == "step time":
            draw_step_time(ax, keys, names, series)
        else:
            draw_lines(ax, keys, names, series)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if len(runs) == 1:
        fig.suptitle(names[0])
    else:  # one legend for the runs (colours); each panel's legend names its keys (styles)
        from matplotlib.lines import Line2D

        fig.legend([Line2D([], [], color=f"C{i}") for i in range(len(runs))], names,
                   loc="outside upper center", ncols=min(len(runs), 4))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig


STYLES = ["-", "--", ":", "-."]


def draw_lines(ax, keys, names, series):
    """One run: a colour per key. Several runs: colour = run, line style = key. Lines are labelled
    "key" (one run) or "run: key"."""
    from matplotlib.lines import Line2D

    many = len(series) > 1
    for i, (name, s) in enumerate(zip(names, series)):
        for j, key in enumerate(keys):
            if key in s:
                steps, values = zip(*s[key])
                ax.plot(steps, values, STYLES[j % len(STYLES)] if many else "-",
                        color=f"C{i}" if many else f"C{j}", label=f"{name}: {key}" if many else key,
                        marker="o" if key.startswith("test/") else None, markersize=4)
    if many:
        ax.legend([Line2D([], [], color="0.3", linestyle=STYLES[j % len(STYLES)],
                          marker="o" if k.startswith("test/") else None) for j, k in enumerate(keys)],
                  keys, fontsize="small")
    else:
        ax.legend(fontsize="small")


def draw_step_time(ax, keys, names, series):
    """One run: the breakdown (rollout, log-probs, update, sync, ...) stacked per step. Several
    runs: each run's total step time."""
    parts = [k for k in keys if k not in STEP_TOTALS]
    s = series[0]
    if len(series) == 1 and any(k in s for k in parts):
        present = [k for k in parts if k in s]
        steps = sorted({st for k in present for st, _ in s[k]})
        values = [[dict(s[k]).get(st, 0.0) for st in steps] for k in present]
        ax.stackplot(steps, values, labels=present, alpha=0.8)
        ax.legend(fontsize="small", loc="upper left")
        return
    totals = [k for k in STEP_TOTALS if k in keys]
    draw_lines(ax, totals, names, series)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", help="PNG path (default: curves.png in the first run directory)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(metrics_path(args.runs[0])), "curves.png")
    plot(args.runs, out)
    print(out)


if __name__ == "__main__":
    main()
