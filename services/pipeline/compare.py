"""``mempo compare``: the paper's comparison in miniature, from one SFT start.

    mempo compare deploy/configs/tiny.yaml [key=value ...]      # or: make compare
    -> <run_dir>/compare/{mempo,mem1,search_r1}/   one RL run each (metrics, checkpoints, policy)
       <run_dir>/compare/report.md, eval.json, compare.png
    mempo compare CONFIG --seeds 3 --variants mempo,mem1,search_r1:1   # or: make compare SEEDS=3
    -> <run_dir>/compare/mempo-s0/ ... mem1-s2/, search_r1-s0/          (train.seed, +1, +2; ':1' caps a variant)

RL runs with the same steps, seed, prompts and budget, each starting from the same SFT policy
(``<run_dir>/sft/model``, trained first if missing), one per variant of ``VARIANTS`` below (the
registry: name, title, overrides, whether ``mempo compare`` runs it by default; ``--variants``
picks others; ``mempo compare --help`` lists them all): by default MemPO, MEM1-like (no memory
reward) and Search-R1-like (full history). A variant marked ``own_start`` (``search_r1_own``) starts instead from
an SFT policy of its own, trained on the same transcripts under its overrides (for Search-R1-like:
every turn under the full history) into ``<run_dir>/starts/<name>/sft/model`` before any service
starts, if that folder holds none yet (copy or link a policy there to reuse one); it is evaluated
once, as ``sft:<name>``, and the variant's change is measured against it.

The services stay up between variants: a deployment whose config sections a variant leaves alone
(services/config.py) keeps its replicas, and the SFT start is published to them at
version 0, the weights a fresh replica loads; only what the variant changes restarts (the learner
always: its run, optimizer and policy are the variant's own). ``startup.json`` records each variant's
start-up seconds per service and the replicas that served it.

Each variant is evaluated on the same held-out prompts (``eval.questions_per_k`` per k, greedy) by
the pipeline it trained on, so it runs under its own context rule; the SFT start is evaluated once
under MemPO's rule. The report gives EM with its 95% CI, F1, turns, total tokens (TT) and peak
tokens (PT) per k, each variant's EM change against the start (paired bootstrap), the first
variant against each other one (paired per prompt at the same seed), and one plot with the
variants' held-out EM and token curves. There is no periodic evaluation during training unless
``train.eval_every=N`` is given (the final one is the comparison; the plot's EM then joins each
start's to its run's). With several seeds (``--seeds``), the runs go seed by seed
(every variant of a seed, then the next seed), each paired difference is also given averaged over
the seeds (per prompt, then bootstrapped over prompts), and a run already complete in its folder is
resumed, not redone: the same command continues a comparison that was stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.config import MempoConfig, field_baselines, load_config
from services.common.paths import check_no_silent_world, corpus_needed
from services.pipeline.report import by_str_k, draw_panels, markdown_table, pairs_table, write_samples
from services.pipeline.runlog import read_rows
from services.pipeline.trackers import check_loggers, track_results

@dataclass(frozen=True)
class Variant:
    """One baseline of ``mempo compare``: the config overrides that make it from the defaults."""

    name: str
    title: str  # what the README's baseline table calls it
    overrides: tuple[str, ...]
    default: bool  # run by `mempo compare` (and `make compare`) without --variants
    own_start: bool = False  # starts from an SFT policy trained under its own overrides, not the common one


# The registry every list of baselines reads (the CLI's help, `mempo compare`, the README's table,
# which tests/pipeline/test_variants.py checks against it): a baseline that combines existing settings
# is one entry here; a config field made for a baseline carries it as a mark instead
# (services/common/config_fields.py baseline(): mem_only is algorithm.outcome_on_mem's), collected last.
_ENTRIES = (
    Variant("mempo", "MemPO (memory context + memory reward)", (), True),
    Variant("mem1", "MEM1-like GRPO (memory context, no memory reward)", ("algorithm.use_memory_reward=false",), True),
    Variant("search_r1", "Search-R1-like GRPO (full history)",
            ("rollout.memory_window=full", "algorithm.use_memory_reward=false"), True),
    Variant("mempo_ref", "MemPO with the reference's memory reward",
            ("scorer.filter_mode=independent", "scorer.average=geometric", "scorer.answer_template=reference"), False),
    # each question's section of a memory credited with that question's own R_mem (shown answers)
    Variant("mempo_q", "MemPO, per-question memory credit on shown answers",
            ("scorer.scored_answers=shown", "algorithm.mem_credit_scope=question"), False),
    # a start of its own: a policy SFT-trained on memory contexts reads full histories badly
    Variant("search_r1_own", "Search-R1-like GRPO from its own full-history SFT start",
            ("rollout.memory_window=full", "algorithm.use_memory_reward=false"), False, own_start=True),
) + tuple(Variant(name, title, (override,), default) for name, title, override, default in field_baselines(MempoConfig))
VARIANTS: dict[str, Variant] = {v.name: v for v in _ENTRIES}
if len(VARIANTS) != len(_ENTRIES):
    raise ValueError(f"a baseline name is registered twice: {[v.name for v in _ENTRIES]}")
DEFAULT_VARIANTS = tuple(n for n, v in VARIANTS.items() if v.default)  # what `mempo compare` runs without --variants


def baseline_table() -> str:
    """The README's baseline table, rendered from the registry (tests/pipeline/test_variants.py checks
    the README holds exactly this)."""
    rows = ["| run | `mempo compare` name | overrides |", "|---|---|---|"]
    for v in VARIANTS.values():
        overrides = f"`{' '.join(v.overrides)}`" if v.overrides else "(defaults)"
        if v.own_start:
            overrides += f", from an SFT start trained under them (`<run_dir>/starts/{v.name}/`)"
        rows.append(f"| {v.title} | `{v.name}`{'' if v.default else ' (with `--variants`)'} | {overrides} |")
    return "\n".join(rows)


def variants_help() -> str:
    """One line per registered variant, for ``mempo compare --help``."""
    return "; ".join(f"{v.name}{' (default)' if v.default else ''}: {' '.join(v.overrides) or 'the defaults'}"
                     f"{' from its own SFT start' if v.own_start else ''}" for v in VARIANTS.values())


@dataclass(frozen=True)
class Run:
    """One RL run of a comparison: a variant at one seed."""

    variant: str
    seed: int
    label: str  # its name in tables: the variant's, or "<variant>@s<seed>" when the comparison has several seeds
    folder: str  # under <run_dir>/compare/


def parse_variants(spec: str) -> list[tuple[str, int | None]]:
    """``mempo,mem1,search_r1:1`` -> [(name, most seeds or None)]; unknown names fail with the choices."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, cap = item.partition(":")
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        if cap and not (cap.isdigit() and int(cap) >= 1):
            raise ValueError(f"variant {item!r}: the seed count after ':' must be a whole number >= 1")
        if name in (n for n, _ in out):
            raise ValueError(f"variant {name!r} given twice")
        out.append((name, int(cap) if cap else None))
    return out


def plan_runs(variants: list[tuple[str, int | None]], first_seed: int, seeds: int) -> list[Run]:
    """The runs in the order they train: seed by seed, each seed's variants in the order given, a
    variant with a cap only at its first ``cap`` seeds. One seed keeps the plain layout (``compare/<name>``)."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    runs = []
    for i in range(seeds):
        for name, cap in variants:
            if cap is None or i < cap:
                seed = first_seed + i
                runs.append(Run(name, seed, *((name, name) if seeds == 1 else (f"{name}@s{seed}", f"{name}-s{seed}"))))
    return runs


def variant_config(path: str | None, overrides: list[str], run: Run, sft: Path) -> MempoConfig:
    base = load_config(path, overrides)
    out = Path(base.train.run_dir) / "compare" / run.folder
    return load_config(path, overrides + list(VARIANTS[run.variant].overrides) + [
        f"train.run_dir={out}", f"train.sft_dir={sft}", "train.init_from_sft=true", f"train.seed={run.seed}"])


def start_label(variant: str) -> str:
    """The name a variant's SFT start has in tables: ``sft`` (the common start) or ``sft:<variant>``."""
    return f"sft:{variant}" if VARIANTS[variant].own_start else "sft"


def start_config(path: str | None, overrides: list[str], variant: str) -> MempoConfig:
    """The SFT config of an own-start variant: the run's config with the variant's overrides, trained
    into ``<run_dir>/starts/<variant>/`` (its policy in ``sft/model`` there, whatever ``train.sft_dir`` says)."""
    home = Path(load_config(path, overrides).train.run_dir) / "starts" / variant
    return load_config(path, overrides + list(VARIANTS[variant].overrides) + [
        f"train.run_dir={home}", f"train.sft_dir={home / 'sft' / 'model'}"])


def seed_tables(plan: list[Run], runs: dict) -> str:
    """Each variant's EM change against the SFT start and the first variant against each other one,
    at every seed they share and, with several seeds, averaged over them (report.pairs_table)."""
    by_variant: dict[str, dict[int, str]] = {}
    for r in plan:
        by_variant.setdefault(r.variant, {})[r.seed] = r.label
    names = list(by_variant)
    against_start = [[(start_label(n), label) for label in by_variant[n].values()] for n in names]
    first = by_variant[names[0]]
    head_to_head = [[(other[s], first[s]) for s in first if s in other]
                    for other in (by_variant[n] for n in names[1:])]
    text = ["## EM against the SFT start, per seed and averaged over seeds (paired per prompt)", "",
            pairs_table(runs, against_start)]
    if any(head_to_head):
        text += ["", f"## {names[0]} against each other variant (paired per prompt, same seed; the mean over "
                     "seeds averages each prompt's differences, its CI is over prompts only; from three seeds on, the "
                     "`over seeds` rows give a Student's t CI with each seed as one observation)", "",
                 pairs_table(runs, [p for p in head_to_head if p])]
    return "\n".join(text)


def compare(path: str | None, overrides: list[str], variants: str | None = None,
            seeds: int = 1) -> dict[str, Path]:
    """Train and evaluate the runs of :func:`plan_runs` (``variants``: ``mempo,mem1,search_r1:1``, default
    the registry's default set); returns the paths of the report, eval.json and the plot."""
    # imported on use, so that `mempo compare --help` (which lists VARIANTS) loads none of these:
    from services.pipeline.evaluate import eval_prompts, run_eval  # Ray and torch
    from services.pipeline.sft import run_sft, sft_dir  # torch
    from services.pipeline.train import train  # Ray and torch
    from services.world.build import prepare_world  # pandas

    overrides = with_compare_defaults(overrides)
    base = load_config(path, overrides)
    check_loggers(base.train.loggers)  # a missing wandb / mlflow package, before anything starts
    # before the SFT: a comparison reads every data path
    check_no_silent_world(base, ("train.data", "eval.data", "train.sft_data") + corpus_needed(base))
    plan = plan_runs(parse_variants(variants or ",".join(DEFAULT_VARIANTS)), base.train.seed, seeds)
    sft = sft_dir(base)
    if not (sft / "config.json").is_file():
        run_sft(base)
    start_of = {}  # each variant's SFT start: the common one, or its own (trained now: SFT needs the cores)
    for name in dict.fromkeys(r.variant for r in plan):
        start_of[name] = sft
        if VARIANTS[name].own_start:
            own = start_config(path, overrides, name)
            start_of[name] = sft_dir(own)
            if not (start_of[name] / "config.json").is_file():
                run_sft(own)
    out_dir = Path(base.train.run_dir) / "compare"
    prompts = eval_prompts(prepare_world(base), base.eval.questions_per_k)
    runs, startup, pipe = {}, {}, None
    try:
        for run in plan:
            start, start_name = start_of[run.variant], start_label(run.variant)
            if pipe is not None:  # kept replicas get the start a fresh one would load (model.path, version 0)
                pipe.publish_model(str(start), version=0)
            cfg = variant_config(path, overrides, run, start)
            pipe = train(cfg)["pipeline"]  # resumes a run its folder already holds (returns at once when complete)
            startup[run.label] = {"start_s": pipe.start_s, "replicas": pipe.replica_names()}
            if start_name not in runs:  # each start once, under the context rule of its first variant
                pipe.publish_model(str(start), version=10_000)
                runs[start_name] = run_eval(cfg, pipe, prompts)
                pipe.publish_model(str(Path(cfg.train.run_dir) / "policy"), version=10_001)
            runs[run.label] = run_eval(cfg, pipe, prompts)
            # the variant's own held-out table and episodes beside its run, so `mempo view` shows them
            mine = {"sft": runs[start_name], run.variant: runs[run.label]}
            write_samples(cfg.train.run_dir, mine)
            (Path(cfg.train.run_dir) / "eval.json").write_text(json.dumps(
                by_str_k({n: r.table() for n, r in mine.items()}), indent=1))
    finally:
        if pipe is not None:
            pipe.shutdown()
    (out_dir / "startup.json").write_text(json.dumps(startup, indent=1))
    results = {name: run.table() for name, run in runs.items()}
    paths = {"report": out_dir / "report.md", "eval": out_dir / "eval.json", "plot": out_dir / "compare.png"}
    paths["eval"].write_text(json.dumps(by_str_k(results), indent=1))
    plot_compare({r.label: out_dir / r.folder / "metrics.jsonl" for r in plan}, paths["plot"],
                 {r.label: (runs[start_label(r.variant)].table(), runs[r.label].table()) for r in plan}, base.train.steps)
    steps, seed_list = base.train.steps, sorted({r.seed for r in plan})
    text = ["# mempo compare", "",
            f"Same SFT start{own_note(plan)}, {steps} RL steps each, seed(s) {', '.join(map(str, seed_list))}; "
            f"{base.eval.questions_per_k} held-out "
            "prompts per k, one greedy episode each. TT = total tokens per task, PT = peak tokens of one turn.", "",
            markdown_table(results), "", seed_tables(plan, runs), "",
            "![held-out EM and tokens per variant](compare.png)", "",
            "## Start-up seconds per service (a kept service only checks its version)", "",
            startup_table(startup), ""]
    paths["report"].write_text("\n".join(text))
    track_results(base, out_dir, "compare", steps, results, list(paths.values()))  # W&B / MLflow, when chosen
    print(markdown_table(results), flush=True)
    print(seed_tables(plan, runs), flush=True)
    print("report: " + ", ".join(str(p) for p in paths.values()), flush=True)
    return paths


def own_note(plan: list[Run]) -> str:
    """The report's note on variants that start from their own SFT policy (none: empty)."""
    own = [n for n in dict.fromkeys(r.variant for r in plan) if VARIANTS[n].own_start]
    return f" (except {', '.join(own)}: {'its' if len(own) == 1 else 'their'} own, `sft:<name>`)" if own else ""


def startup_table(startup: dict) -> str:
    """Markdown: each variant's start-up seconds per service, counted from the one call that deploys them all
    (they start side by side, so the pipeline is up after the largest); * marks a service whose replicas the
    previous variant's run had (kept, not restarted)."""
    services = list(next(iter(startup.values()))["start_s"]) if startup else []
    lines = ["| variant | " + " | ".join(services) + " | up after |", "|---" * (len(services) + 2) + "|"]
    previous: dict = {}
    for name, row in startup.items():
        cells = []
        for s in services:
            kept = bool(row["replicas"].get(s)) and row["replicas"].get(s) == previous.get(s)
            cells.append(f"{row['start_s'][s]:.1f}{'*' if kept else ''}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {max(row['start_s'].values()):.1f} |")
        previous = row["replicas"]
    return "\n".join(lines)


def with_compare_defaults(overrides: list[str]) -> list[str]:
    """``overrides`` behind compare's own defaults, so the user's win: no periodic evaluation during
    training (``train.eval_every=0``; the final held-out evaluation of every run is the comparison, and
    the periodic one, on fewer prompts, only adds minutes to every run)."""
    return ["train.eval_every=0", *overrides]


def end_points(tables: tuple[dict, dict] | None, steps: int) -> list[dict]:
    """A run without periodic evals as two eval rows: its start's EM (mean over k) at step 0, its own at
    ``steps``."""
    return [{"step": step, "em": sum(row["em"] for row in table.values()) / len(table)}
            for step, table in zip((0, steps), tables or ()) if table]


def plot_compare(metrics: dict[str, Path], out: Path, final: dict[str, tuple[dict, dict]] | None = None,
                 steps: int = 0) -> Path:
    """Held-out EM, peak and total tokens per step, one line per variant. EM comes from the periodic
    evals where a run has them; otherwise from ``final`` ({variant: (its start's table, its table)}):
    the start's pooled EM at step 0 and the run's at ``steps``."""
    def rows(path: Path, kind: str) -> list[dict]:
        return read_rows(path, kind) if path.is_file() else []

    final = final or {}
    panels = [("held-out EM (mean over k)", [("em", rows(path, "eval") or end_points(final.get(name), steps), name)
                                             for name, path in metrics.items()])]
    panels += [(title, [(key, rows(path, "train"), name) for name, path in metrics.items()])
               for title, key in (("peak tokens per turn (train)", "rollout/peak_tokens_mean"),
                                  ("total tokens per episode (train)", "rollout/total_tokens_mean"))]
    return draw_panels(panels, out)
