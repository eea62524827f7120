"""Transport security of the gRPC gateway: optional TLS (mutual with a client CA) and bearer
tokens, each token naming a *principal* (a client). Off by default: the service then listens on
127.0.0.1 only, and serving another address without both gets a loud warning.

Tokens come from `Settings.auth_tokens` (principal -> token; `BLOCKSPEC_AUTH_TOKENS` as JSON)
and `Settings.auth_tokens_file` (one `principal token` pair per line, `#` comments). A request
carries `authorization: Bearer <token>` metadata; health checks and reflection stay open.
Sessions are namespaced by principal (service/gateway.py), so a client cannot read or extend
another's session by guessing its id.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # no token needed


def read_tokens_file(path: str) -> dict[str, str]:
    """principal -> token from `principal token` lines."""
    tokens = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"auth_tokens_file: {path}:{number}: expected 'principal token'")
        tokens[parts[0]] = parts[1]
    return tokens


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without a known bearer token: UNAUTHENTICATED when none is sent,
    PERMISSION_DENIED when the token is not one of ours."""

    def __init__(self, tokens: dict[str, str]):
        self._tokens = [(principal, token.encode()) for principal, token in tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def principal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The principal whose token the metadata carries ("" when auth is off)."""
        if not self._tokens:
            return ""
        header = dict(metadata or ()).get("authorization", "")
        header = header.decode() if isinstance(header, bytes) else header
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        found = None
        for principal, known in self._tokens:  # every comparison runs: no early exit to time
            if hmac.compare_digest(token.encode(), known):
                found = principal
        return found

    def refusal(
        self, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why a call with this metadata is refused (None: it is not). Every ingress asks
        this: the gRPC interceptor below and the HTTP API (service/http_api.py)."""
        if not self._tokens:
            return None
        if dict(metadata or ()).get("authorization") is None:
            return grpc.StatusCode.UNAUTHENTICATED, "authorization: missing"
        if self.principal(metadata) is None:
            return grpc.StatusCode.PERMISSION_DENIED, "authorization: unknown token"
        return None

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        refused = self.refusal(details.invocation_metadata)
        return handler if refused is None else _refusal(handler, *refused)


def _refusal(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that only aborts."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # an async generator, as a server-streaming handler must be

    kind = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kind)
    return grpc.unary_unary_rpc_method_handler(unary, **kind)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None):
    """TLS credentials; with a client CA, clients must present a certificate it signed."""
    ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


def warn_if_exposed(host: str, tls: bool, auth: bool) -> None:
    """Serving beyond this machine without TLS and tokens: say so, loudly."""
    if host in ("127.0.0.1", "localhost", "::1") or (tls and auth):
        return
    missing = " and ".join(name for name, on in (("TLS", tls), ("authentication", auth)) if not on)
    log.warning(
        "SERVING %s WITHOUT %s: anyone who can reach it can generate and read sessions",
        host,
        missing.upper(),
    )


# ------------------------------------------------------------------------------ client side
def client_channel(address: str, tls_ca_file: str | None = None, aio: bool = False):
    """A channel to the gateway: TLS (trusting the CA in `tls_ca_file`) or plaintext."""
    module = grpc.aio if aio else grpc
    if tls_ca_file:
        credentials = grpc.ssl_channel_credentials(Path(tls_ca_file).read_bytes())
        return module.secure_channel(address, credentials)
    return module.insecure_channel(address)


def bearer(token: str | None) -> list[tuple[str, str]] | None:
    """Call metadata carrying `token` (None: none)."""
    return [("authorization", f"Bearer {token}")] if token else None
