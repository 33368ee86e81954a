"""The config tree (services/config.py): defaults, MemPO reference numbers, YAML + overrides,
and errors that name the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from services.config import ConfigError, MempoConfig, describe_fields, load_config, main, parse_override, to_yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY_CONFIGS = sorted((REPO / "deploy" / "configs").glob("*.y*ml"))


def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, MempoConfig)
    assert cfg == load_config(None, [])
    # the dumped YAML is complete and loads back to the same config
    assert MempoConfig.model_validate(yaml.safe_load(to_yaml(cfg))) == cfg


def test_every_leaf_field_is_documented():
    rows = describe_fields()
    assert len(rows) > 50
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys))
    undocumented = [k for k, _, h in rows if not h.strip()]
    assert not undocumented, f"fields without a description: {undocumented}"
    for key in ["rollout.n", "scorer.tau", "learner.lr", "train.prompts_per_step", "ray.http_port"]:
        assert key in keys


def test_describe_fields_defaults_match_the_model():
    cfg = load_config()
    for key, default, _ in describe_fields():
        node = cfg
        for part in key.split("."):  # sections may nest (learner.lora.rank)
            node = getattr(node, part)
        assert node == default, key


def test_mempo_reference_defaults():
    cfg = load_config()
    assert cfg.scorer.tau == math.log(0.5)
    # the memory reward departs from the reference by measurement (bench/memreward.py, docs/algorithm.md);
    # the reference's rule is one override set away (mempo compare's mempo_ref variant)
    assert (cfg.scorer.filter_mode, cfg.scorer.average) == ("none", "per_question")
    ref = load_config(None, ["scorer.filter_mode=independent", "scorer.average=geometric",
                             "scorer.answer_template=reference"]).scorer
    assert "sufficient information to provide the final answers" in ref.answer_template
    with pytest.raises(ConfigError, match="scorer.answer_template"):
        load_config(None, ["scorer.answer_template=no placeholder"])
    assert cfg.rollout.n == 16
    assert cfg.rollout.max_turns == 16
    assert cfg.rollout.temperature == 1.0
    assert cfg.rollout.memory_window == 1
    assert cfg.learner.clip_eps_low == cfg.learner.clip_eps_high == 0.2
    assert cfg.learner.dual_clip_c == 3
    assert cfg.learner.kl_coef == 0.001
    assert cfg.learner.lr == 1e-6
    assert cfg.learner.loss_agg == "seq-mean-token-mean"
    assert cfg.train.prompts_per_step == 128
    assert cfg.algorithm.mem_alpha == 1
    assert cfg.algorithm.use_memory_reward is True
    assert "{gold}" in cfg.scorer.answer_template


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({
        "rollout": {"n": 8, "max_turns": 6, "stop": ["</answer>"]},
        "scorer": {"filter_mode": "joint"},
        "train": {"prompts_per_step": 4},
    }))
    cfg = load_config(p)
    assert (cfg.rollout.n, cfg.rollout.max_turns, cfg.rollout.stop) == (8, 6, ["</answer>"])
    assert cfg.scorer.filter_mode == "joint" and cfg.train.prompts_per_step == 4
    assert cfg.learner.lr == 1e-6  # untouched sections keep their defaults

    cfg = load_config(str(p), ["rollout.n=4", "rollout.stop=[a,b]", "rollout.memory_window=full",
                               "scorer.tau=-1.5", "learner.lr=2e-5", "algorithm.use_memory_reward=false",
                               "search.query_prefix=", "ray.address=auto"])
    assert cfg.rollout.n == 4  # override beats the file
    assert cfg.rollout.max_turns == 6  # file beats the default
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.rollout.memory_window == "full"
    assert cfg.scorer.tau == -1.5
    assert cfg.learner.lr == 2e-5
    assert cfg.algorithm.use_memory_reward is False
    assert cfg.search.query_prefix == ""
    assert cfg.ray.address == "auto"

    assert load_config(None, ["rollout.memory_window=3"]).rollout.memory_window == 3
    assert load_config(None, ["rollout.n=2", "rollout.n=5"]).rollout.n == 5  # last one wins


def test_parse_override():
    assert parse_override("rollout.n=8") == (["rollout", "n"], 8)
    assert parse_override("rollout.stop=[a, b]") == (["rollout", "stop"], ["a", "b"])
    assert parse_override("scorer.answer_template=x=y") == (["scorer", "answer_template"], "x=y")
    assert parse_override(" rollout.n =3") == (["rollout", "n"], 3)


def _error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, list(overrides))
    assert ei.type is ConfigError
    return str(ei.value)


@pytest.mark.parametrize("override,key,suggestion", [
    ("rollout.nn=4", "rollout.nn", "rollout.n"),
    ("rollout.temprature=0.5", "rollout.temprature", "rollout.temperature"),
    ("scorer.filtermode=joint", "scorer.filtermode", "scorer.filter_mode"),
    ("learner.kl_cof=0.1", "learner.kl_cof", "learner.kl_coef"),
])
def test_bad_key_in_override(override, key, suggestion):
    msg = _error(overrides=[override])
    assert key in msg and "unknown key" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_bad_section_in_override():
    msg = _error(overrides=["rollot.max_turns=4"])
    assert "rollot" in msg and "unknown key" in msg
    assert "did you mean 'rollout'?" in msg  # a misspelt section suggests the section
    assert "did you mean 'learner'?" in _error(overrides=["learnr.lr=1"])
    assert "did you mean" not in _error(overrides=["xyzzy=1"])


def test_bad_key_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  n: 4\n  max_turn: 3\nlearner:\n  clip_eps_hi: 0.3\n")
    msg = _error(p)
    assert "rollout.max_turn" in msg and "did you mean 'rollout.max_turns'" in msg
    assert "learner.clip_eps_hi" in msg and "did you mean 'learner.clip_eps_high'" in msg
    p.write_text("rollot:\n  n: 4\n")
    msg = _error(p)
    assert "rollot" in msg and "did you mean 'rollout'?" in msg


@pytest.mark.parametrize("override,field", [
    ("rollout.n=0", "rollout.n"),
    ("rollout.n=abc", "rollout.n"),
    ("rollout.n=[1,2]", "rollout.n"),
    ("scorer.filter_mode=bogus", "scorer.filter_mode"),
    ("rollout.memory_window=half", "rollout.memory_window"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("learner.dual_clip_c=1", "learner.dual_clip_c"),
    ("model.dtype=int8", "model.dtype"),
    ("rollout.stop=3", "rollout.stop"),
])
def test_bad_value_names_the_field(override, field):
    msg = _error(overrides=[override])
    assert field in msg


def test_bad_value_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("scorer:\n  filter_mode: bogus\ntrain:\n  prompts_per_step: -1\n")
    msg = _error(p)
    assert "scorer.filter_mode" in msg and "train.prompts_per_step" in msg


def test_override_on_a_non_section():
    msg = _error(overrides=["rollout.n.x=1"])
    assert "rollout.n" in msg and "not a section" in msg


@pytest.mark.parametrize("bad", ["rollout.n", "rollout", "", "=3", "rollout..n=3", ".n=3"])
def test_malformed_override(bad):
    msg = _error(overrides=[bad])
    assert repr(bad) in msg or "override" in msg


def test_bad_files(tmp_path):
    assert "does not exist" in _error(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    assert "mapping" in _error(p)
    p.write_text("rollout: [unclosed\n")
    assert "YAML" in _error(p)
    p.write_text("")
    assert load_config(p) == load_config()  # an empty file is the defaults


def test_cli(capsys, tmp_path):
    assert main(["rollout.n=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["n"] == 3
    assert main(["rollout.nn=3"]) == 2
    assert "rollout.nn" in capsys.readouterr().err
    assert main(["--help-fields"]) == 0
    assert "scorer.tau" in capsys.readouterr().out


def test_context_and_response_budgets_must_fit_the_engine():
    ok = load_config(None, ["rollout.max_context_tokens=3000", "rollout.max_response_tokens=1096"])
    assert ok.rollout.max_context_tokens + ok.rollout.max_response_tokens == ok.engine.max_model_len
    with pytest.raises(ConfigError, match=r"rollout.max_context_tokens \(3584\) \+ rollout.max_response_tokens "
                                          r"\(513\) exceeds engine.max_model_len \(4096\)"):
        load_config(None, ["rollout.max_response_tokens=513"])
    with pytest.raises(ConfigError, match="engine.max_model_len"):
        load_config("deploy/configs/tiny.yaml", ["engine.max_model_len=1600"])


def test_grpo_needs_groups_of_at_least_two():
    assert load_config(None, ["rollout.n=2"]).rollout.n == 2
    with pytest.raises(ConfigError, match=r"rollout.n: must be at least 2: GRPO.*\(got 1\)"):
        load_config(None, ["rollout.n=1"])
    from pydantic import ValidationError

    from services.config import RolloutConfig

    with pytest.raises(ValidationError, match="must be at least 2"):  # the section alone checks it too
        RolloutConfig(n=1)


def test_a_cross_section_check_names_the_field_to_change():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.max_response_tokens=513"])
    assert str(e.value).splitlines()[1].strip().startswith("rollout.max_response_tokens: rollout.max_context_tokens")
    with pytest.raises(ConfigError, match=r"scorer.max_request_tokens: 9999 exceeds the model's"):
        load_config(None, ["scorer.max_request_tokens=9999"])


def test_the_scorer_has_its_own_call_retries_and_replicas_do_not_see_them():
    from services.config import replica_config
    from services.scorer.driver import ScorerDriver

    cfg = load_config(None, ["scorer.call_retries=5", "rollout.call_retries=1"])
    assert ScorerDriver(None, cfg).retries == 5
    assert replica_config(cfg) == replica_config(load_config(None, ["rollout.call_retries=1"]))  # a driver setting


@pytest.mark.parametrize("path", DEPLOY_CONFIGS or [None], ids=lambda p: p.name if p else "none")
def test_deploy_configs_load(path):
    if path is None:
        pytest.skip("no YAML files in deploy/configs/ yet")
    cfg = load_config(path)
    assert isinstance(cfg, MempoConfig)
    # and they survive a dump / reload
    assert MempoConfig.model_validate(yaml.safe_load(to_yaml(cfg))) == cfg


def test_scorer_token_budget_never_exceeds_the_model_positions():
    from services.config import scorer_token_budget

    tiny = load_config("deploy/configs/tiny.yaml")  # engine.max_model_len 2048 < the model's 4096 positions
    assert tiny.scorer.max_request_tokens == 0 and scorer_token_budget(tiny) == 2048
    assert scorer_token_budget(tiny, loaded_positions=1024) == 1024  # a loaded model's own limit wins
    assert scorer_token_budget(load_config("deploy/configs/tiny.yaml", ["scorer.max_request_tokens=500"])) == 500
    with pytest.raises(ConfigError, match=r"scorer.max_request_tokens: 32768 exceeds the model's 2048 positions"):
        load_config("deploy/configs/tiny.yaml", ["scorer.max_request_tokens=32768"])
    with pytest.raises(ConfigError, match="4096 positions"):
        load_config(None, ["scorer.max_request_tokens=5000", "engine.max_model_len=8192"])
    # a real model's positions are not in the config: the engine length bounds it, the replica checks the rest
    assert scorer_token_budget(load_config(None, ["model.path=/some/model", "engine.max_model_len=8192"])) == 8192


def test_a_config_starts_from_its_base_and_holds_only_what_differs(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "full.yaml").write_text(
        "rollout: {n: 8, max_turns: 6}\nlearner: {lr: 1.0e-6, world_size: 2}\neval: {objectives: [2, 4, 6]}\n")
    (tmp_path / "lora.yaml").write_text(  # the base is found relative to the file, not the working directory
        "base: recipes/full.yaml\nlearner: {lr: 1.0e-5, lora: {rank: 8}}\neval: {objectives: [2]}\n")
    cfg = load_config(tmp_path / "lora.yaml", ["rollout.n=4"])
    assert (cfg.learner.lr, cfg.learner.world_size, cfg.learner.lora.rank) == (1e-5, 2, 8)  # sections merge key by key
    assert cfg.eval.objectives == [2]  # a list replaces
    assert (cfg.rollout.n, cfg.rollout.max_turns) == (4, 6)  # overrides still come last
    (tmp_path / "twice.yaml").write_text("base: lora.yaml\nrollout: {max_turns: 3}\n")  # a base with a base
    assert load_config(tmp_path / "twice.yaml").learner.lora.rank == 8


def test_a_missing_or_circular_base_is_a_clear_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere.yaml' does not exist \(the base of .*a.yaml\)"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("base: c.yaml\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\n")
    with pytest.raises(ConfigError, match="its bases come back to it"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "d.yaml").write_text("base: [x.yaml]\n")
    with pytest.raises(ConfigError, match="base: must be the path of another config file"):
        load_config(tmp_path / "d.yaml")


def test_the_lora_recipe_is_the_gpu_recipe_with_adapters():
    full = load_config(REPO / "deploy" / "configs" / "gpu-qwen2.5-7b.yaml")
    lora = load_config(REPO / "deploy" / "configs" / "gpu-qwen2.5-7b-lora.yaml")
    assert lora.learner.lora.rank == 64 and full.learner.lora.rank == 0
    assert lora.rollout == full.rollout and lora.scorer == full.scorer and lora.model == full.model  # one source
