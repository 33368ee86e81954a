"""The pipeline on a multi-node Ray cluster on this machine: placement by resources, 2 RL steps across
nodes, and a worker node lost mid-step.

The cluster is a head and two workers, each its own process with its own custom resource
(services/pipeline/local_cluster.py), every address on loopback, token auth on with a token of its own:

    head      CPU 2, head_node=100    search, the learner's replica and its FSDP worker
    worker-1  CPU 1, rollout_node=1   the rollout replica (vLLM)
    worker-2  CPU 1, scorer_node=1    the scorer replica

Objects bigger than 1 KB go through the object store of the node that made them
(max_direct_call_object_size), as a real batch's bytes would, so trajectory batches made on worker-1
are read by the scorer on worker-2 and the learner on the head. `mempo train` runs as a user runs it,
in its own process against ``ray.address``. Placement is read from Ray's state API (the head's
dashboard), the policy versions from the replicas themselves.

The node-loss test adds worker-3 (rollout_node=1: the spare capacity a cluster keeps), continues the
run, and kills the raylet of the node hosting the rollout replica while a step's episodes are in flight.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.pipeline.local_cluster import LocalCluster
from services.common.local_ray import free_ports
from services.pipeline.runlog import read_rows

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PROMPTS, N = 2, 2
LOSS_PROMPTS = 4  # a longer step for the node-loss runs, so the loss lands inside it
CALL_TIMEOUT_S = 60  # ray.call_timeout_s of these runs; a replacement replica gets the default start-up limit
PROBE = """
import json, sys
import ray
from ray import serve
from services.common.local_ray import join_options
from services.learner.publish import broadcast
ray.init(**join_options(sys.argv[1]))
out = {app: broadcast(serve.get_deployment_handle(app, app_name=app), "info")[0] for app in ("rollout", "scorer")}
out["learner"] = serve.get_deployment_handle("learner", app_name="learner").info.remote().result()
print(json.dumps(out))
"""


class Cluster(LocalCluster):
    """The module's cluster (services/pipeline/local_cluster.py), with a probe of the replicas' versions."""

    def probe(self) -> dict:
        out = subprocess.run([PY, "-c", PROBE, self.address], cwd=ROOT, env=self.env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])


def _rows(path: Path) -> list[dict]:
    try:
        return read_rows(path, "train")
    except (OSError, ValueError):  # not written yet, or a line being written
        return []


@pytest.fixture(scope="module")
def cluster(world, grammar_model):
    base = LocalCluster.create("mn")
    c = Cluster(base.temp_dir, base.env)
    try:
        c.add("head", 2, {"head_node": 100}, head=True)
        c.add("worker-1", 1, {"rollout_node": 1})
        c.add("worker-2", 1, {"scorer_node": 1})
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def overrides(cluster, grammar_model, tmp_path_factory):
    """(run directory, `mempo train` overrides, Serve HTTP port) shared by the module's runs."""
    run_dir, port = tmp_path_factory.mktemp("multinode") / "run", free_ports(1)[0]
    return run_dir, [
        f"ray.address={cluster.address}", f"ray.http_port={port}", "ray.proxy_location=HeadOnly",
        f"model.path={grammar_model}", "train.init_from_sft=false",
        "train.data=world", "eval.data=world", "search.corpus=world",  # the world's data, given
        f"train.run_dir={run_dir}",
        # no held-out eval (as `mempo chaos` trains): no test here reads one, and with eval_every > 0 the run would
        # evaluate at step 0 and again at the last step of every train() call
        f"train.prompts_per_step={PROMPTS}", "train.eval_every=0", f"rollout.n={N}", "rollout.max_turns=3",
        "rollout.max_response_tokens=64", "rollout.groups_per_call=1", "rollout.call_retries=6",
        f"ray.call_timeout_s={CALL_TIMEOUT_S}",
        "eval.during_training_per_k=1", "eval.objectives=[1]", "learner.kl_coef=0", "learner.checkpoint_every=100",
        # placement, as a cluster user writes it: each service on the nodes started with its resource
        "search.resources={head_node: 1}", "learner.resources={head_node: 1}",
        "rollout.resources={rollout_node: 1}", "scorer.resources={scorer_node: 1}"], port


def _train(cluster, overrides: list[str], steps: int, log_name: str, during=None, ok: bool = True) -> str:
    log = Path(cluster.temp_dir) / log_name
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(PY).parent / "mempo"), "train", "deploy/configs/tiny.yaml",
                                 *overrides, f"train.steps={steps}"], cwd=ROOT, env=cluster.env, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            if during is not None:
                during(proc)
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert (proc.returncode == 0) == ok, ours(text)[-6000:]
    return text


def ours(text: str) -> str:
    """The command's own lines of a log, without the raylet and state dumps Ray streams into it (which
    fill the tail an assertion message shows)."""
    noise = ("(raylet)", "[state-dump]", "(gcs_server)")
    return "\n".join(line for line in text.splitlines() if not any(n in line for n in noise))


def _search_calls(cluster) -> int:
    """Search calls answered so far, counted in the search replicas' Serve logs (one ``CALL search`` line
    per call, written as it returns), all replicas of every run in this cluster's session. A file read:
    milliseconds even on a loaded machine (an HTTP poll through Serve's proxy was the trigger when CI's
    kill landed after its step's rollout had finished)."""
    logs = Path(cluster.temp_dir) / "r" / "session_latest" / "logs" / "serve"
    n = 0
    for f in logs.glob("replica_search_*.log"):
        try:
            n += f.read_bytes().count(b"-- CALL search ")
        except OSError:  # rotated or not yet created
            pass
    return n


def _kill_rollout_node_mid_step(cluster, run_dir: Path, rows_before: int, killed: dict):
    """Returns what ``_train(during=...)`` runs: once ``rows_before`` steps are logged, the next step's
    rollout starts; at its first search (the agents mid-episode, later turns still to generate) the
    node hosting the rollout replica is killed.

    Everything slow happens before that step begins. The host is found from the process table (the node
    whose raylet started the replica's worker) once this run's rollout has searched, while step
    ``rows_before`` is still running; the replica stays there until the kill. The search count to beat is
    read *before* the step's rollout can start: each look reads the count, then the log, and a count read
    while the log still lacked step ``rows_before`` precedes that step's first search (the loop logs a step
    before it lets the next rollout begin; with max_staleness 0 the previous rollout's searches ended a
    whole learner update earlier). Between that first search and the kill there are two file reads and the
    kill: a state API call or an HTTP poll there let the step's rollout finish on a loaded machine, and
    the kill then hit the step after it or the final evaluation."""
    def during(proc):
        deadline = time.time() + 600
        first, before, host = _search_calls(cluster), None, None
        while time.time() < deadline and proc.poll() is None:
            count = _search_calls(cluster)
            if len(_rows(run_dir / "metrics.jsonl")) >= rows_before:
                break
            before = count  # read while step rows_before + 1 could not have searched yet
            if (host is None or len(host) != 1) and count > first:  # this run's rollout replica is up and serving
                host = cluster.nodes_running("ray::ServeReplica:rollout:rollout")
            time.sleep(0.02)
        assert before is not None, "the log had the step before the first look: nothing to count from"
        assert host is not None and len(host) == 1, f"the rollout replica's node before the step: {host}"
        while time.time() < deadline and proc.poll() is None:
            if _search_calls(cluster) > before:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the step's first search"
        killed.update(at=time.time(), node=host[0])
        cluster.kill_node(host[0])
    return during


def test_two_steps_across_three_nodes_placed_by_resources(cluster, overrides):
    run_dir, args, _ = overrides
    _train(cluster, args, 2, "train-1.log")
    nodes = {n["node_name"]: n["node_id"] for n in cluster.state("nodes")}
    placed = cluster.placement()  # Ray's own state API, not the config
    assert placed["ServeReplica:rollout:rollout"] == ["worker-1"]
    assert placed["ServeReplica:scorer:scorer"] == ["worker-2"]
    assert placed["ServeReplica:learner:learner"] == ["head"] and placed["LearnerWorker"] == ["head"]
    assert placed["ServeReplica:search:search"] == ["head"]
    # the learner on the head published version 2 to the replicas on the two workers
    seen = cluster.probe()
    assert [(r["version"], r["node_id"]) for r in seen["rollout"]] == [(2, nodes["worker-1"])]
    assert [(r["version"], r["node_id"]) for r in seen["scorer"]] == [(2, nodes["worker-2"])]
    assert seen["learner"]["version"] == 2 and seen["learner"]["node_id"] == nodes["head"]
    rows = read_rows(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["episodes"] == PROMPTS * N and r["prompt_groups"] == r["prompt_groups_unique"] == PROMPTS
        assert r["published_replicas"] == 2 and r["version_lag_max"] == 0 and r["nodes_alive"] == 3
        assert "scorer/blocks" in r and r["rollout_retries"] == 0  # scored on worker-2; nothing re-sent


def test_plan_checks_the_live_cluster(cluster, overrides):
    _, args, _ = overrides
    mempo = [str(Path(PY).parent / "mempo"), "plan", "deploy/configs/tiny.yaml"]
    ok = subprocess.run(mempo + args, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and f"fits the cluster at ray.address={cluster.address}" in ok.stdout, ok.stderr
    # two rollout replicas need two nodes with rollout_node; this cluster has one
    no = subprocess.run(mempo + args + ["rollout.replicas=2"], cwd=ROOT, env=cluster.env, capture_output=True,
                        text=True, timeout=120)
    assert no.returncode == 1
    assert "the services need rollout_node 2 in all; the cluster has 1" in no.stderr


def test_a_worker_node_lost_mid_step_the_step_completes_on_a_survivor(cluster, overrides):
    run_dir, args, _ = overrides
    cluster.add("worker-3", 1, {"rollout_node": 1})  # spare capacity for the rollout
    killed = {}
    during = _kill_rollout_node_mid_step(cluster, run_dir, 3, killed)
    out = _train(cluster, args + [f"train.prompts_per_step={LOSS_PROMPTS}"], 4, "train-2.log", during=during)
    assert "at" in killed
    rows = read_rows(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    lost = rows[-1]
    assert lost["rollout_retries"] >= 1 and lost["rollout_failed_s"] > 0  # the lost call was sent again
    assert lost["weights_republished"] >= 1  # the replacement replica was brought to the current policy
    # the retry waited for the replacement's cold start, as long as it took (not ray.call_timeout_s), and said so
    assert lost["rollout_replica_wait_s"] > 0, lost
    assert "waiting" in out and "replacement replica(s) starting" in out, ours(out)[-6000:]
    assert lost["episodes"] == LOSS_PROMPTS * N  # every prompt group exactly once
    assert lost["prompt_groups"] == lost["prompt_groups_unique"] == LOSS_PROMPTS
    assert lost["nodes_alive"] == 3 and lost["version"] == 4
    victim = killed["node"]
    survivor = ({"worker-1", "worker-3"} - {victim}).pop()
    assert cluster.placement()["ServeReplica:rollout:rollout"] == [survivor]  # Serve rescheduled it
    dead = {n["node_name"] for n in cluster.state("nodes") if n["state"] == "DEAD"}
    assert dead == {victim}
    assert [r["version"] for r in cluster.probe()["rollout"]] == [4]


def test_with_no_node_left_for_the_rollout_the_step_fails_in_bounded_time_with_a_clear_error(cluster, overrides):
    # the previous test's survivor is the last node with rollout_node: lose it too, and Serve has nowhere
    # to put the replica; the loop must not wait forever. The run asks for steps past the kill's, so a kill
    # that lands late (the step's rollout already done) still ends the run at the next rollout, not in the
    # final evaluation: the kill is meant for step 6, and step 7 is where a late one is noticed
    run_dir, args, _ = overrides
    killed = {}
    during = _kill_rollout_node_mid_step(cluster, run_dir, 5, killed)
    out = _train(cluster, args + [f"train.prompts_per_step={LOSS_PROMPTS}"], 8, "train-3.log", during=during,
                 ok=False)
    failed_after = time.time() - killed["at"]
    assert failed_after < 4 * CALL_TIMEOUT_S, failed_after  # bounded by the config's waits, not forever
    # one line says which call failed and why. Which stage notices first depends on timing: the rollout
    # call itself, or a scorer call whose retry must first sync the rollout's weights
    errors = [line for line in ours(out).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and " call " in errors[0], ours(out)[-3000:]
    assert "no live node has that many" in errors[0], errors  # nothing to wait for, so no start-up limit's wait
    # nothing lost: the step the kill hit is not logged, and the same command resumes after the last one that is
    stopped = re.search(r"stopped at step (\d+): checkpoint in", out)
    assert stopped and int(stopped[1]) in (5, 6), ours(out)[-3000:]
    assert [r["step"] for r in read_rows(run_dir / "metrics.jsonl", "train")] == list(range(1, int(stopped[1]) + 1))
