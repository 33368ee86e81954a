"""The baseline registry (services/pipeline/compare.py VARIANTS) is the one list of baselines: each
variant's config differs from MemPO's only where its overrides say, and the README shows the table the
registry renders."""

from pathlib import Path

import pytest

from services.config import MempoConfig, field_baselines, load_config, replica_config
from services.serve_version import deployment_version
from services.pipeline.compare import (DEFAULT_VARIANTS, VARIANTS, Run, baseline_table, parse_variants, plan_runs,
                                      seed_tables, variant_config, variants_help)
from services.pipeline.registry import SERVICES

ROOT = Path(__file__).resolve().parents[2]


def versions(overrides: list[str]) -> dict[str, str]:
    config = replica_config(load_config("deploy/configs/tiny.yaml", overrides))
    return {name: deployment_version(config, svc.package) for name, svc in SERVICES.items()}


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
    base = _leaves(variant_config("deploy/configs/tiny.yaml", [f"train.run_dir={tmp_path}"],
                                  Run("mempo", 0, "mempo", "mempo"), sft).model_dump())
    cfg = variant_config("deploy/configs/tiny.yaml", [f"train.run_dir={tmp_path}"], Run(name, 0, name, name), sft)
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


def test_a_field_marked_as_a_baseline_is_a_variant_that_sets_it_away_from_its_default():
    """config.baseline() marks: the knob and its baseline are one field (mem_only is outcome_on_mem's)."""
    marked = field_baselines(MempoConfig)
    assert ("mem_only", VARIANTS["mem_only"].title, "algorithm.outcome_on_mem=false", False) in marked
    for name, _title, override, _default in marked:
        assert VARIANTS[name].overrides == (override,)
        key, value = override.split("=", 1)
        section, field = key.split(".")
        default = MempoConfig.model_fields[section].annotation.model_fields[field].default
        assert str(default).lower() != value.lower(), f"{name}: its value is the field's default"
        assert getattr(getattr(load_config("deploy/configs/tiny.yaml", [override]), section), field) != default


def _reads(service: str, key: str) -> bool:
    """Whether ``service``'s version covers the dotted config ``key`` (services/serve_version.py)."""
    keep = SERVICES[service].sections
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


def test_seeds_plan_runs_seed_by_seed_with_per_variant_caps(tmp_path):
    plan = plan_runs(parse_variants("mempo, mem1,search_r1:1"), first_seed=3, seeds=2)
    assert [(r.variant, r.seed, r.label, r.folder) for r in plan] == [
        ("mempo", 3, "mempo@s3", "mempo-s3"), ("mem1", 3, "mem1@s3", "mem1-s3"),
        ("search_r1", 3, "search_r1@s3", "search_r1-s3"), ("mempo", 4, "mempo@s4", "mempo-s4"),
        ("mem1", 4, "mem1@s4", "mem1-s4")]
    one = plan_runs(parse_variants("mempo,mem1"), first_seed=0, seeds=1)
    assert [(r.label, r.folder) for r in one] == [("mempo", "mempo"), ("mem1", "mem1")]  # the one-seed layout
    cfg = variant_config("deploy/configs/tiny.yaml", [f"train.run_dir={tmp_path}"], plan[-1], tmp_path / "sft")
    assert cfg.train.seed == 4 and cfg.train.run_dir == str(tmp_path / "compare" / "mem1-s4")
    for bad, why in (("mempo,nope", "unknown variant 'nope'"), ("mempo:0", "whole number >= 1"),
                     ("mem1,mem1", "given twice"), ("mem1:x", "whole number")):
        with pytest.raises(ValueError, match=why):
            parse_variants(bad)
    with pytest.raises(ValueError, match="--seeds must be >= 1"):
        plan_runs(parse_variants("mempo"), 0, 0)


def test_seed_tables_pair_each_seed_and_average_over_the_seeds_a_variant_shares():
    from services.pipeline.evaluate import EvalRun

    def run(ems):
        r = EvalRun()
        r.episodes[1] = [{"uid": f"p{i}", "em": em} for i, em in enumerate(ems)]
        return r

    plan = plan_runs(parse_variants("mempo,mem1,search_r1:1"), first_seed=0, seeds=2)
    runs = {"sft": run([0.0] * 10), "mempo@s0": run([1.0] * 5 + [0.0] * 5), "mem1@s0": run([1.0] * 3 + [0.0] * 7),
            "search_r1@s0": run([1.0] * 1 + [0.0] * 9), "mempo@s1": run([1.0] * 3 + [0.0] * 7),
            "mem1@s1": run([1.0] * 2 + [0.0] * 8)}
    text = seed_tables(plan, runs)
    assert "| mempo@s0 - sft | all | +0.500 |" in text and "| mean of mempo@s0 - sft / mempo@s1 - sft | all | +0.400 |" in text
    assert "| mempo@s0 - mem1@s0 | 1 | +0.200 |" in text and "| mempo@s1 - mem1@s1 | all | +0.100 |" in text
    assert "| mean of mempo@s0 - mem1@s0 / mempo@s1 - mem1@s1 | all | +0.150 |" in text  # per prompt over seeds
    assert "| mempo@s0 - search_r1@s0 | all | +0.400 |" in text  # one shared seed: no mean row for it
    assert "mean of mempo@s0 - search_r1" not in text


def test_an_own_start_variant_trains_its_start_under_its_overrides_and_is_paired_against_it(tmp_path):
    from services.pipeline.compare import own_note, start_config, start_label
    from services.pipeline.evaluate import EvalRun
    from services.pipeline.sft import sft_dir

    own = start_config("deploy/configs/tiny.yaml", [f"train.run_dir={tmp_path}", "train.sft_dir=elsewhere",
                                                     "train.sft_steps=3"], "search_r1_own")
    assert own.rollout.memory_window == "full" and not own.algorithm.use_memory_reward
    assert sft_dir(own) == tmp_path / "starts" / "search_r1_own" / "sft" / "model"  # not the common start's
    assert own.train.run_dir == str(tmp_path / "starts" / "search_r1_own")
    assert own.train.sft_steps == 3  # the user's SFT schedule trains the own start too
    assert [start_label(n) for n in ("mempo", "search_r1", "search_r1_own")] == ["sft", "sft", "sft:search_r1_own"]

    def run(ems):
        r = EvalRun()
        r.episodes[1] = [{"uid": f"p{i}", "em": em} for i, em in enumerate(ems)]
        return r

    plan = plan_runs(parse_variants("mempo,search_r1_own"), first_seed=0, seeds=1)
    runs = {"sft": run([0.0] * 10), "sft:search_r1_own": run([1.0] * 2 + [0.0] * 8),
            "mempo": run([1.0] * 5 + [0.0] * 5), "search_r1_own": run([1.0] * 3 + [0.0] * 7)}
    text = seed_tables(plan, runs)
    assert "| mempo - sft | all | +0.500 |" in text
    assert "| search_r1_own - sft:search_r1_own | all | +0.100 |" in text  # against its own start
    assert "| mempo - search_r1_own | all | +0.200 |" in text
    assert "search_r1_own - sft |" not in text
    assert own_note(plan) == " (except search_r1_own: its own, `sft:<name>`)" and own_note(plan[:1]) == ""


def test_compare_evaluates_only_at_the_end_unless_told_and_plots_em_from_the_final_evals(tmp_path):
    from services.pipeline.compare import end_points, plot_compare, with_compare_defaults

    assert load_config("deploy/configs/long.yaml", with_compare_defaults([])).train.eval_every == 0
    assert load_config("deploy/configs/long.yaml", with_compare_defaults(["train.eval_every=5"])).train.eval_every == 5
    start, final = {1: {"em": 0.2}, 4: {"em": 0.4}}, {1: {"em": 0.5}, 4: {"em": 0.3}}
    points = end_points((start, final), 20)
    assert [p["step"] for p in points] == [0, 20] and [p["em"] for p in points] == pytest.approx([0.3, 0.4])
    assert end_points(None, 20) == []
    out = plot_compare({"mempo": tmp_path / "missing.jsonl"}, tmp_path / "plot.png", {"mempo": (start, final)}, 20)
    assert out.stat().st_size > 10_000
