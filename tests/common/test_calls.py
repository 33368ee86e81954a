"""call_all: every result kept once, in order, failed calls relaunched, ``on_result`` as each lands."""

import pytest

from services.common.calls import CallError, StaleReplica, call_all, require_version


def test_results_in_order_with_retries_early_starts_and_on_result(ray_cluster):
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
    early = {0: work.remote(0)}  # launched elsewhere before the call (the pipeline's early scoring)
    refs = call_all(launch, [0, 1, 2, 3], retries=1, what="work", stats=stats,
                    on_result=lambda i, ref: landed.append((i, ray.get(ref))), started=early)
    assert ray.get(refs) == [0, 10, 20, 30]
    assert sorted(landed) == [(0, 0), (1, 10), (2, 20), (3, 30)]  # once each, only successes
    assert 0 not in attempts and attempts[2] == 2  # the early one is not relaunched; the failed one is
    assert stats["calls"] == 4 and stats["retries"] == 1 and stats["failed_s"] >= 0

    with pytest.raises(CallError, match="failed 2 times"):
        call_all(lambda p: work.remote(-1), [0], retries=1, what="work")


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


def test_an_early_scoring_call_no_replica_takes_is_left_to_score(ray_cluster):
    """ScorerDriver.start is a head start: when its launch fails (no replica within the call timeout)
    it returns None instead of raising into the rollout loop, and score() sends that call itself."""
    from services.config import MempoConfig
    from services.scorer.driver import ScorerDriver

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def score(x):
        return x + 1

    class Response:  # what a Serve handle call returns; ``_to_object_ref_sync`` is where it can time out
        def __init__(self, ref):
            self.ref = ref

        def _to_object_ref_sync(self, _timeout_s=None):
            if self.ref is None:
                raise TimeoutError("no replica took the call")
            return self.ref

    class Handle:
        def __init__(self):
            self.sent, self.take = [], False
            self.score = self

        def remote(self, x, min_version):
            self.sent.append(x)
            return Response(score.remote(x) if self.take else None)

    cfg = MempoConfig()
    handle = Handle()
    driver = ScorerDriver(handle, cfg, retries=0)
    assert driver.start(1) is None  # logged, not raised
    handle.take = True
    assert ray.get(driver.score([1, 2], started={})) == [2, 3]
    assert handle.sent == [1, 1, 2] and driver.stats["calls"] == 3
