"""The run report: held-out results side by side (Markdown table) and the training curves (PNG).

    paths = write_report("runs/tiny", {"sft": table_sft, "rl": table_rl})
    -> runs/tiny/report.md, runs/tiny/eval.json, runs/tiny/curves.png

``table`` is ``evaluate()``'s {k: {"em", "f1", "turns", "tt", "pt", "r_mem", ...}}. The curves come
from the run's metrics.jsonl: outcome reward, held-out EM (periodic eval), mean R_mem, P_mem and
P_full, and peak tokens per step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from services.pipeline.runlog import read_rows

COLUMNS = (("EM", "em", "{:.3f}"), ("F1", "f1", "{:.3f}"), ("turns", "turns", "{:.2f}"), ("TT", "tt", "{:.0f}"),
           ("PT", "pt", "{:.0f}"), ("R_mem", "r_mem", "{:+.4f}"), ("P_mem", "p_mem", "{:.4f}"),
           ("P_full", "p_full", "{:.4f}"), ("episodes", "episodes", "{:.0f}"))


def _fmt(fmt: str, v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def markdown_table(results: dict[str, dict[int, dict]]) -> str:
    head = "| policy | k | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, table in results.items():
        for k in sorted(table, key=int):
            row = table[k]
            lines.append(f"| {name} | {k} | " + " | ".join(_fmt(f, row.get(key)) for _, key, f in COLUMNS) + " |")
    return "\n".join(lines)


def plot_curves(metrics_path: Path, out: Path) -> Path | None:
    train = read_rows(metrics_path, "train")
    evals = read_rows(metrics_path, "eval")
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    panels = [
        ("outcome reward (train)", [("reward_mean", train, "reward")]),
        ("held-out EM", [("em", evals, "mean over k")] + [
            (k, evals, k.split("/")[0]) for k in sorted({k for r in evals for k in r if k.endswith("/em")})]),
        ("mean R_mem (train)", [("scorer/r_mem_mean", train, "R_mem")]),
        ("P_mem and P_full (train)", [("scorer/p_mem_mean", train, "P_mem"), ("scorer/p_full_mean", train, "P_full")]),
        ("peak tokens per turn (train)", [("rollout/peak_tokens_mean", train, "mean"),
                                          ("rollout/peak_tokens_max", train, "max")]),
        ("turns per episode (train)", [("rollout/turns_mean", train, "turns")]),
    ]
    for ax, (title, series) in zip(axes.flat, panels):
        for key, rows, label in series:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_report(run_dir: str | Path, results: dict[str, dict[int, dict]], notes: str = "") -> dict[str, Path]:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"eval": run_dir / "eval.json", "report": run_dir / "report.md"}
    paths["eval"].write_text(json.dumps({n: {str(k): v for k, v in t.items()} for n, t in results.items()}, indent=1))
    curves = plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    text = ["# mempo run report", "", markdown_table(results), ""]
    if curves is not None:
        paths["curves"] = curves
        text += ["![training curves](curves.png)", ""]
    if notes:
        text += [notes, ""]
    paths["report"].write_text("\n".join(text))
    return paths
