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

import numpy as np

from services.pipeline.runlog import read_rows
from services.pipeline.stats import paired_bootstrap_diff, seed_t_interval

COLUMNS = (("F1", "f1", "{:.3f}"), ("turns", "turns", "{:.2f}"), ("TT", "tt", "{:.0f}"),
           ("PT", "pt", "{:.0f}"), ("R_mem", "r_mem", "{:+.4f}"), ("P_mem", "p_mem", "{:.4f}"),
           ("P_full", "p_full", "{:.4f}"), ("episodes", "episodes", "{:.0f}"))
DIAGNOSTICS = (("well-formed", "well_formed"), ("first search names the entity", "first_search_hit"),
               ("answer seen in an observation", "answer_seen"), ("answered", "answered"))


def _fmt(fmt: str, v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _em(row: dict) -> str:
    em = _fmt("{:.3f}", row.get("em"))
    if "em_lo" in row and not math.isnan(row["em_lo"]):
        em += f" [{row['em_lo']:.3f}, {row['em_hi']:.3f}]"
    return em


def markdown_table(results: dict[str, dict[int, dict]]) -> str:
    """EM (with its 95% CI when known) and the paper's metrics, per policy and k."""
    head = "| policy | k | EM [95% CI] | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for name, table in results.items():
        for k in sorted(table, key=int):
            row = table[k]
            lines.append(f"| {name} | {k} | {_em(row)} | " + " | ".join(_fmt(f, row.get(key)) for _, key, f in COLUMNS) + " |")
    return "\n".join(lines)


def diagnostics_table(results: dict[str, dict[int, dict]], controls: dict[str, dict[int, dict]]) -> str:
    """What the agent did, per policy and k, and EM of the same policy with search disabled."""
    head = "| policy | k | " + " | ".join(c[0] for c in DIAGNOSTICS) + " | EM, search disabled [95% CI] |"
    lines = [head, "|" + "---|" * (len(DIAGNOSTICS) + 3)]
    for name, table in results.items():
        for k in sorted(table, key=int):
            row, ctl = table[k], controls.get(name, {}).get(k)
            cells = [_fmt("{:.3f}", row.get(key)) for _, key in DIAGNOSTICS]
            lines.append(f"| {name} | {k} | " + " | ".join(cells) + f" | {_em(ctl) if ctl else 'n/a'} |")
    return "\n".join(lines)


def _per_k(pairs: list):
    """(k, [(before, after) per-prompt EM vectors of each pair]) for every k the pairs share, then
    ``"all"`` (every shared k's prompts in one vector)."""
    ks = sorted(set.intersection(*(set(b.episodes) & set(a.episodes) for b, a in pairs)))
    for k in ks + ["all"]:
        def em(run):
            return np.concatenate([run.em(j) for j in ks]) if k == "all" else run.em(k)
        yield k, [(em(b), em(a)) for b, a in pairs]


def _paired_rows(label: str, pairs: list) -> list[str]:
    """Rows of EM(after) - EM(before) per k and pooled over k, for (before, after) EvalRuns of the same
    prompts; with several pairs, each prompt's differences are averaged over the pairs first (so the
    bootstrap still resamples prompts, and a prompt counts once)."""
    out = []
    for k, ems in _per_k(pairs):
        before = np.mean([b for b, _ in ems], axis=0)
        after = np.mean([a for _, a in ems], axis=0)
        d, lo, hi = paired_bootstrap_diff(before, after)
        out.append(f"| {label} | {k} | {d:+.3f} | [{lo:+.3f}, {hi:+.3f}] | {len(before)} |")
    return out


def _seed_rows(label: str, pairs: list) -> list[str]:
    """Rows of the mean per-pair difference with a Student's t CI over the pairs (each a training seed),
    per k and pooled: the interval for "another seed", which the prompt bootstrap does not give."""
    out = []
    for k, ems in _per_k(pairs):
        d, lo, hi = seed_t_interval([float(np.mean(a - b)) for b, a in ems])
        out.append(f"| {label} | {k} | {d:+.3f} | [{lo:+.3f}, {hi:+.3f}] (t over seeds) | {len(pairs)} seeds |")
    return out


def delta_table(runs: dict) -> str:
    """EM of every policy against the first one (its start), per k and pooled over k: the mean
    per-prompt difference with its 95% paired-bootstrap CI (services/pipeline/stats.py)."""
    names = list(runs)
    if len(names) < 2:
        return ""
    lines = [f"| policy | k | EM - EM({names[0]}) | 95% CI | prompts |", "|---|---|---|---|---|"]
    for name in names[1:]:
        lines += _paired_rows(name, [(runs[names[0]], runs[name])])
    return "\n".join(lines)


SEED_UNITS = 3  # from this many pairs on, a row with each pair's difference as one observation


def pairs_table(runs: dict, comparisons: list[list[tuple[str, str]]]) -> str:
    """EM(B) - EM(A) for each named pair (A, B) on the same prompts. A comparison of several pairs
    (the same two variants trained with different seeds) also gets their mean: each prompt's
    differences averaged over the pairs, bootstrapped over prompts. That CI is over prompts only; it
    does not cover how far another seed would move the result: with three or more pairs an
    ``over seeds`` row gives the same mean with a Student's t CI over the pairs' differences."""
    lines = ["| pair | k | EM(B) - EM(A) | 95% CI | prompts |", "|---|---|---|---|---|"]
    for pairs in comparisons:
        for a, b in pairs:
            lines += _paired_rows(f"{b} - {a}", [(runs[a], runs[b])])
        label = " / ".join(f"{b} - {a}" for a, b in pairs)
        if len(pairs) > 1:
            lines += _paired_rows(f"mean of {label}", [(runs[a], runs[b]) for a, b in pairs])
        if len(pairs) >= SEED_UNITS:
            lines += _seed_rows(f"over seeds: {label}", [(runs[a], runs[b]) for a, b in pairs])
    return "\n".join(lines)


RETAINED = {1: "keeps every gold answer shown so far", 0: "lost a gold answer it had been shown",
            -1: "no gold answer shown yet"}


def answer_logprobs_line(mr: dict) -> str:
    """The gold answer's tokens with their log-probs after the memory and after the full history;
    a value in brackets is one the reward's filter did not count."""
    def side(logp, keep):
        return " ".join(f"`{tok.strip() or repr(tok)}` " + (f"{lp:.2f}" if kept else f"({lp:.2f})")
                        for tok, lp, kept in zip(mr["tokens"], logp, keep))
    return (f"answer log-probs after the memory: {side(mr['mem_logp'], mr['mem_keep'])}; after the full history: "
            f"{side(mr['full_logp'], mr['full_keep'])} (memory {RETAINED.get(mr.get('retained', -1), '?')})")


def samples_markdown(runs: dict) -> str:
    """A few complete episodes per policy and k, decoded, with the outcome reward and the memory
    reward of each <mem> block."""
    out = ["# Sample episodes", ""]
    for name, run in runs.items():
        for k in sorted(run.samples):
            for s in run.samples[k]:
                golds = "; ".join(alts[0] for alts in s["golds"])
                out += [f"## {name}, k={k}, {s['uid']}: EM {s['em']:.2f} ({s['finish']})", "",
                        f"**question:** {s['question']}  ", f"**gold:** {golds}  ", f"**answer:** {s['answer']}", ""]
                for t, turn in enumerate(s["turns"], 1):
                    mr = turn["memory_reward"]
                    score = "" if mr is None else (f" (P_mem {mr['p_mem']:.3f}, P_full {mr['p_full']:.3f}, "
                                                   f"R_mem {mr['r_mem']:+.3f})")
                    problems = f" problems: {', '.join(turn['problems'])}" if turn["problems"] else ""
                    out += [f"turn {t}{score}{problems}", "", "```", turn["response"].strip(), "```", ""]
                    if mr is not None and mr.get("tokens"):
                        out += [answer_logprobs_line(mr), ""]
                    if turn["observation"].strip():
                        out += ["```", turn["observation"].strip()[:600], "```", ""]
    return "\n".join(out)


# The run's curves, said once for curves.png and `mempo view`: (title, row kind, [(metric key, label)]);
# the key "k*/em" stands for every per-k held-out EM the rows hold.
CURVES = (
    ("outcome reward (train)", "train", (("reward_mean", "reward"), ("groups_with_variance", "groups with reward variance"))),
    ("held-out EM", "eval", (("em", "mean over k"), ("k*/em", ""))),
    ("R_mem (train)", "train", (("scorer/r_mem_mean", "mean"), ("mem_pool_std_mean", "std within a prompt's pool"))),
    ("P_mem and P_full (train)", "train", (("scorer/p_mem_mean", "P_mem"), ("scorer/p_full_mean", "P_full"))),
    ("does R_mem track retention? (train)", "train", (("scorer/retained_share", "memories keeping every shown answer"),
                                                     ("scorer/retention_auc", "AUC of R_mem, keeping > losing"))),
    ("peak tokens per turn (train)", "train", (("rollout/peak_tokens_mean", "mean"), ("rollout/peak_tokens_max", "max"))),
    ("turns per episode (train)", "train", (("rollout/turns_mean", "turns"),)),
)


def curve_series(rows: dict[str, list[dict]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """CURVES made concrete for ``rows`` ({"train": [...], "eval": [...]}): (title, [(key, label)]) with
    the per-k keys expanded."""
    out = []
    for title, kind, series in CURVES:
        concrete = []
        for key, label in series:
            if key == "k*/em":
                concrete += [(k, k.split("/")[0]) for k in sorted({k for r in rows[kind] for k in r
                                                                   if k.startswith("k") and k.endswith("/em")})]
            else:
                concrete.append((key, label))
        out.append((title, kind, concrete))
    return out


def plot_curves(metrics_path: Path, out: Path) -> Path | None:
    rows = {"train": read_rows(metrics_path, "train"), "eval": read_rows(metrics_path, "eval")}
    if not rows["train"] and not rows["eval"]:
        return None
    panels = [(title, [(key, rows[kind], label) for key, label in series]) for title, kind, series in curve_series(rows)]
    return draw_panels(panels, out, rows=2, figsize=(14, 7.5))


def draw_panels(panels: list, out: Path, rows: int = 1, figsize=(15, 4.2)) -> Path:
    """One subplot per (title, [(metric key, metrics rows, label), ...]), against the RL step."""
    import matplotlib  # on use: half a second, for the plots alone

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    fig, axes = plt.subplots(rows, -(-len(panels) // rows), figsize=figsize, squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels):
        for key, metric_rows, label in series:
            pts = [(r["step"], r[key]) for r in metric_rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if len(series) > 1 and ax.get_legend_handles_labels()[0]:  # a panel whose metrics a run lacks stays empty
            ax.legend(fontsize=8)
    for ax in axes.flat[len(panels):]:  # the grid's spare cells, when the panels do not fill its last row
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def by_str_k(tables: dict[str, dict]) -> dict[str, dict[str, object]]:
    """{policy: {k: ...}} with the k keys as strings, the JSON layout of eval.json and samples.json."""
    return {name: {str(k): v for k, v in table.items()} for name, table in tables.items()}


def write_samples(run_dir: str | Path, runs: dict) -> Path:
    """samples.json: the decoded sample episodes of each EvalRun, as data (what `mempo view` shows)."""
    path = Path(run_dir) / "samples.json"
    path.write_text(json.dumps(by_str_k({name: run.samples for name, run in runs.items()})))
    return path


def episode_em(path: str | Path) -> dict[str, dict[tuple[int, str], float]]:
    """Policy -> {(k, prompt uid): EM} from the episodes.jsonl ``write_report`` writes (paired comparisons
    made later: ``mempo chaos``, bench/starts.py)."""
    out: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["policy"], {})[(int(r["k"]), r["uid"])] = r["em"]
    return out


def noise_lines(metrics_path: Path) -> list[str]:
    """The run's gradient noise scale when its learner measured one (learner.noise_scale), else nothing."""
    from services.learner.noise_scale import b_simple, b_simple_bounds  # torch at its top

    rows = [r for r in read_rows(metrics_path, "train") if "noise/trace" in r]
    if not rows:
        return []
    groups = sum(r["noise/groups"] for r in rows) / len(rows)
    low, high = b_simple_bounds(rows)
    return [f"Gradient noise scale over {len(rows)} steps (learner.noise_scale; services/learner/noise_scale.py): "
            f"B_simple = {b_simple(rows):.1f} prompt groups [90% bootstrap over steps: {low:.1f}, {high:.1f}], "
            f"against {groups:.1f} a step.", ""]


def oversample_lines(metrics_path: Path) -> list[str]:
    """What over-sampling (train.over_sampling) left out of training: groups too old for the lag bound, and
    the buffer each stop dropped; nothing for a run without it."""
    rows = [r for r in read_rows(metrics_path, "train") if "oversample/dropped_groups" in r]
    if not rows:
        return []
    stops = read_rows(metrics_path, "stop")
    at_stops = sum(r.get("oversample/dropped_at_stop_running", 0) + r.get("oversample/dropped_at_stop_buffered", 0)
                   for r in stops)
    lag = max(r.get("version_lag_token_max", 0) for r in rows)
    return [f"Over-sampling: {sum(r['oversample/dropped_groups'] for r in rows):.0f} groups dropped as older than "
            f"train.max_staleness over {len(rows)} steps, {at_stops:.0f} in flight or buffered dropped at "
            f"{len(stops)} stop(s); tokens trained at most {lag:.0f} version(s) old.", ""]


def write_report(run_dir: str | Path, results: dict[str, dict[int, dict]], notes: str = "", runs: dict | None = None,
                 controls: dict[str, dict[int, dict]] | None = None,
                 pairs: list[list[tuple[str, str]]] | None = None) -> dict[str, Path]:
    """report.md (+ eval.json, curves.png, and, when ``runs`` holds the EvalRuns, samples.md with
    samples.json, and episodes.jsonl: one row per policy and prompt, for paired comparisons made later)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"eval": run_dir / "eval.json", "report": run_dir / "report.md"}
    dump = by_str_k(results)
    if controls:
        dump["search_disabled"] = by_str_k(controls)
    paths["eval"].write_text(json.dumps(dump, indent=1))
    curves = plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    text = ["# mempo run report", "", "Held-out prompts, one greedy episode each.", "", markdown_table(results), ""]
    if runs and len(runs) > 1:
        text += ["## Change in EM against the starting policy (paired bootstrap over prompts)", "",
                 delta_table(runs), ""]
    if runs and pairs:
        text += ["## Paired differences between policies", "", pairs_table(runs, pairs), ""]
    if any("well_formed" in row for t in results.values() for row in t.values()):
        text += ["## What the agent did", "", diagnostics_table(results, controls or {}), ""]
    if curves is not None:
        paths["curves"] = curves
        text += ["![training curves](curves.png)", ""]
    text += noise_lines(run_dir / "metrics.jsonl") + oversample_lines(run_dir / "metrics.jsonl")
    if runs:
        paths["samples"] = run_dir / "samples.md"
        paths["samples"].write_text(samples_markdown(runs))
        paths["samples_json"] = write_samples(run_dir, runs)
        paths["episodes"] = run_dir / "episodes.jsonl"
        paths["episodes"].write_text("".join(
            json.dumps({"policy": name, "k": k, "uid": r["uid"], "em": r["em"], "f1": r["f1"]}) + "\n"
            for name, run in runs.items() for k in sorted(run.episodes) for r in run.episodes[k]))
        text += ["Decoded episodes with per-block memory rewards: [samples.md](samples.md)", ""]
    if notes:
        text += [notes, ""]
    paths["report"].write_text("\n".join(text))
    return paths
