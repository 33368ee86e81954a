"""train.loggers (services/pipeline/trackers.py): rows, parameters and artifacts reach W&B (offline) and
MLflow (a file store), read back with each library's own reader; a resumed run goes on in the same
tracked run; a missing package is an error naming how to install it. The loggers in a real `mempo
train` / `mempo eval`: tests/scenarios/test_train_e2e.py."""

import glob
import json
import struct
import sys

import pytest

from services.config import load_config
from services.pipeline.runlog import RunLog
from services.pipeline.trackers import check_loggers, open_trackers, track_results

TINY = "deploy/configs/tiny.yaml"


def wandb_records(folder) -> list:
    """Every record of the W&B offline runs under ``folder`` (oldest first), parsed with W&B's own protobuf
    schema from its run files (a LevelDB-style log: 7-byte file header, 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(glob.glob(f"{folder}/wandb/offline-run-*/run-*.wandb")):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", path
        pos, buf, block = 7, b"", 32768
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                pos += left
                continue
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            buf = chunk if kind in (1, 2) else buf + chunk
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(buf)
                out.append(record)
    return out


def history(records) -> list[dict]:
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


@pytest.fixture
def cfg(tmp_path):
    return load_config(TINY, [f"train.run_dir={tmp_path / 'run'}", "train.loggers=[tensorboard, wandb, mlflow]",
                              "train.wandb_mode=offline"])


def test_rows_params_and_artifacts_reach_mlflow_and_wandb_and_a_resume_goes_on_in_the_same_runs(cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    log = RunLog(run_dir, trackers=open_trackers(cfg, run_dir, "train"))
    for step in (1, 2, 3):
        log.write("train", step, {"reward_mean": step / 10, "note": "text", "flag": True, "bad": float("nan")},
                  console=False)
    log.write("eval", 3, {"em": 0.25}, console=False)
    log.artifacts([log.path])
    log.close(ok=False)  # stopped early (Ctrl-C): resumed below from step 2
    state = json.loads((run_dir / "trackers.json").read_text())

    log = RunLog(run_dir, resume_step=2, trackers=open_trackers(cfg, run_dir, "train", resume_step=2))
    for step in (3, 4):
        log.write("train", step, {"reward_mean": step / 10 + 0.05}, console=False)
    log.close(ok=True)
    assert json.loads((run_dir / "trackers.json").read_text()) == state  # the same tracked runs
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    run = client.get_run(state["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.run_dir"] == str(run_dir) and run.data.params["rollout.n"] == str(cfg.rollout.n)
    assert run.data.tags["mempo.resumed_at_step"] == "2"
    got = [(m.step, round(m.value, 6)) for m in client.get_metric_history(state["mlflow"], "train/reward_mean")]
    assert sorted(got) == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.45)]  # step 3 re-run after the resume
    assert [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], "eval/em")] == [(3, 0.25)]
    assert set(run.data.metrics) == {"train/reward_mean", "eval/em"}  # no strings, booleans or NaN
    assert [a.path for a in client.list_artifacts(state["mlflow"])] == ["metrics.jsonl"]

    records = wandb_records(run_dir)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in runs} == {state["wandb"]} and len(runs) == 2  # two sessions, one run id
    assert {r.project for r in runs} == {"mempo"}
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["train"]["run_dir"] == str(run_dir)
    rows = history(records)
    assert [(h["_step"], h["train/reward_mean"]) for h in rows if "train/reward_mean" in h] == \
        [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.45)]
    assert any(h.get("eval/em") == 0.25 for h in rows)
    assert any(r.WhichOneof("record_type") == "artifact" for r in records)


def test_eval_tables_go_to_the_folders_tracked_run(cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    folder = tmp_path / "run"
    report = folder / "report.md"
    folder.mkdir()
    report.write_text("# report\n")
    track_results(cfg, folder, "eval", 7, {"sft": {1: {"em": 0.4}}, "rl": {1: {"em": 0.5}, 2: {"em": 0.1}}}, [report])
    state = json.loads((folder / "trackers.json").read_text())
    client = MlflowClient((folder / "mlruns").resolve().as_uri())
    assert client.get_run(state["mlflow"]).data.metrics == {"eval/sft/k1/em": 0.4, "eval/rl/k1/em": 0.5,
                                                            "eval/rl/k2/em": 0.1}
    assert [a.path for a in client.list_artifacts(state["mlflow"])] == ["report.md"]
    assert not (folder / "tb").exists()  # TensorBoard is the run's own, not the eval's
    only_tb = load_config(TINY, [f"train.run_dir={tmp_path / 'other'}"])
    track_results(only_tb, tmp_path / "other", "eval", 1, {"sft": {1: {"em": 0.4}}}, [])
    assert not (tmp_path / "other").exists()


def test_a_missing_package_is_an_error_naming_how_to_install_it(monkeypatch):
    for name, pip in (("wandb", "pip install wandb"), ("mlflow", "pip install mlflow-skinny")):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
        with pytest.raises(ImportError, match=f"train.loggers has {name}.*{pip}"):
            check_loggers(["tensorboard", name])
    check_loggers(["tensorboard"])
