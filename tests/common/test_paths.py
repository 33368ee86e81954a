"""Path lookups (services/common/paths.py): 'world' paths resolve into the built world, never build it."""

import pytest

from services.config import load_config
from services.common.paths import data_path, model_path, resolved, uses_world, world_dir

TINY = "deploy/configs/tiny.yaml"


def test_resolved_config_names_the_world_files_and_keeps_its_key(world):
    cfg = load_config(TINY)
    out = resolved(cfg)
    assert world_dir(out) == world == world_dir(cfg)  # the key ignores the path fields
    assert out.model.path == str(world / "model") and out.search.corpus == str(world / "corpus.jsonl")
    assert out.search.index_dir == str(world / "index" / "bm25") and data_path(out, "sft") == world / "oracle.jsonl"
    assert not uses_world(out) and resolved(out) is out and cfg.model.path == "world"


def test_a_lookup_into_an_unbuilt_world_says_how_to_build_it(tmp_path):
    cfg = load_config(TINY, [f"world.dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="make world"):
        model_path(cfg)
    assert not any(tmp_path.iterdir())  # nothing was built
    other = load_config(TINY, [f"world.dir={tmp_path}", "model.path=/m", "search.corpus=/c.jsonl", "train.data=/t",
                               "train.sft_data=/s", "eval.data=/e"])
    assert resolved(other) is other and model_path(other).as_posix() == "/m"


def test_the_world_key_follows_the_oracle_turn_limit_not_the_agents():
    """Tests and baselines change rollout.max_turns freely; each change must not build a whole new world."""
    from services.common.paths import world_key

    base = world_key(load_config(TINY))
    assert world_key(load_config(TINY, ["rollout.max_turns=3"])) == base
    assert world_key(load_config(TINY, ["world.oracle_max_turns=3"])) != base


def test_a_missing_model_folder_of_make_model_says_how_to_write_it():
    cfg = load_config(TINY, ["model.path=.cache/models/no-such-model"])
    with pytest.raises(FileNotFoundError, match="make model"):
        model_path(cfg)


def test_own_data_with_a_path_still_world_stops_with_the_settings_to_give(tmp_path):
    """No silent world: a command that reads the user's data or model never fills a forgotten path
    from the synthetic world; it names every setting to give, and checks only what the command reads."""
    from services.config import ConfigError
    from services.common.paths import check_no_silent_world
    from services.world.build import prepare_world

    cfg = load_config(TINY, [f"world.dir={tmp_path}", "train.data=/data/train.jsonl"])
    with pytest.raises(ConfigError, match=r"train.data=/data/train.jsonl names your own data, but this command also "
                                          r"reads eval.data, search.corpus, still 'world'.*eval.data=FILE and "
                                          r"search.corpus=FILE"):
        prepare_world(cfg, needs=("train.data", "eval.data", "search.corpus"))
    assert not any(tmp_path.iterdir())  # stopped before building anything
    check_no_silent_world(cfg, ("train.data",))  # a command that reads only train.data is fine
    check_no_silent_world(load_config(TINY), ("train.data", "eval.data", "search.corpus"))  # all world: fine
    # a model of your own: every data path the command reads is given, a file or 'world' on purpose
    # (deploy/configs/smollm2.yaml writes 'world'), never left at its default
    with pytest.raises(ConfigError, match=r"model.path=/m is your own model, but this command also reads "
                                          r"train.data, search.corpus, left unset .* train.data=world "
                                          r"search.corpus=world to use the embedded world's on purpose"):
        check_no_silent_world(load_config(TINY, ["model.path=/m"]), ("train.data", "search.corpus"))
    check_no_silent_world(load_config(TINY, ["model.path=/m", "train.data=world", "search.corpus=world"]),
                          ("train.data", "search.corpus"))
    check_no_silent_world(load_config("deploy/configs/smollm2.yaml"), ("train.data", "eval.data", "search.corpus",
                                                                       "train.sft_data"))
    # the rollout of a config with an external retriever reads no corpus
    ext = load_config(TINY, ["train.data=/t.jsonl", "eval.data=/e.jsonl", "search.url=http://127.0.0.1:9/retrieve"])
    from services.common.paths import corpus_needed
    check_no_silent_world(ext, ("train.data", "eval.data") + corpus_needed(ext))
