"""A deployment's ports are its own (service/ports.py), without Ray: `blockspec serve` refuses a
taken port before Ray starts, naming the port and its flag, whoever holds it; and the gateway's
gRPC server binds exclusively. tests/test_service.py checks the live deployment's listeners."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from blockspec.service.ports import GRPC_EXCLUSIVE, Listener, PortTaken, check_free
from tests.cli_process import BLOCKSPEC
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def listening(reuse_port: bool) -> socket.socket:
    """A socket listening on a free loopback port, sharing it (SO_REUSEPORT) or not."""
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_taken_port_is_refused_naming_it_and_its_flag(reuse_port):
    with listening(reuse_port) as held:
        port = held.getsockname()[1]
        wanted = [Listener(free_port(), "--port", "gRPC"), Listener(port, "--http-port", "HTTP")]
        with pytest.raises(PortTaken) as err:
            check_free("127.0.0.1", wanted)
    assert str(err.value).startswith(f"127.0.0.1:{port} (HTTP, --http-port) is already in use")
    assert "choose another with --http-port" in str(err.value)


def test_free_ports_pass_and_a_port_named_twice_does_not():
    a, b = free_port(), free_port()
    check_free("127.0.0.1", [Listener(a, "--port", "gRPC"), Listener(b, "--metrics-port", "m")])
    with pytest.raises(PortTaken, match=f"port {a} is named for both gRPC"):
        check_free("127.0.0.1", [Listener(a, "--port", "gRPC"), Listener(a, "--http-port", "h")])


def test_a_closed_connections_time_wait_is_not_taken():
    """A port whose last connection is in TIME_WAIT (a server just stopped) is free."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end waits in TIME_WAIT
        client.close()
    check_free("127.0.0.1", [Listener(port, "--port", "gRPC")])


def test_serve_refuses_a_taken_port_before_starting_ray():
    """`blockspec serve` on a port another program holds: exit status 1, the port and flag
    named, within seconds (no Ray cluster was started: it would take far longer)."""
    with listening(reuse_port=True) as held:
        port = held.getsockname()[1]
        argv = ["serve", "--port", str(free_port()), "--http-port", str(port)]
        argv += ["--metrics-port", str(free_port())]
        start = time.monotonic()
        done = subprocess.run(
            [*BLOCKSPEC, *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        seconds = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"error: 127.0.0.1:{port} (OpenAI HTTP, --http-port) is already in use, by another "
        "blockspec deployment or another program; stop it or choose another with --http-port "
        "(0 turns it off)"
    )
    assert seconds < 30


def test_the_gateways_grpc_server_does_not_share_its_port():
    """With gRPC's default options a second server joins a port held with SO_REUSEPORT (and
    takes part of its traffic); with ours it fails to bind."""

    async def bind(options) -> int:
        server = grpc.aio.server(options=options)
        try:
            return server.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:  # grpc raises where older versions returned 0
            return 0
        finally:
            await server.stop(None)

    with listening(reuse_port=True) as held:
        port = held.getsockname()[1]
        assert asyncio.run(bind(None)) == port  # what the gateway did before
        assert asyncio.run(bind(GRPC_EXCLUSIVE)) == 0
