"""The listening TCP sockets of a process tree, and which of them other machines could reach."""

from __future__ import annotations

import ipaddress

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its live descendants."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listening(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket in LISTEN state in the tree of ``pid``."""
    found = []
    for p in tree(pid):
        try:
            name, conns = p.name(), p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return sorted(set(found))


def is_loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def exposed(listeners: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The listeners on an address other than 127.0.0.0/8 or ::1 (``0.0.0.0`` and ``::`` included)."""
    return [entry for entry in listeners if not is_loopback(entry[0])]
