"""`mempo sft` interrupted and run again resumes from its last checkpoint and ends with the weights of an
uninterrupted run (services/pipeline/sft.py); a checkpoint of other settings is not resumed."""

import pytest
from safetensors.torch import load_file

from services.config import load_config
from services.learner.group import LearnerGroup
from services.pipeline.runlog import read_rows
from services.pipeline.sft import run_sft

pytestmark = pytest.mark.slow
SMALL = ["train.sft_steps=5", "train.sft_checkpoint_every=2", "train.sft_batch_size=4", "learner.world_size=1",
         "learner.num_cpus_per_worker=0.1", "train.sft_lr_schedule=cosine"]


def _cfg(run_dir, *extra):
    return load_config("deploy/configs/tiny.yaml", [f"train.run_dir={run_dir}", *SMALL, *extra])


def _weights(run_dir):
    return load_file(str(run_dir / "sft" / "model" / "model.safetensors"))


def test_an_interrupted_sft_resumes_and_ends_where_an_uninterrupted_one_does(ray_cluster, world, tmp_path, monkeypatch):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_sft(_cfg(whole))
    assert not (whole / "sft" / "checkpoints").exists()  # removed once the policy is exported

    real = LearnerGroup.sft_step

    def dies_at_step_4(self, batch):
        if batch.step == 4:
            raise RuntimeError("the node went away")
        return real(self, batch)

    monkeypatch.setattr(LearnerGroup, "sft_step", dies_at_step_4)
    with pytest.raises(RuntimeError, match="the node went away"):
        run_sft(_cfg(cut))
    monkeypatch.setattr(LearnerGroup, "sft_step", real)
    assert [p.name for p in (cut / "sft" / "checkpoints").iterdir()] == ["step_00000002"]  # the older one removed

    lines = []
    run_sft(_cfg(cut), log_fn=lines.append)
    assert any("resuming after step 2 of 5" in line for line in lines), lines
    assert [r["step"] for r in read_rows(cut / "sft" / "metrics.jsonl", "sft")] == [1, 2, 3, 4, 5]  # step 3 again, once
    a, b = _weights(whole), _weights(cut)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # data order, optimizer and RNG restored


def test_a_checkpoint_of_other_settings_is_not_resumed(tmp_path):
    import json
    import random

    from services.pipeline.sft import _resume

    step = tmp_path / "sft" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "trainer.json").write_text(json.dumps({"step": 2, "extra": {"sft": {"step": 2, "settings": {"lr": 0.001}}}}))
    (step / "COMPLETE").write_text("ok\n")

    class NoGroup:  # resuming would load into the group: it must not be asked
        def resume(self, run_dir):
            raise AssertionError("resumed a checkpoint of other settings")

    lines, order = [], []
    assert _resume(NoGroup(), tmp_path / "sft", {"lr": 0.003}, random.Random(0), order, lines.append) == 0
    assert "made with other settings" in lines[0] and "starting afresh" in lines[0] and order == []
    assert not (tmp_path / "sft" / "checkpoints").exists()
