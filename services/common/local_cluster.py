"""One node of a multi-node Ray cluster on this machine: a head, or a worker that joins it.

Each node is its own process (as ``ray start --block`` would be), on loopback, with its own CPUs and
custom resources, so a real multi-node pipeline (object refs whose bytes live on another node,
weights sent between nodes, placement by resources, a whole node lost) runs on one laptop:

    python -m services.common.local_cluster --name head --num-cpus 1 \\
        --resources '{"head_node": 100}' --info /tmp/mn/head.json --dashboard
    python -m services.common.local_cluster --name worker-1 --num-cpus 1 \\
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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from services.common.local_ray import LOOPBACK, free_ports, use_loopback_node


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
    p = argparse.ArgumentParser(prog="python -m services.common.local_cluster", description=__doc__,
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


if __name__ == "__main__":
    sys.exit(main())
