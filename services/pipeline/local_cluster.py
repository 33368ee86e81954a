"""One node of a multi-node Ray cluster on this machine: a head, or a worker that joins it.

Each node is its own process (as ``ray start --block`` would be), on loopback, with its own CPUs and
custom resources, so a real multi-node pipeline (object refs whose bytes live on another node,
weights sent between nodes, placement by resources, a whole node lost) runs on one laptop:

    python -m services.pipeline.local_cluster --name head --num-cpus 1 \\
        --resources '{"head_node": 100}' --info /tmp/mn/head.json --dashboard
    python -m services.pipeline.local_cluster --name worker-1 --num-cpus 1 \\
        --resources '{"rollout_node": 1}' --join 127.0.0.1:PORT --info /tmp/mn/w1.json
    mempo train deploy/configs/tiny.yaml ray.address=127.0.0.1:PORT rollout.resources='{rollout_node: 1}' ...

The process writes ``--info`` (JSON: name, node_id, gcs_address, raylet_pid, dashboard_url) once the
node is up, then holds the node until SIGTERM/SIGINT, when it stops the node's processes. Killing
``raylet_pid`` takes the node away as a lost machine would (its workers exit with it).

Why not ``ray start``: on Linux Ray joins a second node only when the cluster is not single-node,
and a non-single-node cluster rewrites 127.0.0.1 to the machine's routable address (every port on
the network; services/common/local_ray.py). Here every node is started as Ray's own multi-node test
utility (``ray.cluster_utils.Cluster``) starts them: a ``ray._private.node.Node`` per node, all on
127.0.0.1. Token authentication follows the environment (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN).

``LocalCluster`` starts and stops such nodes from Python (the multi-node tests, ``mempo chaos``):

    cluster = LocalCluster.create()                      # a temp dir, token auth with a fresh token
    cluster.add("head", 2, {"head_node": 100}, head=True)
    cluster.add("worker-1", 1, {"rollout_node": 1})
    cluster.kill_node("worker-1")                        # lost as a machine is: raylet and its family, SIGKILL
    cluster.shutdown()                                   # every node, and any process left mentioning it
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from services.common.local_ray import LOOPBACK, LOOPBACK_ENV, free_ports, use_loopback_node

ROOT = Path(__file__).resolve().parents[2]


def start_node(name: str, num_cpus: int, resources: dict, join: str | None, temp_dir: str,
               object_store_memory: int, dashboard: bool, system_config: dict | None = None):
    """Start one node's processes (GCS and dashboard too for a head); returns the ``Node``."""
    use_loopback_node()
    from ray._private.node import Node  # Ray on use
    from ray._private.parameter import RayParams  # Ray on use

    gcs, agent, agent_grpc, metrics, env_agent, client, dash = free_ports(7)
    params = RayParams(num_cpus=num_cpus, num_gpus=0, resources=resources, node_name=name,
                       node_ip_address=LOOPBACK, object_store_memory=object_store_memory, temp_dir=temp_dir,
                       min_worker_port=0, max_worker_port=0, node_manager_port=0,
                       dashboard_agent_listen_port=agent, metrics_agent_port=agent_grpc,
                       metrics_export_port=metrics, runtime_env_agent_port=env_agent)
    if join:
        params.update(gcs_address=join, include_log_monitor=False)
    else:
        params.update(gcs_server_port=gcs, ray_client_server_port=client, include_dashboard=dashboard,
                      dashboard_host=LOOPBACK, dashboard_port=dash, _system_config=system_config or {})
    return Node(params, head=not join, shutdown_at_exit=True, spawn_reaper=True)


def node_info(node, name: str) -> dict:
    from ray._private import ray_constants  # Ray on use

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    url = node.webui_url if node.head else None
    return {"name": name, "node_id": node.node_id, "gcs_address": node.gcs_address, "raylet_pid": raylet.pid,
            "dashboard_url": f"http://{url}" if url else None, "pid": os.getpid()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.pipeline.local_cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="node name (shown by Ray's state API)")
    p.add_argument("--num-cpus", type=int, default=1, help="logical CPUs of the node")
    p.add_argument("--resources", default="{}", help="custom resources, JSON, e.g. '{\"rollout_node\": 1}'")
    p.add_argument("--join", default=None, metavar="GCS_ADDRESS", help="join this head (else start a head)")
    p.add_argument("--temp-dir", default="/tmp/ray-mn", help="Ray's temp dir (the head's; short: socket paths)")
    p.add_argument("--object-store-memory", type=int, default=150 * 1024 * 1024)
    p.add_argument("--dashboard", action="store_true", help="head: run the dashboard (Ray's state API) on loopback")
    p.add_argument("--system-config", default="{}", help="head: Ray _system_config, JSON")
    p.add_argument("--info", required=True, help="write the node's JSON description here once it is up")
    a = p.parse_args(argv)
    try:
        resources = json.loads(a.resources)
        system_config = json.loads(a.system_config)
    except json.JSONDecodeError as e:
        print(f"error: --resources/--system-config is not JSON: {e}", file=sys.stderr)
        return 2
    node = start_node(a.name, a.num_cpus, resources, a.join, a.temp_dir, a.object_store_memory, a.dashboard,
                      system_config)
    info = Path(a.info)
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps(node_info(node, a.name)))
    tmp.rename(info)  # readers never see half a file
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.5)
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    return 0


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL a node process's whole session (what a failed start left of it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class NodeStartError(RuntimeError):
    """A node of a LocalCluster did not come up; the message carries the tail of its log."""


class LocalCluster:
    """Nodes of one multi-node Ray cluster on this machine, each a ``python -m
    services.pipeline.local_cluster`` process (module docstring), started in its own session."""

    def __init__(self, temp_dir: str, env: dict):
        self.temp_dir, self.env = temp_dir, env
        self.nodes: dict[str, dict] = {}  # name -> the node's info (node_id, gcs_address, raylet_pid, ...)
        self.procs: list[subprocess.Popen] = []

    @classmethod
    def create(cls, prefix: str = "mn") -> "LocalCluster":
        """A cluster in a fresh, short temp dir (Ray's socket paths live under it), token auth on with
        a token of its own, every address on loopback."""
        temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                   RAY_USAGE_STATS_ENABLED="0", **LOOPBACK_ENV)
        for key in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
            env.pop(key, None)
        return cls(temp_dir, env)

    def add(self, name: str, cpus: int, resources: dict, head: bool = False, timeout_s: float = 120,
            tries: int = 2) -> dict:
        """Start a node (the head first) and wait until it is up; returns its info. A node whose start
        Ray gives up on (its raylet not registered in time: a loaded machine) is started again, up to
        ``tries`` times in all."""
        for attempt in range(1, tries + 1):
            try:
                return self._start(name, cpus, resources, head, timeout_s)
            except NodeStartError:
                if attempt == tries:
                    raise

    def _start(self, name: str, cpus: int, resources: dict, head: bool, timeout_s: float) -> dict:
        info = Path(self.temp_dir) / f"{name}.json"
        cmd = [sys.executable, "-m", "services.pipeline.local_cluster", "--name", name, "--num-cpus", str(cpus),
               "--resources", json.dumps(resources), "--info", str(info), "--temp-dir", f"{self.temp_dir}/r",
               "--object-store-memory", str(200 * 1024 * 1024)]
        cmd += (["--dashboard", "--system-config", json.dumps({"max_direct_call_object_size": 1024})] if head
                else ["--join", self.nodes["head"]["gcs_address"]])
        log_path = Path(self.temp_dir) / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        deadline = time.time() + timeout_s
        while not info.is_file():
            if time.time() > deadline or proc.poll() is not None:
                _stop_group(proc)
                raise NodeStartError(f"node {name} did not come up: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        self.nodes[name] = json.loads(info.read_text())
        return self.nodes[name]

    @property
    def address(self) -> str:
        return self.nodes["head"]["gcs_address"]

    def state(self, resource: str) -> list[dict]:
        """Ray's state API (the head's dashboard): the live actors or nodes."""
        r = httpx.get(f"{self.nodes['head']['dashboard_url']}/api/v0/{resource}", params={"limit": 10000},
                      headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"}, timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]["result"]

    def placement(self) -> dict[str, list[str]]:
        """Alive actors by class, as the names of the nodes they run on."""
        names = {n["node_id"]: n["node_name"] for n in self.state("nodes")}
        out: dict[str, list[str]] = {}
        for a in self.state("actors"):
            if a["state"] == "ALIVE":
                out.setdefault(a["class_name"], []).append(names.get(a["node_id"], a["node_id"]))
        return {k: sorted(v) for k, v in out.items()}

    def processes(self, title: str) -> dict[str, list[int]]:
        """Live node name -> the pids its raylet started whose command line has a part starting with
        ``title`` (Ray titles an actor's worker process ``ray::<class name>``): the process table, read in
        milliseconds."""
        found: dict[str, list[int]] = {}
        for name, info in self.nodes.items():
            try:
                family = psutil.Process(info["raylet_pid"]).children(recursive=True)
            except psutil.NoSuchProcess:  # a node already lost
                continue
            for p in family:
                try:
                    if any(part.startswith(title) for part in p.cmdline()):
                        found.setdefault(name, []).append(p.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
        return found

    def nodes_running(self, title: str) -> list[str]:
        """The live nodes running a process titled ``title`` (see ``processes``)."""
        return list(self.processes(title))

    def alive(self, name: str) -> bool:
        try:
            return psutil.Process(self.nodes[name]["raylet_pid"]).is_running()
        except psutil.NoSuchProcess:
            return False

    def kill_node(self, name: str) -> None:
        """The node goes away as a machine does: its raylet (by pid) and, in the same instant, every
        process it started (the replicas' workers and their vLLM engine), all with SIGKILL."""
        raylet = psutil.Process(self.nodes[name]["raylet_pid"])
        for p in [raylet] + raylet.children(recursive=True):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def leftovers(self) -> list[int]:
        """Pids of live processes of this cluster: a command line that mentions its temp dir, or the
        cluster's token in the environment (every process a node starts inherits it, an orphaned vLLM
        engine too). None after a clean shutdown; this process itself is left out."""
        token = self.env.get("RAY_AUTH_TOKEN")
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid == os.getpid():
                continue
            try:
                if any(self.temp_dir in part for part in (p.info["cmdline"] or ())) or (
                        token and p.environ().get("RAY_AUTH_TOKEN") == token):
                    found.append(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def shutdown(self) -> None:
        """Stop every node: SIGTERM to its process group, 30 s for all of them to exit, then SIGKILL to
        whatever is left of their families or still belongs to this cluster (``leftovers``)."""
        stop_process_groups(self.procs, 30.0, self.leftovers)


def stop_process_groups(procs: list[subprocess.Popen], grace_s: float, leftovers=lambda: ()) -> None:
    """Stop processes started in their own sessions (``start_new_session=True``) and all they started:
    SIGTERM to each one's process group, up to ``grace_s`` seconds in all for them to exit, then SIGKILL to
    their process trees as they stood before the SIGTERM (children that left the group, e.g. a vLLM engine
    core), to the pids ``leftovers()`` names then, and to each group; the Popens are reaped."""
    family = []
    for p in procs:
        try:
            family += psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for pid in [q.pid for q in family] + [int(pid) for pid in leftovers()]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

if __name__ == "__main__":
    sys.exit(main())
