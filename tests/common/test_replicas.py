"""ReplicaWatch: a call waits for a replacement Serve is starting (however slow) and fails at once when
no replica runs, starts, or fits a live node. The verdict by hand, then on a real Serve deployment."""

import os
import threading
import time

import pytest

from services.common.calls import CallError, call_all, serve_ref
from services.common.replicas import NoReplica, ReplicaWatch, judge, start_limit_s

NODE = {"CPU": 2.0, "rollout_node": 1.0}
ROLLOUT = {"CPU": 1.0, "rollout_node": 1.0}


def test_running_replicas_mean_busy_not_lost():
    seen = judge({"RUNNING": 1, "STARTING": 1}, "UPSCALING", "", "", ROLLOUT, [], None)
    assert seen.verdict == "running" and seen.running == 1


def test_a_replacement_that_fits_a_live_node_is_waited_for():
    seen = judge({"STARTING": 1}, "UNHEALTHY", "HEALTH_CHECK_FAILED", "", ROLLOUT, [NODE, {"CPU": 2.0}],
                 [{"CPU": 2.0}, {"CPU": 2.0}])  # placed: it holds the node's rollout_node, nothing free is needed
    assert seen.verdict == "starting" and seen.starting == 1
    assert "needs CPU 1, rollout_node 1" in seen.why and "HEALTH_CHECK_FAILED" in seen.why


def test_a_replacement_no_live_node_can_hold_is_lost_at_once():
    seen = judge({"STARTING": 1}, "UPDATING", "", "", ROLLOUT, [{"CPU": 2.0}, {"CPU": 1.0}], None)
    assert seen.verdict == "lost" and "no live node has that many (2 live node(s))" in seen.why
    # a cluster with an autoscaler may add the node it needs
    assert judge({"STARTING": 1}, "UPDATING", "", "", ROLLOUT, [{"CPU": 2.0}], None, autoscaler=True).verdict == \
        "starting"


def test_an_unscheduled_replacement_with_no_free_room_is_lost():
    msg = "Deployment 'rollout' ... has 1 replicas that have taken more than 30s to be scheduled."
    full = [{"CPU": 0.0, "rollout_node": 0.0}]
    assert judge({"STARTING": 1}, "UPDATING", "", msg, ROLLOUT, [NODE], full).verdict == "lost"
    assert judge({"STARTING": 1}, "UPDATING", "", msg, ROLLOUT, [NODE], [NODE]).verdict == "starting"
    assert judge({"STARTING": 1}, "UPDATING", "", "", ROLLOUT, [NODE], full).verdict == "starting"  # placed


@pytest.mark.parametrize("states,status,trigger,want", [
    ({}, "UNHEALTHY", "HEALTH_CHECK_FAILED", "no replica is running or starting"),
    ({"STARTING": 1}, "UNHEALTHY", "REPLICA_STARTUP_FAILED", "fail to start"),
    ({"STARTING": 1}, "DEPLOY_FAILED", "", "fail to start"),
    (None, "", "", "not running"),
])
def test_nothing_to_wait_for(states, status, trigger, want):
    seen = judge(states, status, trigger, "boom", ROLLOUT, [NODE], None)
    assert seen.verdict == "lost" and want in seen.why


def test_start_limit_from_config_or_model_size(tmp_path):
    assert start_limit_s(42.0, None) == 42.0
    assert start_limit_s(0.0, None) == 600.0
    with open(tmp_path / "model.safetensors", "wb") as f:  # 1.5 GiB -> 2 started GiB (sparse: only its size counts)
        f.truncate(3 * 2 ** 29)
    assert start_limit_s(0.0, str(tmp_path)) == 600.0 + 2 * 60.0


# ---- on a real Serve deployment ----

def _deploy(app: str, marker: str, resources: dict | None = None, wait: bool = True):
    from ray import serve

    @serve.deployment(name="probe", num_replicas=1, health_check_period_s=1,
                      ray_actor_options={"num_cpus": 0, "resources": resources or {}})
    class Probe:
        def __init__(self, marker: str):
            if os.path.exists(marker):  # the replacement: a slow start, as a cold vLLM engine's
                gate = open(marker).read()
                deadline = time.monotonic() + 600
                while not os.path.exists(gate) and time.monotonic() < deadline:  # until the test opens it
                    time.sleep(0.1)

        def pid(self) -> int:
            return os.getpid()

    serve.run_many([serve.RunTarget(Probe.bind(marker), name=app, route_prefix=None)],
                   wait_for_applications_running=wait)
    return serve.get_deployment_handle("probe", app_name=app)


def _replica_states(name: str) -> dict:
    from ray import serve

    app = serve.status().applications.get(name)
    return dict(app.deployments["probe"].replica_states) if app and "probe" in app.deployments else {}


def test_the_call_timeout_counts_again_from_when_a_slow_replacement_came_up():
    """A replacement that started for longer than ray.call_timeout_s is up: the handle still has to route
    the call to it, so the call's own limit restarts there (it failed at once before, when the full
    suite's load made the routing lag the replica's start)."""
    from services.common.replicas import Seen, Wait

    class Scripted(ReplicaWatch):
        def __init__(self, verdicts):
            super().__init__("app", "d", {}, start_timeout_s=600, call_timeout_s=0.2)
            self.verdicts = iter(verdicts)

        def look(self):
            return Seen(next(self.verdicts), 1, 0, "scripted")

    watch = Scripted(["starting", "running", "running"])
    wait, t0 = Wait(watch, "a call"), time.monotonic() - 60  # the wait began a minute ago
    wait.check(t0)  # starting: the replica_wait limit applies
    wait.check(t0)  # up now: not "no replica took it within 0.2s", though t0 is 60 s back
    assert watch.waits == 1
    time.sleep(0.3)
    with pytest.raises(TimeoutError, match=r"within 0\.2s"):
        wait.check(t0)  # still untaken past the limit after the replacement came up: the call's own limit


@pytest.mark.slow  # Ray Serve replicas: not the fast tier's
def test_a_call_waits_for_a_slow_replacement_beyond_the_call_timeout(serve_http, tmp_path):
    import ray
    from ray import serve

    marker, APP = str(tmp_path / "slow"), "watch-slow-start"  # an app name of its own: Serve remembers deleted ones
    handle = _deploy(APP, marker)
    try:
        first = handle.pid.remote().result()
        gate = tmp_path / "gate"
        with open(marker, "w") as f:
            f.write(str(gate))  # the replacement starts only once the test creates the gate file
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"SERVE_REPLICA::{APP}#")]
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        deadline = time.monotonic() + 60
        while not any(_replica_states(APP).get(s) for s in ("STARTING", "UPDATING", "RECOVERING")):
            assert time.monotonic() < deadline, _replica_states(APP)
            time.sleep(0.1)  # until Serve has seen the loss and is starting the replacement
        watch = ReplicaWatch(APP, "probe", {}, start_timeout_s=600, call_timeout_s=2, poll_s=0.5)
        out = {}

        def call():
            try:
                out["refs"] = call_all(lambda _: serve_ref(lambda: handle.pid.remote(), 2, watch, "a probe call"), [0],
                                       retries=2, what="probe", stats={}, timeout_s=2)
            except BaseException as e:  # handed to the test below
                out["error"] = e

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        deadline = time.monotonic() + 300
        while watch.waits < 1 and caller.is_alive():  # until the call waits for the replacement Serve starts
            assert time.monotonic() < deadline, "the call never saw the replacement starting"
            time.sleep(0.1)
        time.sleep(3 * 2)  # keep the replacement starting for three call timeouts after the call saw it ...
        assert caller.is_alive(), out  # ... and the call is still waiting, not failed by ray.call_timeout_s
        gate.touch()
        caller.join(timeout=300)
        assert "error" not in out, out.get("error")
        assert ray.get(out["refs"][0]) != first  # served by the replacement
        assert watch.waits >= 1 and watch.waited_s > 2 * 2, (watch.waits, watch.waited_s)  # past the call timeout
    finally:
        serve.delete(APP)


@pytest.mark.slow  # Ray Serve replicas: not the fast tier's
def test_a_replacement_no_node_can_hold_fails_the_call_at_once(serve_http, tmp_path):
    from ray import serve

    APP = "watch-no-room"
    handle = _deploy(APP, str(tmp_path / "none"), resources={"no_such_node": 1}, wait=False)
    try:
        watch = ReplicaWatch(APP, "probe", {"no_such_node": 1.0}, start_timeout_s=600, call_timeout_s=600,
                             poll_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(CallError, match="no_such_node 1 and no live node has that many"):
            call_all(lambda _: serve_ref(lambda: handle.pid.remote(), 600, watch, "a probe call"), [0], retries=2,
                     what="probe")
        assert time.monotonic() - t0 < 30  # not the 600 s limits: there is nothing to wait for
        with pytest.raises(NoReplica):
            watch.wait("a weight sync").check(time.monotonic())
        from services.learner.publish import broadcast

        with pytest.raises(NoReplica):  # what the weight sync calls: Serve refuses, nothing is coming
            watch.when_available(lambda: broadcast(handle, "pid"), "a weight sync")
    finally:
        serve.delete(APP)
