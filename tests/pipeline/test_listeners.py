"""Closed by default: after `mempo serve` brings up the search service on a cluster it starts itself,
no process of that tree listens on anything but loopback (Ray's GCS, raylet, object manager,
agents, workers and Serve's proxy and replicas alike).

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
                                 "--apps", "search"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
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
        pids = {p.pid for p in tree(proc.pid)}
        listeners = listening(proc.pid)
        print("\n".join(f"{host}:{p} {name}" for host, p, name in listeners))
        assert ("127.0.0.1", port) in {(h, p) for h, p, _ in listeners}, listeners
        assert len({name for _, _, name in listeners}) >= 3, listeners  # gcs, raylet, workers at least
        assert exposed(listeners) == [], exposed(listeners)
    finally:
        _stop(proc, pids)
