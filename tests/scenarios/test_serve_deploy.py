"""`serve deploy deploy/serve_config.yaml` against a separate `ray start --head` brings up all four
services; the scorer's REST endpoint and Search-R1's /retrieve answer on it. The head runs as
cluster mode is documented (docs/deploy.md): token authentication on (here with a token of its own in
RAY_AUTH_TOKEN), and, being a test, every address on loopback.

The head runs in its own temp dir and ports (beside the session's cluster) and is torn down by
killing exactly its processes. The config deployed is deploy/serve_config.yaml with only the HTTP
port and the run directory changed.
"""

import os
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.pipeline.local_cluster import stop_process_groups
from services.common.local_ray import free_ports
from services.common.local_ray import LOOPBACK, LOOPBACK_ENV
from tests.pipeline.sockets import exposed, listening

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"


def _kill_cluster(temp_dir: str, head: subprocess.Popen) -> None:
    """SIGTERM the head's session, then, after 5 s (`ray start --block` with Serve apps took the whole 30 s
    grace it was once given), SIGKILL whatever is left of it: its process tree and anything naming its temp dir."""
    stop_process_groups([head], 5.0, lambda: subprocess.run(["pgrep", "-f", temp_dir], capture_output=True,
                                                             text=True).stdout.split())


@pytest.fixture(scope="module")
def head(world, grammar_model, tmp_path_factory):
    gcs, dash, agent, agent_grpc, metrics, env_agent, client, http = free_ports(8)
    temp_dir = tempfile.mkdtemp(prefix="mdt", dir="/tmp")
    # token authentication on, with a token of this cluster's own; every address on loopback
    token = secrets.token_hex(32)
    # and the REST routes' bearer token, which deploy/serve_config.yaml asks for (ray.http_auth=token)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0", **LOOPBACK_ENV,
               MEMPO_API_TOKEN=secrets.token_hex(24))
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true",
         f"--node-ip-address={LOOPBACK}", f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={env_agent}", f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}"],
        cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash}"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{address}/api/version", headers=auth, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("ray start --head did not bring up its dashboard")
        config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
        config["http_options"] = {"host": "127.0.0.1", "port": http}
        run_dir = tmp_path_factory.mktemp("served") / "run"
        for app in config["applications"]:
            app["args"]["overrides"] = list(app["args"].get("overrides", [])) + [f"train.run_dir={run_dir}"]
        path = tmp_path_factory.mktemp("cfg") / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        yield {"env": env, "address": address, "config": path, "http": f"http://127.0.0.1:{http}", "auth": auth,
               "pid": proc.pid}
    finally:
        _kill_cluster(temp_dir, proc)


def test_serve_deploy_brings_up_every_service_and_rest_answers(head, world):
    env, address = head["env"], head["address"]
    # the cluster's dashboard refuses a caller without the token; the serve CLI sends it (RAY_AUTH_TOKEN)
    assert httpx.get(f"{address}/api/version", timeout=10).status_code == 401
    assert httpx.get(f"{address}/api/version", headers=head["auth"], timeout=10).status_code == 200
    deploy = subprocess.run([str(BIN / "serve"), "deploy", str(head["config"]), "-a", address], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert deploy.returncode == 0, deploy.stderr
    deadline, status = time.time() + 420, {}
    while time.time() < deadline:
        out = subprocess.run([str(BIN / "serve"), "status", "-a", address], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60).stdout
        status = {name: app["status"] for name, app in (yaml.safe_load(out) or {}).get("applications", {}).items()}
        if status and all(s == "RUNNING" for s in status.values()) or any(s == "DEPLOY_FAILED" for s in status.values()):
            break
        time.sleep(3)
    assert status == {"search": "RUNNING", "scorer": "RUNNING", "rollout": "RUNNING", "learner": "RUNNING"}, out

    base = head["http"]
    # the REST routes ask for the bearer token from the nodes' MEMPO_API_TOKEN, through Serve's real proxy
    rest = {"Authorization": f"Bearer {env['MEMPO_API_TOKEN']}"}
    query = {"queries": ["university located in"], "topk": 2}
    for headers in ({}, {"Authorization": "Bearer " + "0" * 48}, head["auth"]):  # none, wrong, Ray's own token
        r = httpx.post(f"{base}/retrieve", json=query, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["field"] == "authorization", r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.post(f"{base}/scorer/score", json={"question": "q"}, timeout=30).status_code == 401
    r = httpx.post(f"{base}/retrieve", json=query, headers=rest, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["result"][0]) == 2
    r = httpx.post(f"{base}/scorer/score", timeout=60, headers=rest, json={
        "question": "Where was Ada Vell born?", "memory": "Ada Vell was born in Kestrel.", "history": [],
        "answer": "Kestrel"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert 0.0 <= body["p_mem"] <= 1.0 and 0.0 <= body["p_full"] <= 1.0
    assert abs(body["r_mem"] - (body["p_mem"] - body["p_full"])) < 1e-6
    assert httpx.get(f"{base}/scorer/health", timeout=10).json()["status"] == "ok"  # open: probes need no secret
    # every Ray and Serve listener of the head on loopback; the one known exception, pinned so no other
    # appears: the learner's torch.distributed store (rank 0's TCPStore binds [::], services/learner/worker.py)
    open_ = exposed(listening(head["pid"]))
    assert [name for _, _, name in open_] in ([], ["ray::LearnerWorker"]), open_
    # a malformed request is refused with the field named; the replica keeps serving
    assert httpx.post(f"{base}/scorer/score", json={"question": "q"}, headers=rest, timeout=30).status_code == 422
