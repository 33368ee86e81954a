"""The invariants ``mempo chaos`` checks after a run, each from a record the faults cannot rewrite.

    violations = check_training(cfg, run_dir, steps)     # the learner's ledger, metrics.jsonl, checkpoints
    violations += check_rest(calls)                      # the REST load's status codes
    table = overhead(ledger_rows, faults)                # seconds each fault kind added to its step

A violation is one line saying what broke and where. Checked:

- **every step trains each of its prompt groups exactly once**: the lineage of the learner's ledger
  (services/learner/ledger.py) has steps 1..N once each, no step was trained twice without a rollback
  between, and step s trained exactly the prompts ``PromptStream.at(s - 1)`` gives (each uid as many
  groups as it appears there, ``rollout.n`` episodes per group). With ``train.over_sampling`` a step
  trains ``prompts_per_step`` groups drawn by the steps its lag bound allows (services/pipeline/
  oversample.py: blocks s - 1 - max_staleness .. s - 1), and over the run no drawn group twice;
- **versions never go backwards, and each trained sample names the one that produced it**: the turns
  step s trained on were sampled at versions within [s - 1 - max_staleness, s - 1], the memories
  scored likewise, and the lowest version trained on never falls from one step to the next (with
  over-sampling it may: a buffered group can be older than the previous step's);
- **checkpoints are never half-written**: every start of a learner group at step c has the weights
  the ledger recorded when step c was trained (digest), i.e. a resume after any fault continues from
  the same weights, step and prompts as an unfaulted resume; every checkpoint marked complete has its
  trainer state, DCP metadata and one RNG file per rank;
- **the driver's log is whole**: metrics.jsonl has one train row per step, 1..N;
- **REST**: no response is a 5xx other than 503 with Retry-After, and every request gets an answer
  within the load's client timeout.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from services.config import MempoConfig
from services.common.data import PromptStream, load_prompts
from services.common.paths import data_path
from services.learner import ledger
from services.pipeline.runlog import read_rows

DIGEST_RTOL = 1e-9  # a resharded sum of |p| may add in another order


def expected_prompts(cfg: MempoConfig, steps: int) -> dict[int, Counter]:
    """Step (1-based) -> the prompt uids it must train, with their multiplicity."""
    stream = PromptStream(load_prompts(data_path(cfg, "train"), cfg.rollout.system_prompt, setting="train.data"),
                          cfg.train.prompts_per_step, cfg.train.seed)
    return {s: Counter(p.uid for p in stream.at(s - 1)) for s in range(1, steps + 1)}


def drawn_prompts(cfg: MempoConfig, steps: int) -> tuple[dict[int, Counter], Counter]:
    """Over-sampling: (step (1-based) -> the uids its groups may come from, every uid the run drew), with
    their multiplicity: step s trains groups launched for steps s - 1 - max_staleness .. s - 1, each of
    which drew from its own block of T positions of the prompt order."""
    stream = PromptStream(load_prompts(data_path(cfg, "train"), cfg.rollout.system_prompt, setting="train.data"),
                          cfg.train.prompts_per_step, cfg.train.seed)
    t_ = cfg.train.groups_in_flight
    blocks = [Counter(stream.prompt_at(t * t_ + i).uid for i in range(t_)) for t in range(steps)]
    window = {s: sum((blocks[t] for t in range(max(0, s - 1 - cfg.train.max_staleness), s)), Counter())
              for s in range(1, steps + 1)}
    return window, sum(blocks, Counter())


def _oversampled(kept: dict, window: dict[int, Counter], drawn: Counter, per_step: int) -> list[str]:
    """Each step's groups from its window, prompts_per_step of them; no drawn group trained twice."""
    out, total = [], Counter()
    for s in sorted(set(kept) & set(window)):
        got = Counter({uid: groups for uid, (groups, _) in kept[s]["prompts"].items()})
        total += got
        if sum(got.values()) != per_step:
            out.append(f"step {s}: trained {sum(got.values())} prompt groups, not train.prompts_per_step={per_step}")
        if got - window[s]:
            out.append(f"step {s}: prompt groups not drawn for it {sorted((got - window[s]).elements())}")
    if total - drawn:
        out.append(f"prompt groups trained more often than drawn: {sorted((total - drawn).elements())}")
    return out


def check_lineage(rows: list[dict], expected: dict[int, Counter], n: int, max_staleness: int,
                  oversampled: tuple[dict[int, Counter], Counter, int] | None = None) -> list[str]:
    """``oversampled``: (``drawn_prompts``' window and draws, prompts_per_step) when the run over-sampled;
    ``expected`` then only gives the steps."""
    out = []
    kept, _, twice = ledger.lineage(rows)
    out += [f"step {r['step']} trained twice with no rollback between (ledger)" for r in twice]
    missing = sorted(set(expected) - set(kept))
    extra = sorted(set(kept) - set(expected))
    if missing:
        out.append(f"steps never trained: {missing}")
    if extra:
        out.append(f"steps trained beyond the run's end: {extra}")
    if oversampled is not None:
        out += _oversampled(kept, *oversampled)
    floor = -1
    for s in sorted(set(kept) & set(expected)):
        row = kept[s]
        got = {uid: groups for uid, (groups, _) in row["prompts"].items()}
        if oversampled is None and got != dict(expected[s]):
            lost = sorted((expected[s] - Counter(got)).elements())
            dup = sorted((Counter(got) - expected[s]).elements())
            out.append(f"step {s}: prompt groups lost {lost}, extra or twice {dup}")
        bad_n = sorted(uid for uid, (groups, eps) in row["prompts"].items() if eps != groups * n)
        if bad_n:
            out.append(f"step {s}: episodes per group != rollout.n={n} for {bad_n}")
        lo, hi = s - 1 - max_staleness, s - 1
        versions = row["turn_versions"] + row["score_versions"]
        if not row["turn_versions"]:
            out.append(f"step {s}: trained on no turns")
        if any(v < lo or v > hi for v in versions):
            out.append(f"step {s}: trained on versions {row['turn_versions']} / scored by {row['score_versions']}, "
                       f"outside [{lo}, {hi}]")
        if row["turn_versions"] and oversampled is None:
            if row["turn_versions"][0] < floor:
                out.append(f"step {s}: sampled at version {row['turn_versions'][0]}, below step {s - 1}'s {floor}")
            floor = max(floor, row["turn_versions"][0])
    return out


def check_starts(rows: list[dict]) -> list[str]:
    """Every start at step c holds the weights step c left (or, at 0, the first start's)."""
    out, digest_at = [], {}
    for row in rows:
        if row["event"] == "trained":
            digest_at[row["step"]] = row["digest"]
        elif row["event"] == "start":
            want = digest_at.get(row["step"])
            if want is None:
                digest_at[row["step"]] = row["digest"]  # the first start at this step (0: the initial weights)
            elif abs(row["digest"] - want) > DIGEST_RTOL * max(abs(want), 1.0):
                out.append(f"a learner {row['why']} start at step {row['step']} holds weights of digest "
                           f"{row['digest']!r}, not step {row['step']}'s {want!r}: the resumed weights differ")
            for s in [s for s in digest_at if s > row["step"]]:  # rolled back: a later retrain may differ
                del digest_at[s]
    return out


def check_checkpoints(run_dir: Path) -> list[str]:
    out = []
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        if not (path / "COMPLETE").is_file():
            continue  # skipped by every resume (services/learner/checkpoint.py latest_complete)
        try:
            meta = json.loads((path / "trainer.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            out.append(f"{path.name}: marked complete, trainer.json unreadable ({e})")
            continue
        world = int(meta.get("world_size", 0))
        rng = sorted(p.name for p in path.glob("rng_rank*.pt"))
        if meta.get("step") != int(path.name.removeprefix("step_")):
            out.append(f"{path.name}: trainer.json says step {meta.get('step')}")
        if not (path / ".metadata").is_file():
            out.append(f"{path.name}: marked complete without DCP .metadata")
        if len(rng) != world:
            out.append(f"{path.name}: {len(rng)} RNG files for {world} ranks")
    return out


def check_log(run_dir: Path, steps: int) -> list[str]:
    logged = [r["step"] for r in read_rows(run_dir / "metrics.jsonl", "train")]
    if logged != list(range(1, steps + 1)):
        dup = sorted(s for s, c in Counter(logged).items() if c > 1)
        return [f"metrics.jsonl train rows: missing {sorted(set(range(1, steps + 1)) - set(logged))}, twice {dup}"]
    return []


def check_training(cfg: MempoConfig, run_dir: str | Path, steps: int) -> list[str]:
    run_dir = Path(run_dir)
    rows = ledger.read(run_dir)
    if not rows:
        return [f"no ledger in {run_dir}"]
    over = (*drawn_prompts(cfg, steps), cfg.train.prompts_per_step) if cfg.train.over_sampling > 1 else None
    return (check_lineage(rows, expected_prompts(cfg, steps), cfg.rollout.n, cfg.train.max_staleness, over)
            + check_starts(rows) + check_checkpoints(run_dir) + check_log(run_dir, steps))


def check_rest(calls: list[dict]) -> list[str]:
    """``calls``: the REST load's records ({"status", "retry_after", "error"}); status 0 = no answer
    within the client's timeout (a request that hangs is as broken as a 500)."""
    bad = Counter(c["status"] for c in calls if c["status"] >= 500 and not (c["status"] == 503 and c["retry_after"]))
    out = [f"REST: {count} response(s) with status {status}" + (" without Retry-After" if status == 503 else "")
           for status, count in sorted(bad.items())]
    lost = Counter(c.get("error") or "no answer" for c in calls if c["status"] == 0)
    out += [f"REST: {count} request(s) got no answer ({error})" for error, count in sorted(lost.items())]
    return out


def step_times(rows: list[dict]) -> dict[int, float]:
    """Lineage step -> when its trained line was written; step 0 -> the first start."""
    kept, _, _ = ledger.lineage(rows)
    out = {s: r["time"] for s, r in kept.items()}
    starts = [r["time"] for r in rows if r["event"] == "start"]
    if starts:
        out[0] = starts[0]
    return out


def overhead(rows: list[dict], faults: list[dict]) -> dict[str, dict]:
    """Fault kind -> {"injected", "steps", "overhead_s"}: the mean over its faults of the seconds the
    two steps from the fault's step on took beyond two median clean steps (a fault's cost spills into the
    next step: a driver restarted, a replica still starting; a step with two faults counts for both).
    Also "median_clean_step_s", the median step that no fault touched."""
    at = step_times(rows)
    secs = {s: at[s] - at[s - 1] for s in at if s > 0 and s - 1 in at}
    hit = {f["step"] for f in faults} | {f["step"] + 1 for f in faults}
    clean = [v for s, v in secs.items() if s not in hit and s > 1]
    base = statistics.median(clean) if clean else 0.0
    out: dict[str, dict] = {}
    for f in faults:
        entry = out.setdefault(f["kind"], {"injected": 0, "steps": [], "extra": []})
        entry["injected"] += 1
        entry["steps"].append(f["step"])
        s = f["step"]
        last = s + 1 if s + 1 in at else s
        if s - 1 in at and last in at:
            entry["extra"].append(at[last] - at[s - 1] - (last - s + 1) * base)
    for entry in out.values():
        extra = entry.pop("extra")
        entry["overhead_s"] = sum(extra) / len(extra) if extra else 0.0
    return {"median_clean_step_s": base, **out}
