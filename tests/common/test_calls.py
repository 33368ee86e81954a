"""call_all: every result kept once, in order, failed calls relaunched, ``on_result`` as each lands."""

import pytest

from services.common.calls import Arrivals, CallError, StaleReplica, call_all, require_version


def test_results_in_order_with_retries_and_on_result(ray_cluster):
    ray = ray_cluster

    @ray.remote
    def work(x):
        if x < 0:
            raise RuntimeError("a dead replica")
        return x * 10

    attempts = {}

    def launch(p):
        attempts[p] = attempts.get(p, 0) + 1
        return work.remote(p if attempts[p] > 1 or p != 2 else -1)  # payload 2 fails once

    landed = []
    stats = {}
    refs = call_all(launch, [0, 1, 2, 3], retries=1, what="work", stats=stats,
                    on_result=lambda i, ref: landed.append((i, ray.get(ref))))
    assert ray.get(refs) == [0, 10, 20, 30]
    assert sorted(landed) == [(0, 0), (1, 10), (2, 20), (3, 30)]  # once each, only successes
    assert attempts == {0: 1, 1: 1, 2: 2, 3: 1}  # the failed one relaunched, no other
    assert stats["calls"] == 5 and stats["retries"] == 1 and stats["failed_s"] >= 0

    with pytest.raises(CallError, match="failed 2 times"):
        call_all(lambda p: work.remote(-1), [0], retries=1, what="work")


def test_payloads_arriving_while_the_calls_run_are_launched_as_they_come(ray_cluster):
    """Arrivals: payloads handed over from another thread, out of order, while earlier calls run; each is
    launched at once (not after the close), retried like any call, and the results come back in order."""
    import threading
    import time

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def work(x):
        if x < 0:
            raise RuntimeError("a dead replica")
        return x * 10

    launched, tries = {}, {}

    def launch(p):
        launched.setdefault(p, time.monotonic())
        tries[p] = tries.get(p, 0) + 1
        return work.remote(-1 if (p == 1 and tries[p] == 1) else p)  # payload 1 fails once

    arrivals = Arrivals()
    handed = {}

    def rollout():  # results landing one by one, as the rollout's would
        for i in (2, 0, 1):
            handed[i] = time.monotonic()
            arrivals.add(i, i)
            time.sleep(0.3)
        arrivals.close(3)

    feeder = threading.Thread(target=rollout)
    feeder.start()
    stats = {}
    refs = call_all(launch, arrivals, retries=1, what="score", stats=stats)
    feeder.join()
    assert ray.get(refs) == [0, 10, 20]
    assert tries == {0: 1, 1: 2, 2: 1} and stats["retries"] == 1
    assert all(launched[i] - handed[i] < 0.25 for i in range(3))  # launched as it came, not at the close

    stopped = Arrivals()
    stopped.add(0, 0)
    stopped.abort()
    with pytest.raises(CallError, match="stopped before every payload arrived"):
        call_all(lambda p: work.remote(p), stopped, retries=0, what="score")


def test_a_call_that_never_finishes_fails_after_the_timeout_and_is_retried(ray_cluster):
    import time

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def work(x):
        if x == "hang":
            time.sleep(60)  # a replica on a lost node with nowhere to reschedule
        return x

    tries = []

    def launch(p):
        tries.append(p)
        return work.remote("hang" if len(tries) == 1 else p)

    stats = {}
    t0 = time.monotonic()
    refs = call_all(launch, ["ok"], retries=1, what="work", stats=stats, timeout_s=2.0)
    assert ray.get(refs) == ["ok"] and stats["retries"] == 1 and 1.9 < stats["failed_s"] < 10
    with pytest.raises(CallError, match=r"failed 2 times; last error: no result within 1s"):
        call_all(lambda p: work.remote("hang"), ["x"], retries=1, what="work", timeout_s=1.0)
    assert time.monotonic() - t0 < 30  # bounded, not the 60 s the calls would take


def test_a_replica_behind_the_required_version_refuses():
    require_version(3, -1, "r")  # no requirement
    require_version(3, 3, "r")
    with pytest.raises(StaleReplica, match="holds policy version 0, the call needs >= 2"):
        require_version(0, 2, "r")  # a replacement that still holds model.path


def test_a_scoring_call_waiting_for_a_replica_does_not_hold_up_the_rollout(ray_cluster):
    """ScorerDriver.stream: ``add`` returns at once even while the launch waits for a replica to take
    the call (it runs on the stream's thread); the results come once the replica takes it."""
    import threading

    from services.config import MempoConfig
    from services.scorer.driver import ScorerDriver

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def score(x):
        return x + 1

    taken = threading.Event()

    class Response:  # what a Serve handle call returns; ``_to_object_ref_sync`` waits for a replica
        def __init__(self, x):
            self.x = x

        def _to_object_ref_sync(self, _timeout_s=None):
            assert taken.wait(timeout=30)
            return score.remote(self.x)

    class Handle:
        def __init__(self):
            self.sent = []
            self.score = self

        def remote(self, x, min_version):
            self.sent.append((x, min_version))
            return Response(x)

    handle = Handle()
    driver = ScorerDriver(handle, MempoConfig(), retries=0)
    stream = driver.stream(min_version=3)
    stream.add(1, 1)
    stream.add(0, 5)  # returned although the first launch still waits
    taken.set()
    assert ray.get(stream.results(2)) == [6, 2]
    assert sorted(handle.sent) == [(1, 3), (5, 3)] and driver.stats["calls"] == 2
    assert ray.get(driver.score([7])) == [8]  # the whole-batch call: the same path
