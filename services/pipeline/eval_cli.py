"""``mempo eval``: deploy search + rollout + scorer once, then evaluate each policy in turn by
publishing its weights to the running replicas (no engine restart between policies).

    mempo eval deploy/configs/tiny.yaml --policy sft=runs/tiny/sft/model --policy rl=runs/tiny/policy --report
"""

from __future__ import annotations

from pathlib import Path

from services.common.config import MempoConfig


def default_policies(cfg: MempoConfig) -> list[str]:
    from services.pipeline.sft import sft_dir

    found = {"sft": sft_dir(cfg), "rl": Path(cfg.train.run_dir) / "policy"}
    return [f"{name}={path}" for name, path in found.items() if (path / "config.json").is_file()]


def parse_policies(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--policy {spec!r}: expected NAME=DIR")
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"--policy {name}: {path} is not a Hugging Face model directory (no config.json)")
        if name in out:
            raise ValueError(f"--policy {name} given twice")
        out[name] = path
    return out


def run_eval(cfg: MempoConfig, specs: list[str], report: bool) -> int:
    from tqdm import tqdm

    from services.pipeline.apps import Pipeline
    from services.pipeline.evaluate import eval_prompts, evaluate
    from services.pipeline.report import markdown_table, write_report
    from services.world.build import ensure_world

    policies = parse_policies(specs or default_policies(cfg))
    if not policies:
        raise FileNotFoundError(f"nothing to evaluate: no --policy given and no sft/rl policy in {cfg.train.run_dir}")
    ensure_world(cfg)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = next(iter(policies.values()))  # the engines start on the first policy's weights
    prompts = eval_prompts(cfg, cfg.eval.questions_per_k)
    pipe = Pipeline.start(cfg, ("search", "rollout", "scorer"))
    results = {}
    for i, (name, path) in enumerate(tqdm(policies.items(), desc="mempo eval", unit="policy", dynamic_ncols=True)):
        if i:
            pipe.publish_model(path, version=1000 + i)
        results[name] = evaluate(cfg, pipe, prompts, step=0)
    print(markdown_table(results), flush=True)
    if report:
        paths = write_report(cfg.train.run_dir, results)
        print("report: " + ", ".join(str(p) for p in paths.values()), flush=True)
    pipe.shutdown()
    return 0
