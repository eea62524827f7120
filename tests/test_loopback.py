"""A local deployment listens on loopback only: every listening socket of the process tree that
`blockspec serve` starts (this process, Ray's GCS, raylet and agents, Serve's controller, proxy
and replicas, the draft and target actors, redis) is on 127.0.0.1 / ::1."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

pytestmark = pytest.mark.xdist_group("ray")


def listeners(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP listener of root and its descendants."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="tcp")
            name = proc.name()
        except psutil.NoSuchProcess:  # a worker that exited while we looked
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == "LISTEN"]
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_every_socket_of_a_local_deployment_listens_on_loopback(service):
    # The fixture's deployment serves: the gateway's gRPC and HTTP ports are among them.
    found = listeners(psutil.Process())
    ports = {port for _, _, port in found}
    assert service["address"]["port"] in ports and service["settings"].http_port in ports
    assert any(name.startswith("ray::ServeReplica") for name, _, _ in found), found
    exposed = [entry for entry in found if not is_loopback(entry[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_the_check_sees_a_socket_on_every_interface():
    import socket

    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        found = listeners(psutil.Process())
    assert ("0.0.0.0", port) in [(address, p) for _, address, p in found]
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("::1")
