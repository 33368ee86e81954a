"""`mempo compare` wiring at a tiny scale: one RL step per variant, two from one SFT start and the
full-history one from an SFT start of its own (trained first), one report. (Plain ``search_r1`` differs
from ``search_r1_own`` only in its start, so it is left out: one RL run and one evaluation fewer.)"""

import json

import pytest

from services.config import load_config
from services.pipeline.compare import compare
from services.pipeline.runlog import read_rows

pytestmark = pytest.mark.slow


COMMON = ("mempo", "mem1")  # from the common start


def test_compare_one_step_each(serve_http, grammar_model, world, tmp_path):
    port = int(serve_http.rsplit(":", 1)[1])
    overrides = [
        "ray.app_prefix=cmp-", f"ray.http_port={port}", f"train.run_dir={tmp_path}", f"train.sft_dir={grammar_model}",
        "train.steps=1", "train.prompts_per_step=2", "rollout.n=2", "rollout.max_turns=2",
        "rollout.max_response_tokens=48", "rollout.num_cpus=0.2", "search.num_cpus=0.05", "scorer.num_cpus=0.1",
        "learner.num_cpus_per_worker=0.1", "learner.kl_coef=0", "learner.checkpoint_every=100",
        "eval.objectives=[1]", "eval.questions_per_k=2", "eval.during_training_per_k=1", "train.sft_steps=2"]
    paths = compare("deploy/configs/tiny.yaml", overrides, variants=",".join(COMMON) + ",search_r1_own")
    results = json.loads(paths["eval"].read_text())
    assert list(results) == ["sft", *COMMON, "sft:search_r1_own", "search_r1_own"]
    for name, table in results.items():
        assert table["1"]["episodes"] == 2.0 and 0.0 <= table["1"]["em"] <= 1.0
    for name in COMMON:
        assert [r["step"] for r in read_rows(tmp_path / "compare" / name / "metrics.jsonl", "train")] == [1]
        assert read_rows(tmp_path / "compare" / name / "metrics.jsonl", "eval") == []  # compare's default: none periodic
        mine = json.loads((tmp_path / "compare" / name / "eval.json").read_text())  # what `mempo view` reads
        assert list(mine) == ["sft", name] and (tmp_path / "compare" / name / "samples.json").is_file()
        deployed = load_config(tmp_path / "compare" / name / "pipeline.yaml")
        assert deployed.model.path == str(grammar_model)  # every variant started from the same policy
    # the own-start variant: its start trained (2 SFT steps) under its overrides, evaluated, paired against
    own_start = tmp_path / "starts" / "search_r1_own" / "sft" / "model"
    assert (own_start / "config.json").is_file()
    assert [r["step"] for r in read_rows(tmp_path / "starts" / "search_r1_own" / "sft" / "metrics.jsonl", "sft")] == [1, 2]
    assert load_config(tmp_path / "compare" / "search_r1_own" / "pipeline.yaml").model.path == str(own_start)
    report = paths["report"].read_text()
    for name in ("sft", *COMMON, "sft:search_r1_own", "search_r1_own"):
        assert f"| {name} | 1 |" in report
    assert "| search_r1_own - sft:search_r1_own | 1 |" in report
    assert paths["plot"].stat().st_size > 10_000
    # services a variant leaves alone keep their replicas; the learner restarts for each run
    startup = json.loads((tmp_path / "compare" / "startup.json").read_text())
    replicas = {n: startup[n]["replicas"] for n in (*COMMON, "search_r1_own")}
    assert replicas["mem1"]["rollout"] == replicas["mempo"]["rollout"]  # the memory reward is the learner's
    assert replicas["mem1"]["scorer"] == replicas["mempo"]["scorer"]
    for service in ("rollout", "scorer"):  # its own start (model.path) is read by both: both redeployed
        assert replicas["search_r1_own"][service] != replicas["mem1"][service]
    assert len({tuple(r["learner"]) for r in replicas.values()}) == 3
    assert set(startup["mem1"]["start_s"]) == {"search", "rollout", "scorer", "learner"}
    assert "## Start-up seconds per service" in report
