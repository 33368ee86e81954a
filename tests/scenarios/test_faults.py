"""Faults survived, each injected for real mid-step: SIGKILL to a process (the vLLM engine core, a
learner worker) or ``ray.kill`` of a Serve replica's actor (its worker process dies, Ray does not
restart it: Serve must).

One small pipeline of its own (app prefix "fault-": 1 rollout replica, 1 scorer, 1 search replica, a
W=2 learner that checkpoints every step, 2 prompts x 2 samples per step); each test trains one more
step on it while a thread kills one thing:

- step 2: the vLLM engine core process of the rollout replica, while turns are generating;
- step 3: the search replica, while turns are generating (search.retries=0, so that a search the
  outage fails becomes a counted failed-search observation instead of a client retry);
- step 4: the scorer replica, while it scores;
- step 5: a learner worker (rank 1), while the group runs the update.

Each test prints what the fault cost (seconds, retries); the README's "Reliability" figures are theirs.
Run alone: ``pytest -s tests/scenarios/test_faults.py``; ``MEMPO_TEST_PUBLISH=collective`` runs the same
faults with the weights published by the collective (learner.publish, services/learner/collective.py).
"""

import json
import os
import signal
import threading
import time

import psutil
import pytest
import ray
from ray import serve

from services.config import load_config
from services.learner import ledger
from services.pipeline.chaos_checks import check_starts
from services.pipeline.runlog import read_rows
from services.pipeline.train import train
from tests.pipeline.serve_waits import wait_while_serve_replaces

pytestmark = pytest.mark.slow
PREFIX = "fault-"
PROMPTS, N = 2, 2


@pytest.fixture(scope="module")
def run(serve_http, grammar_model, world, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    port = int(serve_http.rsplit(":", 1)[1])
    cfg = load_config("deploy/configs/tiny.yaml", [
        f"ray.app_prefix={PREFIX}", f"ray.http_port={port}", f"model.path={grammar_model}", "train.init_from_sft=false",
        "train.data=world", "eval.data=world", "search.corpus=world",  # the world's data, given
        # no held-out eval (as `mempo chaos` trains): no test here reads one, and with eval_every > 0 the run would
        # evaluate at step 0 and again at the last step of every train() call
        f"train.run_dir={run_dir}", "train.steps=1", f"train.prompts_per_step={PROMPTS}", "train.eval_every=0",
        f"rollout.n={N}", "rollout.replicas=1", "rollout.num_cpus=0.2", "rollout.max_turns=3",
        "rollout.max_response_tokens=64", "rollout.groups_per_call=1", "search.num_cpus=0.05", "search.retries=0",
        "search.timeout_s=5", "scorer.num_cpus=0.1", "learner.world_size=2", "learner.num_cpus_per_worker=0.1",
        "learner.kl_coef=0", "learner.checkpoint_every=1", "eval.during_training_per_k=1", "eval.objectives=[1]",
        f"learner.publish={os.environ.get('MEMPO_TEST_PUBLISH', 'object_store')}"])  # collective: the same faults
    out = train(cfg)
    assert out["step"] == 1
    yield cfg, run_dir
    out["pipeline"].shutdown()


def _handle(service: str):
    return serve.get_deployment_handle(service, app_name=f"{PREFIX}{service}")


def _replicas(service: str) -> list[str]:
    """Actor names of the live replicas of one of this module's deployments."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{PREFIX}{service}#")]


def _kill_replica(name: str) -> None:
    """What a crashed replica looks like to Serve: its worker process killed, no restart by Ray."""
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _train_with(cfg, steps: int, kill) -> tuple[dict, dict]:
    """Train up to ``steps`` while ``kill(fault)`` runs in a thread (it fills ``fault``: what it
    killed and when); returns (train's result, fault)."""
    cfg = cfg.model_copy(deep=True)
    cfg.train.steps = steps
    fault: dict = {}

    def guarded():
        try:
            kill(fault)
        except Exception as e:  # reported by the test, not lost in the thread
            fault["error"] = repr(e)

    killer = threading.Thread(target=guarded, daemon=True)
    killer.start()
    out = train(cfg)
    fault["train_done"] = time.time()
    killer.join(timeout=5)
    assert "error" not in fault, fault["error"]
    assert "killed_at" in fault, "the fault was never injected"
    return out, fault


def _wait_for(predicate, timeout: float, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError("condition not met")


def _last_train_row(run_dir, step: int) -> dict:
    rows = read_rows(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, step + 1))  # no step lost, none logged twice
    return rows[-1]


def test_the_rollout_engine_process_killed_mid_call_is_restarted_in_place_and_the_call_retried(run):
    cfg, run_dir = run
    rollout = _handle("rollout")
    before = rollout.info.remote().result()

    def kill(fault):
        _wait_for(lambda: rollout.info.remote().result()["turns_running"] > 0, timeout=600)
        fault["pid"] = rollout.info.remote().result()["engine_pid"]
        os.kill(fault["pid"], signal.SIGKILL)
        fault["killed_at"] = time.time()

    out, fault = _train_with(cfg, 2, kill)
    row = _last_train_row(run_dir, 2)
    after = rollout.info.remote().result()
    assert after["replica"] == before["replica"]  # restarted in place: same replica
    assert after["engine_restarts"] == before["engine_restarts"] + 1 and after["engine_pid"] != fault["pid"]
    assert row["episodes"] == row["rollout/episodes"] == PROMPTS * N  # every group once
    assert row["rollout_retries"] >= 1
    assert row["version_lag_max"] == 0 and after["version"] == 2  # the restarted engine held the policy
    print(f"\n[fault] rollout engine killed: restart {after['engine_restart_s']:.1f}s, "
          f"rollout retries {row['rollout_retries']}, step {row['step_s']:.1f}s (rollout {row['time/rollout_s']:.1f}s)")


def test_the_search_replica_killed_mid_step_training_continues_and_serve_restores_it(run):
    cfg, run_dir = run
    rollout = _handle("rollout")
    [victim] = _replicas("search")

    def kill(fault):
        _wait_for(lambda: rollout.info.remote().result()["turns_running"] > 0, timeout=600)
        _kill_replica(victim)
        fault["killed_at"] = time.time()

    out, fault = _train_with(cfg, 3, kill)
    row = _last_train_row(run_dir, 3)
    assert row["episodes"] == PROMPTS * N  # training went on, every group once
    assert 0 <= row["rollout/tool_failures"] <= row["rollout/tool_calls"]  # failed searches are observations
    restored = wait_while_serve_replaces(lambda: [p for p in _replicas("search") if p != victim], f"{PREFIX}search",
                                         "search")
    hits = _handle("search").search.remote(["capital"], 2).result()
    assert len(hits[0]) == 2  # Serve's replacement answers
    print(f"\n[fault] search replica killed: {row['rollout/tool_failures']:.0f} failed-search observations of "
          f"{row['rollout/tool_calls']:.0f} searches, step {row['step_s']:.1f}s; replacement {restored[0]}")


def test_the_scorer_replica_killed_mid_call_is_replaced_and_the_call_retried(run):
    cfg, run_dir = run
    scorer = _handle("scorer")
    [victim] = _replicas("scorer")
    victim_pid = scorer.info.remote().result()["pid"]

    def kill(fault):
        _wait_for(lambda: scorer.info.remote().result()["scoring_now"] > 0, timeout=600, poll=0.01)
        _kill_replica(victim)
        fault["killed_at"] = time.time()

    out, fault = _train_with(cfg, 4, kill)
    row = _last_train_row(run_dir, 4)
    assert row["scorer_retries"] >= 1
    assert row["episodes"] == PROMPTS * N
    info = scorer.info.remote().result()
    assert info["pid"] != victim_pid and info["version"] == 4  # a replacement, brought to the current policy
    # the retried scoring ran on the replacement after a re-sync, or its scores were dropped, never mixed
    assert row["stale_score_batches"] == 0 or row["scorer/blocks"] == 0
    print(f"\n[fault] scorer replica killed: scorer retries {row['scorer_retries']}, stale score batches "
          f"{row['stale_score_batches']:.0f}, scoring {row['time/scoring_s']:.1f}s, step {row['step_s']:.1f}s")


def test_a_learner_worker_killed_mid_update_is_rebuilt_from_the_last_checkpoint_without_a_step_twice(run):
    cfg, run_dir = run
    learner = _handle("learner")
    pids = learner.info.remote().result()["worker_pids"]

    def kill(fault):
        _wait_for(lambda: learner.info.remote().result()["phase"] == "train_step", timeout=600, poll=0.02)
        os.kill(pids[1], signal.SIGKILL)
        fault["killed_at"] = time.time()

    out, fault = _train_with(cfg, 5, kill)
    assert out["step"] == 5
    row = _last_train_row(run_dir, 5)  # step 5 logged once, after the rebuilt group trained it again
    assert row["learner_restarts"] == 1
    info = learner.info.remote().result()
    assert info["step"] == info["version"] == 5 and set(info["worker_pids"]).isdisjoint(pids)
    trainer = json.loads((run_dir / "checkpoints" / "step_00000005" / "trainer.json").read_text())
    assert trainer["sched"]["last_epoch"] == 5  # five schedule steps in the lineage: none applied twice
    print(f"\n[fault] learner worker killed: group rebuilt from checkpoint 4 in {row['learner_restart_s']:.1f}s, "
          f"step 5 trained again, step {row['step_s']:.1f}s")


def _whole_learner_group(learner, scratch) -> dict:
    """The learner's info once every worker of its group is alive: this test's own starting state,
    whatever the tests before it left (a call on the group, here an export, rebuilds a group with a
    dead worker)."""
    info = learner.info.remote().result()
    if not all(psutil.pid_exists(p) for p in info["worker_pids"]):
        learner.export.remote(str(scratch)).result()
        info = learner.info.remote().result()
    assert all(psutil.pid_exists(p) for p in info["worker_pids"]), info["worker_pids"]
    return info


def test_a_learner_worker_dead_while_idle_is_rebuilt_at_the_next_call_with_the_weights_its_step_left(run):
    # a worker that dies between steps (nothing running) used to fail the next save or export, e.g. the
    # driver's final checkpoint; now any call on the group rebuilds it first (LearnerService._with_group)
    cfg, run_dir = run
    learner = _handle("learner")
    before = _whole_learner_group(learner, run_dir / "export-before")
    os.kill(before["worker_pids"][1], signal.SIGKILL)
    _wait_for(lambda: not psutil.pid_exists(before["worker_pids"][1]), timeout=30)
    learner.export.remote(str(run_dir / "export")).result()
    after = learner.info.remote().result()
    assert after["restarts"] == before["restarts"] + 1 and after["step"] == before["step"]
    assert (run_dir / "export" / "config.json").is_file()
    rows = ledger.read(run_dir)
    assert (rows[-1]["event"], rows[-1]["why"], rows[-1]["step"]) == ("start", "rebuilt", before["step"])
    assert check_starts(rows) == []  # the rebuilt group holds the weights of the step it resumed
