"""``mempo chaos``, the short version: 6 steps on a 3-node local cluster under 3 faults, two of them
planned for one step, with REST load on the scorer, every invariant checked (services/pipeline/chaos_checks.py).

The schedule is drawn from ``SEED`` (--max-faults 3): a scorer replica killed and the driver stopped by
SIGTERM (and started again with the same command) in step 2, a learner rank killed in step 5. A failure
replays with the command the test prints. The run trains the grammar model from scratch (no SFT), 2
prompts x 2 samples a step, a W=2 learner that checkpoints every 2 steps.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.pipeline.chaos_faults import schedule

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SEED, STEPS = 48, 6


def test_six_steps_under_three_overlapping_faults_and_rest_load_keep_every_invariant(world, grammar_model, tmp_path):
    plan = schedule(SEED, STEPS, max_faults=3)
    assert [(f.step, f.kind) for f in plan] == [(2, "scorer_replica"), (2, "driver_sigterm"), (5, "learner_rank")]
    out = tmp_path / "chaos"
    cmd = [str(Path(sys.executable).parent / "mempo"), "chaos", "deploy/configs/tiny.yaml",
           f"model.path={grammar_model}", "train.init_from_sft=false",
           "train.data=world", "eval.data=world", "search.corpus=world",  # the world's data, given
           "train.prompts_per_step=2", "rollout.n=2", "rollout.max_turns=3", "rollout.max_response_tokens=64",
           "rollout.groups_per_call=1", "rollout.num_cpus=0.2", "search.num_cpus=0.05", "scorer.num_cpus=0.1",
           "learner.world_size=2", "learner.num_cpus_per_worker=0.1", "learner.kl_coef=0",
           "learner.checkpoint_every=2", "eval.objectives=[1]",
           "--steps", str(STEPS), "--seed", str(SEED), "--max-faults", "3", "--no-baseline", "--rest-rate", "2",
           "--out", str(out)]
    print("replay: " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert (out / "chaos.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "chaos.json").read_text())
    print((out / "report.md").read_text())
    assert result["violations"] == [], result["violations"]
    assert proc.returncode == 0 and result["finished"]
    injected = [f for f in result["faults"] if "missed" not in f]
    assert [f["kind"] for f in injected] == ["scorer_replica", "driver_sigterm", "learner_rank"], result["faults"]
    # they overlapped: the SIGTERM came within 5 s of the kill, while Serve was replacing the scorer replica, in
    # step 2 or, when step 2 ended first (a step shorter than the plan's estimate of one), just after it
    scorer, sigterm, _ = injected
    assert scorer["landed_step"] == 2 and sigterm["landed_step"] in (2, 3) and sigterm["at"] - scorer["at"] < 5.0, injected
    assert len(result["driver_exits"]) >= 2 and result["driver_exits"][0]["code"] == 130  # stopped, started again
    assert result["rest"]["by_status"].get("200", 0) > 0
    ledger = [json.loads(line) for line in (out / "faulted" / "ledger.jsonl").read_text().splitlines()]
    assert [r["why"] for r in ledger if r["event"] == "start"][-1] == "rebuilt"  # the learner rank's fault
