"""The baseline registry (services/pipeline/compare.py VARIANTS) is the one list of baselines: each
variant's config differs from MemPO's only where its overrides say, and the README shows the table the
registry renders."""

from pathlib import Path

import pytest

from services.common.config import load_config, replica_config
from services.common.serve_version import SECTIONS, deployment_version
from services.pipeline.compare import DEFAULT_VARIANTS, VARIANTS, baseline_table, variant_config, variants_help

ROOT = Path(__file__).resolve().parents[2]
SERVICES = tuple(SECTIONS)


def versions(overrides: list[str]) -> dict[str, str]:
    config = replica_config(load_config("deploy/configs/tiny.yaml", overrides))
    return {s: deployment_version(config, s) for s in SERVICES}


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_variant_changes_only_what_its_overrides_name(name, tmp_path):
    sft = tmp_path / "sft"
    base = _leaves(variant_config("deploy/configs/tiny.yaml", [f"train.run_dir={tmp_path}"], "mempo", sft).model_dump())
    cfg = variant_config("deploy/configs/tiny.yaml", [f"train.run_dir={tmp_path}"], name, sft)
    mine = _leaves(cfg.model_dump())
    changed = {k for k in mine if mine[k] != base[k]} - {"train.run_dir"}
    assert changed <= {o.split("=", 1)[0] for o in VARIANTS[name].overrides}, changed
    assert cfg.train.run_dir == str(tmp_path / "compare" / name) and cfg.train.sft_dir == str(sft)
    assert cfg.train.init_from_sft


def test_the_readme_table_and_the_cli_help_come_from_the_registry():
    readme = (ROOT / "README.md").read_text()
    assert baseline_table() in readme, "README's baseline table is stale: paste services.pipeline.compare.baseline_table()"
    assert all(v.name in variants_help() for v in VARIANTS.values())
    assert DEFAULT_VARIANTS == ("mempo", "mem1", "search_r1")  # what `make compare` runs: the paper's three


def _reads(service: str, key: str) -> bool:
    """Whether ``service``'s version covers the dotted config ``key`` (services/common/serve_version.py)."""
    keep = SECTIONS[service]
    return keep is None or key.split(".")[0] in keep or key in keep


def test_a_baseline_restarts_only_the_services_whose_sections_it_changes():
    """What `mempo compare` keeps running between variants (each has its own run_dir): a service
    restarts exactly when a variant overrides a field it reads; the learner always (its run_dir)."""
    base = versions(["train.run_dir=runs/a"])
    for name, variant in VARIANTS.items():
        v = versions(list(variant.overrides) + [f"train.run_dir=runs/{name}"])
        keys = [o.split("=", 1)[0] for o in variant.overrides]
        expected = {s for s in SERVICES if s == "learner" or any(_reads(s, k) for k in keys)}
        assert {s for s in SERVICES if v[s] != base[s]} == expected, name
    # the paper's comparison: MEM1-like keeps every replica but the learner's
    mem1 = versions(list(VARIANTS["mem1"].overrides) + ["train.run_dir=runs/mem1"])
    assert {s for s in SERVICES if mem1[s] != base[s]} == {"learner"}
