"""The options of a cluster mempo starts itself (services/common/local_ray.py), without starting Ray."""

import os
import stat
import types

import pytest

from services.common import local_ray


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in (*local_ray.TOKEN_ENV, "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in local_ray.LOOPBACK_ENV.items():  # restored after the test, whatever it sets
        monkeypatch.setenv(key, "1")
    ray_constants = pytest.importorskip("ray._private.ray_constants")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    return tmp_path


def test_local_options_bind_loopback_and_keep_auth_on(clean_env):
    opts = local_ray.local_init_options(num_cpus=2, object_store_memory=100_000_000)
    assert opts["_node_ip_address"] == opts["dashboard_host"] == "127.0.0.1" and opts["include_dashboard"] is False
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    import ray._private.ray_constants as ray_constants

    assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert "RAY_AUTH_MODE" not in os.environ  # Ray's default for a local cluster: token auth on
    token = clean_env / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64


def test_a_local_node_has_openmp_threads_sleep_unless_the_environment_says_otherwise(clean_env, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # restored after the test (the session sets it)
    local_ray.local_init_options(num_cpus=2, object_store_memory=100_000_000)
    assert os.environ["OMP_WAIT_POLICY"] == local_ray.CPU_NODE_ENV["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice stays
    local_ray.local_init_options(num_cpus=2, object_store_memory=100_000_000)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_token_is_created_once_and_an_explicit_token_wins(clean_env, monkeypatch):
    first = local_ray.ensure_token()
    text = first.read_text()
    assert local_ray.ensure_token() == first and first.read_text() == text
    assert [p.name for p in first.parent.iterdir()] == ["auth_token"]  # no temp file left
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 64)
    assert local_ray.ensure_token() is None


def test_joining_a_loopback_cluster_keeps_its_address(clean_env):
    local_ray.join_options("10.1.2.3:6379")
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert local_ray.join_options("127.0.0.1:6379")["address"] == "127.0.0.1:6379"
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


def test_serve_replica_grpc_moves_to_loopback_on_a_loopback_node(monkeypatch):
    bound = []
    fake = types.SimpleNamespace(add_port_to_grpc_server=lambda server, address: bound.append(address) or 1)
    monkeypatch.setitem(__import__("sys").modules, "ray.serve._private.replica", fake)
    monkeypatch.setattr(local_ray, "_node_is_loopback", lambda: True)
    local_ray.keep_serve_grpc_on_loopback()
    local_ray.keep_serve_grpc_on_loopback()  # once only
    fake.add_port_to_grpc_server(None, "[::]:0")
    monkeypatch.setattr(local_ray, "_node_is_loopback", lambda: False)
    fake.add_port_to_grpc_server(None, "[::]:0")
    assert bound == ["127.0.0.1:0", "[::]:0"]


def test_init_keeping_sigterm_puts_the_commands_handler_back(monkeypatch):
    # ray.init installs a SIGTERM handler that calls sys.exit (Ray 2.60's worker.py); the command's own
    # Ctrl-C-like handler must survive it, and with no callable handler before, Ray's stays
    import signal

    import ray

    def rays_handler(signum, frame):
        raise SystemExit(1)

    seen = {}
    monkeypatch.setattr(ray, "init", lambda **kw: (seen.update(kw), signal.signal(signal.SIGTERM, rays_handler)))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        def ours(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, ours)
        local_ray.init_keeping_sigterm(address="127.0.0.1:6379")
        assert seen == {"address": "127.0.0.1:6379"} and signal.getsignal(signal.SIGTERM) is ours
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        local_ray.init_keeping_sigterm()
        assert signal.getsignal(signal.SIGTERM) is rays_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range(monkeypatch):
    import socket

    ports = local_ray.free_ports(6)
    assert len(set(ports)) == 6
    assert all(local_ray._PORTS_FROM <= p < local_ray._ephemeral_start() for p in ports)
    for p in ports:  # nothing holds them after the call
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # a taken port is skipped
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        monkeypatch.setattr(local_ray, "_ephemeral_start", lambda: ports[0] + 1)
        monkeypatch.setattr(local_ray, "_PORTS_FROM", ports[0])
        assert local_ray.free_ports(1)[0] != ports[0]  # none left below: the kernel's choice instead
