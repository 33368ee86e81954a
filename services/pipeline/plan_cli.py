"""``mempo plan``: what a config deploys, whether a cluster holds it, and the files generated from it.

    mempo plan deploy/configs/gpu-qwen2.5-7b.yaml --node 2*CPU=64,GPU=8   # fits these nodes?
    mempo plan deploy/configs/tiny.yaml --serve-config deploy/serve_config.yaml --check

services/pipeline/plan.py does the arithmetic; this module prints it, checks the cluster and writes or
checks the Serve config and the KubeRay manifest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from services.config import MempoConfig
from services.pipeline import plan


def run(cfg: MempoConfig, path: str, overrides: list[str], node: list[str], serve_config: str | None,
        kuberay: str | None, check: bool, card_gib: float = 80.0) -> int:
    """Print the plan of ``cfg`` (loaded from ``path`` with ``overrides``), check it against ``node``
    specs or ray.address, and write (or, with ``check``, compare) the Serve config and KubeRay manifest
    (the learner's memory per rank, and on GPUs the fewest ranks that fit a ``card_gib`` GiB card, when
    model.path's config.json is on this machine);
    0 when everything fits and matches, 1 otherwise, 2 for overrides with generated files."""
    if overrides and (serve_config or kuberay):
        print("error: generated files take the recipe as it is; put overrides in the config file", file=sys.stderr)
        return 2
    units = plan.actors(cfg)
    print(f"plan of {path}" + (f" with {' '.join(overrides)}" if overrides else ""))
    print(plan.describe(units))
    for w in plan.http_warnings(cfg, generated=bool(serve_config or kuberay)):
        print(f"warning: {w}")
    for line in plan.learner_memory(cfg, card_gib):
        print(line)
    ok = True
    nodes, where = None, ""
    if node:
        nodes = plan.parse_nodes(node)
        where = f"the {len(nodes)} given node(s)"
    elif cfg.ray.address and not (serve_config or kuberay):
        try:
            nodes, where = plan.cluster_nodes(cfg.ray.address), f"the cluster at ray.address={cfg.ray.address}"
        except ConnectionError as e:
            print(f"not checked against a cluster: ray.address={cfg.ray.address} cannot be reached ({e}); "
                  f"start it, or pass --node specs")
    if nodes is not None:
        ok &= report_fit(plan.fit(units, nodes), where)
    rel = plan.config_relpath(path)
    if serve_config:
        text = plan.serve_config_text(cfg, rel, serve_config)
        ok &= write_or_check(Path(serve_config), text, check, yaml.safe_load)
    if kuberay:
        target = Path(kuberay)
        manifest = yaml.safe_load(target.read_text())
        try:
            serve = plan.serve_config(cfg, plan.kuberay_config_path(manifest, rel))
            pods = {at_most: plan.kuberay_nodes(manifest, at_most) for at_most in (False, True)}
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(f"{target} is not a RayService manifest with a head group and a container "
                             f"({type(e).__name__}: {e})") from None
        text = plan.kuberay_with_serve_config(target.read_text(), serve)
        serve_of = lambda t: yaml.safe_load(yaml.safe_load(t)["spec"]["serveConfigV2"])  # noqa: E731
        ok &= write_or_check(target, text, check, serve_of)
        for at_most, nodes in pods.items():
            ok &= report_fit(plan.fit(units, nodes), f"{target}'s {len(nodes)} pod(s) at "
                                                       f"{'maxReplicas' if at_most else 'minReplicas'}", strict=at_most)
    return 0 if ok else 1


def report_fit(result: tuple[list[str], list[str]], where: str, strict: bool = True) -> bool:
    errors, warnings = result
    for w in warnings:
        print(f"warning: {w}")
    if errors:
        print(f"{'error' if strict else 'note'}: {where} cannot hold this plan:\n  " + "\n  ".join(errors),
              file=sys.stderr if strict else sys.stdout)
        return not strict
    print(f"fits {where}")
    return True


def write_or_check(target: Path, text: str, check: bool, parse) -> bool:
    if not check:
        target.write_text(text)
        print(f"wrote {target}")
        return True
    if not target.is_file():
        print(f"error: {target} does not exist; run without --check to write it", file=sys.stderr)
        return False
    if parse(target.read_text()) != parse(text):
        print(f"error: {target} has drifted from the recipe; run the same command without --check to rewrite it",
              file=sys.stderr)
        return False
    print(f"{target} matches the recipe")
    return True
