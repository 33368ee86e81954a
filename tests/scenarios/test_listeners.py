"""Closed by default: after `mempo serve` brings up the search service and the learner (two FSDP ranks
over gloo) on a cluster it starts itself, no process of that tree listens on anything but loopback
(Ray's GCS, raylet, object manager, agents, workers, Serve's proxy and replicas, and the learner's
torch.distributed store and gloo pairs alike).

The command runs as a subprocess with its own HTTP port and its own Ray cluster (ray.init picks
free ports, beside the session's cluster); it is stopped with SIGINT, then whatever of its process
tree is left is killed by pid.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from services.common.local_ray import free_ports
from tests.pipeline.sockets import exposed, listening, tree

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"


def _stop(proc: subprocess.Popen, pids: set[int]) -> None:
    pids |= {p.pid for p in tree(proc.pid)} if proc.poll() is None else set()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    for pid in pids:  # Ray's processes outlive a killed driver for a while: end exactly those
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_mempo_serve_listens_on_loopback_only(world, tmp_path):
    port = free_ports(1)[0]
    log = tmp_path / "serve.log"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "mempo"), "serve", "deploy/configs/tiny.yaml", f"ray.http_port={port}",
                                 "learner.world_size=2", "learner.num_cpus_per_worker=0.1", "learner.kl_coef=0",
                                 f"train.run_dir={tmp_path / 'run'}",
                                 "--apps", "search,learner"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    pids: set[int] = set()
    try:
        deadline, ok = time.time() + 300, False
        while time.time() < deadline and proc.poll() is None and not ok:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["located in"], "topk": 1},
                               timeout=10)
                ok = r.status_code == 200
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert ok, f"the search endpoint never answered:\n{log.read_text()[-3000:]}"
        while time.time() < deadline and proc.poll() is None and "serving; Ctrl-C stops" not in log.read_text():
            time.sleep(1)  # the learner deploys after the search service
        assert "serving; Ctrl-C stops" in log.read_text(), log.read_text()[-3000:]
        pids = {p.pid for p in tree(proc.pid)}
        listeners = listening(proc.pid)
        print("\n".join(f"{host}:{p} {name}" for host, p, name in listeners))
        assert ("127.0.0.1", port) in {(h, p) for h, p, _ in listeners}, listeners
        assert len({name for _, _, name in listeners}) >= 3, listeners  # gcs, raylet, workers at least
        workers = [p.pid for p in tree(proc.pid) if "LearnerWorker" in " ".join(p.cmdline()[:1]) + p.name()]
        assert len(workers) == 2, [(p.pid, p.name()) for p in tree(proc.pid)]
        assert all(listening(pid) for pid in workers)  # the store (rank 0) and the gloo pairs: on loopback too
        assert exposed(listeners) == [], exposed(listeners)
    finally:
        _stop(proc, pids)
