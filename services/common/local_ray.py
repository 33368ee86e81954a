"""A Ray cluster that mempo starts itself: every Ray and Serve port on loopback, token auth on.

    ray.init(**local_init_options(num_cpus, object_store_memory))

is how ``mempo`` (services/pipeline/apps.py ``connect``, when ``ray.address`` is empty), the tests'
session cluster and the benches start Ray. What each piece closes (Ray 2.60):

- **Node address 127.0.0.1, single node.** On Linux Ray turns a loopback ``_node_ip_address`` into
  the machine's routable address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` says the cluster is
  single-node (``resolve_ip_for_localhost`` in ray/_private/services.py). With both, the GCS, raylet,
  object manager, worker gRPC servers, dashboard agent, metrics export and runtime-env agent listen
  on 127.0.0.1, and ``ray start --address`` refuses to join another node from this environment.
- **No dashboard** (``include_dashboard=False``; its host is 127.0.0.1 should it be turned on).
- **Serve replicas.** Each replica opens an inter-deployment gRPC server on ``[::]:0`` whatever the
  node's address; :func:`keep_serve_grpc_on_loopback` (called from services/__init__.py, which every
  replica imports to unpickle its deployment) binds it to 127.0.0.1 on a loopback node. Serve's HTTP
  proxy listens on ``ray.http_host`` (127.0.0.1 by default).
- **Token authentication stays on.** Nothing here disables it: with ``RAY_AUTH_MODE`` unset (or
  ``token``) Ray 2.60 enables it for a new local cluster. The token is Ray's default file,
  ``~/.ray/auth_token``, created here readable by its owner only (Ray writes it with the umask's
  mode) and without a race between two first starts; ``mempo scale`` and the ``ray``/``serve`` CLIs
  of the same user find it there.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import signal
import socket
import threading
import sys
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
# The environment a loopback-only node needs in every process that starts Ray (ray.init, ray start).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
TOKEN_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


# Ports the services are told to listen on come from below the kernel's ephemeral range: a port taken
# there by binding to port 0 was free when chosen but could be handed to any process's outgoing
# connection (or another bind to port 0) before the service bound it (seen: Serve's proxy "Failed to
# bind" beside a running comparison). Above Ray's default worker ports (10002-19999).
_PORTS_FROM = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on loopback now (all held open together, so none repeats), chosen at
    random below the ephemeral range where one exists, so no outgoing connection takes one meanwhile."""
    socks: list[socket.socket] = []
    candidates = list(range(_PORTS_FROM, _ephemeral_start()))
    random.SystemRandom().shuffle(candidates)
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((LOOPBACK, port))
            except OSError:  # in use
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room below the ephemeral range: the kernel's choice
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_init_options(num_cpus: int | None, object_store_memory: int | None) -> dict[str, Any]:
    """``ray.init`` keyword arguments for a new local cluster (and the environment it needs)."""
    use_loopback_node()
    # Ray 2.60 turns token auth on for a cluster ray.init starts when RAY_AUTH_MODE is unset (and
    # refreshes its cached config then; setting the variable here, after `import ray`, would not).
    if os.environ.get("RAY_AUTH_MODE", "token").lower() == "token":
        ensure_token()
    return {"num_cpus": num_cpus, "object_store_memory": object_store_memory, "_node_ip_address": LOOPBACK,
            "include_dashboard": False, "dashboard_host": LOOPBACK,
            "log_to_driver": False, "configure_logging": False}


def join_options(address: str) -> dict[str, Any]:
    """``ray.init`` keyword arguments to join a running cluster. A loopback address, or ``auto`` (which
    finds a cluster on this machine), keeps its 127.0.0.1: Ray would otherwise rewrite it to the
    routable address, where a loopback-only GCS does not listen."""
    host = address.split("://")[-1].rsplit(":", 1)[0]
    if address == "auto" or is_loopback(host):
        use_loopback_node()
    return {"address": address, "log_to_driver": False, "configure_logging": False}


# Serve kills an HTTP proxy that is not ready within 5 s of its start (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S),
# and ``serve.start`` then fails with the proxy's ActorDiedError: on a loaded 2-core machine a proxy's start
# takes longer. A node mempo starts gives it a minute.
# Its proxies also answer a request whose replica died before answering with 503 + Retry-After, not 500
# (services/common/proxy_middleware.py; Serve reads the callback from its proxies' environment).
SERVE_NODE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                  "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "services.common.proxy_middleware:proxy_middlewares"}


def init_keeping_sigterm(**options: Any) -> None:
    """``ray.init(**options)``, leaving a callable SIGTERM handler of this process in place: ray.init
    replaces it with ``sys.exit``, after which a ``kill`` aborted a mempo command at exit (rc 134)
    instead of stopping it like Ctrl-C (services/cli.py ``stop_like_ctrl_c``)."""
    import ray  # Ray on use: the address and port helpers here need none

    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    ray.init(**options)
    if callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)


# OpenMP threads that wait sleep rather than spin. torch (a learner rank's ``learner.threads``, a test's
# in-process model) splits each op over its OpenMP threads, and GNU OpenMP's default has a thread that
# finished its share spin for a while before it sleeps. On a CPU node the stages share a few cores: a thread
# that spins for a partner still waiting for a core takes the core that partner needs, at every op, so a
# step costs many times its CPU whenever the cores are shared (docs/architecture.md, platform notes).
# Read when a process loads OpenMP, so it is set in the node's environment, before any worker starts.
CPU_NODE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def use_loopback_node() -> None:
    """Tell Ray (this process and what it starts) that the node's address is loopback, not routable, and
    that a slow machine is no reason to kill Serve's HTTP proxy and a lost replica no reason for a 500
    (``SERVE_NODE_ENV``), and that OpenMP threads sleep while they wait (``CPU_NODE_ENV``), each unless set."""
    os.environ.update(LOOPBACK_ENV)
    for key, value in (SERVE_NODE_ENV | CPU_NODE_ENV).items():
        os.environ.setdefault(key, value)
    if "ray._private.ray_constants" in sys.modules:  # read at import: also set it when ray came first
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False


def ensure_token(home: Path | None = None) -> Path | None:
    """Create Ray's default token file (mode 0600) if no token is given; returns its path."""
    if any(os.environ.get(k) for k in TOKEN_ENV):
        return None
    path = (home or Path.home()) / ".ray" / "auth_token"
    if path.exists():
        return path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".auth_token.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes
    try:
        os.link(tmp, path)  # atomic and never overwrites: of two first starts, one token wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def keep_serve_grpc_on_loopback() -> None:
    """In a Serve replica process, bind its inter-deployment gRPC server to 127.0.0.1 instead of
    ``[::]`` when the node's address is loopback (no-op elsewhere, and once only)."""
    replica = sys.modules.get("ray.serve._private.replica")
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "_mempo_loopback", False):
        return

    def add_port_on_loopback(server, address: str):
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", "") and _node_is_loopback():
            address = f"{LOOPBACK}:{port}"
        return add_port(server, address)

    add_port_on_loopback._mempo_loopback = True
    replica.add_port_to_grpc_server = add_port_on_loopback


def _node_is_loopback() -> bool:
    import ray  # Ray on use (see init_keeping_sigterm)

    try:
        return is_loopback(ray.util.get_node_ip_address())
    except Exception:  # not connected: leave Ray's choice alone
        return False
