"""A deployment's listening ports are its own: nothing else may listen on them, and nothing
that starts later may join them.

Linux lets two sockets share a port when both set SO_REUSEPORT, and then splits connections
between them: two deployments would answer each other's requests, sessions and cached
prefixes, silently. gRPC's server and Ray Serve's HTTP proxy both set it by default, so every
listener of ours turns it off (`GRPC_EXCLUSIVE` for the gateway, `SERVE_EXCLUSIVE_ENV` for the
proxy; the Prometheus endpoint never sets it). A bind then fails on a taken port whoever holds
it, and `check_free` says so before anything starts, naming the port and its flag.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

# grpc.aio.server(options=...): bind exclusively (gRPC's default shares the port).
GRPC_EXCLUSIVE = (("grpc.so_reuseport", 0),)
# Read by Serve's HTTP proxy process when it starts (ray/serve/_private/proxy.py).
SERVE_EXCLUSIVE_ENV = {"SERVE_SOCKET_REUSE_PORT_ENABLED": "0"}


@dataclass(frozen=True)
class Listener:
    port: int
    flag: str  # `blockspec serve`'s flag that sets it
    what: str  # what listens there
    off: str = ""  # how the flag turns it off, if it can


class PortTaken(Exception):
    """A port this deployment would listen on is in use (or named twice)."""


def listeners(settings) -> list[Listener]:
    """The fixed ports a deployment with `settings` listens on (0: any free port, or off)."""
    wanted = [
        Listener(settings.port, "--port", "gRPC", "0 picks any free port"),
        Listener(settings.http_port, "--http-port", "OpenAI HTTP", "0 turns it off"),
        Listener(settings.metrics_port, "--metrics-port", "Prometheus metrics", "0 turns it off"),
    ]
    return [w for w in wanted if w.port]


def check_free(host: str, wanted: list[Listener]) -> None:
    """Raise PortTaken naming the first port of `wanted` that cannot be bound on `host`.

    The probe binds the way our listeners do: without SO_REUSEPORT (so a listener that set it
    still counts as taken), with SO_REUSEADDR (so a closed connection's TIME_WAIT does not)."""
    seen: dict[int, Listener] = {}
    for listener in wanted:
        other = seen.setdefault(listener.port, listener)
        if other is not listener:
            raise PortTaken(
                f"port {listener.port} is named for both {other.what} ({other.flag}) and "
                f"{listener.what} ({listener.flag}); give each its own"
            )
        try:
            _probe(host, listener.port)
        except OSError as err:
            raise PortTaken(_taken_message(host, listener, err)) from None


def _probe(host: str, port: int) -> None:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)


def _taken_message(host: str, listener: Listener, err: OSError) -> str:
    change = f"choose another with {listener.flag}"
    if listener.off:
        change += f" ({listener.off})"
    if err.errno == errno.EADDRINUSE:
        return (
            f"{host}:{listener.port} ({listener.what}, {listener.flag}) is already in use, by "
            f"another blockspec deployment or another program; stop it or {change}"
        )
    return f"cannot listen on {host}:{listener.port} ({listener.what}, {listener.flag}): {err}"
