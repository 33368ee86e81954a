"""``mempo eval``: deploy search + rollout + scorer once, then evaluate each policy in turn by
publishing its weights to the running replicas (no engine restart between policies).

    mempo eval deploy/configs/tiny.yaml --policy sft=runs/tiny/sft/model --policy rl=runs/tiny/policy --report
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from services.config import MempoConfig
from services.common.paths import corpus_needed, is_adapter_folder
from services.pipeline.report import diagnostics_table, markdown_table, pairs_table, write_report
from services.pipeline.runlog import read_rows
from services.pipeline.trackers import check_loggers, track_results
from services.pipeline.view import write_view


def default_policies(cfg: MempoConfig) -> list[str]:
    from services.pipeline.sft import sft_dir  # torch (`mempo --help` imports this module)

    found = {"sft": sft_dir(cfg), "rl": Path(cfg.train.run_dir) / "policy"}
    return [f"{name}={path}" for name, path in found.items() if (path / "config.json").is_file()]


def parse_policies(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--policy {spec!r}: expected NAME=DIR")
        if is_adapter_folder(path):
            from services.common.lora import merged_policy  # torch, peft on use

            path = str(merged_policy(path, f"--policy {name}"))  # a LoRA adapter folder: merged into its base
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"--policy {name}: {path} is not a Hugging Face model directory (no config.json) "
                                    "nor a PEFT LoRA adapter folder (adapter_config.json)")
        if name in out:
            raise ValueError(f"--policy {name} given twice")
        out[name] = path
    return out


def parse_pairs(specs: list[str], policies: dict[str, str]) -> list[list[tuple[str, str]]]:
    """``A:B[,A2:B2...]`` specs (EM of B against A; a comma-separated group is one comparison made
    several times, e.g. once per seed) naming evaluated policies."""
    out = []
    for spec in specs:
        group = []
        for one in spec.split(","):
            a, sep, b = one.strip().partition(":")
            if not sep or a not in policies or b not in policies or a == b:
                raise ValueError(f"--pair {spec!r}: expected A:B[,A2:B2 ...] with two different policies among "
                                 f"{', '.join(policies)}")
            group.append((a, b))
        out.append(group)
    return out


def run_eval(cfg: MempoConfig, specs: list[str], report: bool, pair_specs: list[str] = ()) -> int:
    """Evaluate each policy on the same held-out prompts and print the paired differences asked for;
    with ``report``, also with search disabled (the no-retrieval control) and write report.md,
    eval.json, episodes.jsonl, samples.md and curves.png."""
    # imported on use, so that `mempo --help` (which imports this module) loads none of these:
    from services.common.model_checks import check_model  # torch (model_io)
    from services.pipeline.apps import Pipeline  # pandas (the world), Ray on use
    from services.pipeline.evaluate import eval_prompts, run_eval as run_pass  # Ray and torch
    from services.world.build import prepare_world  # pandas

    check_loggers(cfg.train.loggers)  # a missing wandb / mlflow package, before anything starts
    policies = parse_policies(specs or default_policies(cfg))
    if not policies:
        raise FileNotFoundError(f"nothing to evaluate: no --policy given and no sft/rl policy in {cfg.train.run_dir}")
    pairs = parse_pairs(list(pair_specs), policies)
    for name, path in policies.items():
        check_model(path, f"--policy {name}")
    cfg = prepare_world(cfg, needs=("eval.data",) + corpus_needed(cfg)).model_copy(deep=True)
    cfg.model.path = next(iter(policies.values()))  # the engines start on the first policy's weights
    prompts = eval_prompts(cfg, cfg.eval.questions_per_k)
    pipe = Pipeline.start(cfg, ("search", "rollout", "scorer"))
    runs, controls = {}, {}
    for i, (name, path) in enumerate(tqdm(policies.items(), desc="mempo eval", unit="policy", dynamic_ncols=True)):
        if i:
            pipe.publish_model(path, version=1000 + i)
        runs[name] = run_pass(cfg, pipe, prompts, step=0)
        if report:
            controls[name] = run_pass(cfg, pipe, prompts, step=0, search=False).table()
    results = {name: run.table() for name, run in runs.items()}
    print(markdown_table(results), flush=True)
    print(diagnostics_table(results, controls), flush=True)
    if pairs:
        print(pairs_table(runs, pairs), flush=True)
    if report:
        paths = write_report(cfg.train.run_dir, results, runs=runs, controls=controls, pairs=pairs)
        paths["view"] = write_view(cfg.train.run_dir)  # the same run as one page (`mempo view`)
        print("report: " + ", ".join(str(p) for p in paths.values()), flush=True)
    pipe.shutdown()
    # the held-out table (and the report's files) into the run folder's W&B / MLflow run, at its last trained step
    run_dir = Path(cfg.train.run_dir)
    step = max([r["step"] for r in read_rows(run_dir / "metrics.jsonl", "train")] or [0])
    track_results(cfg, run_dir, "eval", step, results, list(paths.values()) if report else [])
    return 0

