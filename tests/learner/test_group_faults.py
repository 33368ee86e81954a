"""A call on the learner's worker group has one outcome for all its ranks (services/learner/group.py,
``gather``): a rank that died is a ``RankLost`` whichever rank's error reaches the driver first; an
error with every rank alive is raised as it is.

Each test builds a real W=2 FSDP group over gloo on the tiny model whose rank actor is a subclass of
``LearnerWorker`` that injects one fault at the start of ``train_step``:

- rank 1 shuts down its TCP connections to rank 0 (the gloo pairs, as its death would, so rank 0's first
  collective fails at once with gloo's "Connection closed by peer") and exits only ``DIE_AFTER_S`` later: the survivor's
  error reaches the driver first, on purpose rather than by luck of timing;
- every rank raises: the error, unchanged and at once;
- rank 0 alone raises, rank 1 waits in a collective for it: after ``learner.fault_grace_s`` the error,
  with a note naming the hung rank, and the group is killed.
"""

import os
import socket
import time

import psutil
import pytest
import ray

from services.learner.group import LearnerGroup, RankLost
from services.learner.worker import LearnerWorker

pytestmark = pytest.mark.slow
DIE_AFTER_S = 4.0


class _SurvivorFailsFirst(LearnerWorker):
    peer_pid = None

    def arm(self, peer_pid: int) -> None:
        self.peer_pid = peer_pid

    def train_step(self, payload):
        if self.rank == 1:
            _cut_connections_to(self.peer_pid)  # rank 0's next collective fails with gloo's error...
            time.sleep(DIE_AFTER_S)  # ...well before Ray sees this rank die
            os._exit(1)
        return super().train_step(payload)


def _cut_connections_to(pid: int) -> None:
    """Shut down every TCP connection of this process to process ``pid`` (the gloo pairs between two
    ranks on one machine): what the peer sees when this process dies, without dying."""
    theirs = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp") if c.laddr}
    cut = 0
    for c in psutil.Process().net_connections("tcp"):
        if c.raddr and (c.raddr.ip, c.raddr.port) in theirs and c.fd >= 0:
            socket.socket(fileno=os.dup(c.fd)).shutdown(socket.SHUT_RDWR)
            cut += 1
    assert cut, f"no TCP connection to process {pid}"


class _EveryRankRaises(LearnerWorker):
    def train_step(self, payload):
        raise ValueError(f"a bad batch on rank {self.rank}")


class _RankZeroRaises(LearnerWorker):
    def train_step(self, payload):
        if self.rank == 0:
            raise ValueError("only rank 0 fails")
        return super().train_step(payload)


def _group(worker, cfg, world):
    cls = type(f"Group{worker.__name__}", (LearnerGroup,), {"worker_class": worker})
    return cls(cfg, str(world / "model"), world_size=2)


def test_a_survivors_collective_error_that_arrives_first_is_the_dead_ranks_fault(ray_cluster, setup, world):
    cfg, tb = setup
    group = _group(_SurvivorFailsFirst, cfg, world)
    ray.get(group.workers[1].arm.remote(group.pids[0]))
    try:
        t0 = time.monotonic()
        with pytest.raises(RankLost) as caught:
            group.train_step(tb)
        waited = time.monotonic() - t0
    finally:
        group.kill()
    assert caught.value.ranks == [1]
    # the survivor's error came first and is kept as the cause; the verdict waited for the death
    assert isinstance(caught.value.__cause__, ray.exceptions.RayTaskError)
    assert "rank 0's error came first" in str(caught.value)
    assert waited >= DIE_AFTER_S * 0.5
    print(f"\n[group fault] survivor's error first, rank 1's death seen {waited:.1f}s after the call began")


def test_an_error_on_every_rank_with_all_alive_is_raised_as_it_is(ray_cluster, setup, world):
    cfg, tb = setup
    group = _group(_EveryRankRaises, cfg, world)
    try:
        with pytest.raises(ValueError, match="a bad batch on rank [01]"):
            group.train_step(tb)
        assert group.param_digest() == group.param_digest()  # the group is whole and answers
    finally:
        group.shutdown()


def test_an_error_on_one_rank_while_another_hangs_is_raised_after_the_grace_and_the_group_is_killed(
        ray_cluster, setup, world):
    cfg, tb = setup
    cfg = cfg.model_copy(deep=True)
    cfg.learner.fault_grace_s = 3.0
    group = _group(_RankZeroRaises, cfg, world)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="only rank 0 fails") as caught:
            group.train_step(tb)
        assert time.monotonic() - t0 >= 3.0
        assert any("rank(s) [1] had not answered" in n for n in caught.value.__notes__)
        with pytest.raises(RankLost):  # killed: the next call is a rank fault, which the service rebuilds
            group.param_digest()
    finally:
        group.kill()
