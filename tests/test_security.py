"""TLS, mutual TLS and bearer tokens on the gateway, and sessions namespaced by principal.

A second gateway (its own event loop on a thread) serves the `service` fixture's replicas with
certificates made here: a CA, a server certificate for 127.0.0.1 and a client certificate.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import threading
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.auth import bearer, client_channel, warn_if_exposed
from blockspec.service.cli import main as cli_main
from tests.live_service import APP

pytestmark = pytest.mark.xdist_group("ray")

TOKENS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-9876543210"}


def _certificate(name: str, key, issuer=None, issuer_key=None, ca: bool = False):
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM files: ca.pem, server.pem/server.key, client.pem/client.key, tokens.txt."""
    out = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("blockspec test CA", ca_key, ca=True)
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(name, key, ca, ca_key)
        (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (out / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    lines = ["# principal token"] + [f"{who} {token}" for who, token in TOKENS.items()]
    (out / "tokens.txt").write_text("\n".join(lines) + "\n")
    return out


class _Gateway:
    """A GatewayServer with `update` applied to the service's settings, on its own loop."""

    def __init__(self, service, **update):
        from ray import serve

        from blockspec.service.gateway import GatewayServer

        settings = service["settings"].model_copy(update=dict(port=0, metrics_port=0, **update))
        replicas = serve.get_deployment_handle("Replica", APP)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            server = GatewayServer(settings, replicas, await replicas.info.remote())
            await server.start()
            return server

        self.server = self._run(start())
        self.address = f"127.0.0.1:{self.server.port}"

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def close(self) -> None:
        self._run(self.server.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)


def _tls(pki, **more) -> dict:
    """Settings for TLS with the test's server certificate."""
    return dict(tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"), **more)


@pytest.fixture(scope="module")
def secure(service, pki):
    """TLS and bearer tokens (from a file)."""
    gateway = _Gateway(service, **_tls(pki, auth_tokens_file=str(pki / "tokens.txt")))
    yield gateway
    gateway.close()


def _generate(channel, token: str | None, **fields):
    request = pb.GenerateRequest(max_new_tokens=2, **fields)
    return pb_grpc.GeneratorStub(channel).Generate(request, metadata=bearer(token), timeout=60)


def test_tokens_are_required_and_checked_health_stays_open(secure, pki):
    with client_channel(secure.address, str(pki / "ca.pem")) as channel:
        for token, code in ((None, "UNAUTHENTICATED"), ("not-a-token", "PERMISSION_DENIED")):
            for call in ("Generate", "GenerateStream", "Info"):
                with pytest.raises(grpc.RpcError) as err:
                    reply = getattr(pb_grpc.GeneratorStub(channel), call)(
                        pb.InfoRequest() if call == "Info" else pb.GenerateRequest(prompt="x"),
                        metadata=bearer(token),
                        timeout=60,
                    )
                    list(reply) if call == "GenerateStream" else None
                assert err.value.code().name == code, call
                assert err.value.details().startswith("authorization:")
        assert _generate(channel, TOKENS["alice"], prompt="x").token_ids
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_clients_cannot_talk_to_a_tls_gateway(secure):
    with client_channel(secure.address) as channel, pytest.raises(grpc.RpcError) as err:
        _generate(channel, TOKENS["alice"], prompt="x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sessions_are_namespaced_by_principal(secure, pki):
    """Bob, sending Alice's session id, gets a session of his own, not her history."""
    with client_channel(secure.address, str(pki / "ca.pem")) as channel:
        first = _generate(channel, TOKENS["alice"], prompt="alice says hi", session_id="s1")
        again = _generate(channel, TOKENS["alice"], prompt=" and more", session_id="s1")
        bob = _generate(channel, TOKENS["bob"], prompt=" and more", session_id="s1")
    assert again.prompt_tokens > first.prompt_tokens  # Alice's history came along
    assert bob.prompt_tokens < first.prompt_tokens  # Bob's did not include it


def test_mutual_tls_requires_a_client_certificate(service, pki):
    gateway = _Gateway(service, **_tls(pki, tls_client_ca_file=str(pki / "ca.pem")))
    try:
        ca = (pki / "ca.pem").read_bytes()
        anonymous = grpc.ssl_channel_credentials(ca)
        with grpc.secure_channel(gateway.address, anonymous) as channel:
            with pytest.raises(grpc.RpcError) as err:
                _generate(channel, None, prompt="x")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        key, cert = (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
        with grpc.secure_channel(gateway.address, grpc.ssl_channel_credentials(ca, key, cert)) as c:
            assert _generate(c, None, prompt="x").token_ids
    finally:
        gateway.close()


def test_the_cli_speaks_tls_with_a_token(secure, pki, capsys, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_TOKEN", TOKENS["bob"])
    argv = ["generate", "def f(x):", "--address", secure.address, "--tls-ca", str(pki / "ca.pem")]
    cli_main([*argv, "--max-new-tokens", "4", "--seed", "1"])
    out, err = capsys.readouterr()
    assert out and "def f(x):" not in out  # the completion only, no prompt echo
    assert " 4 tokens in " in err  # the stats line


def test_serving_beyond_loopback_without_tls_and_tokens_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="blockspec.service.auth"):
        warn_if_exposed("127.0.0.1", tls=False, auth=False)
        warn_if_exposed("0.0.0.0", tls=True, auth=True)
        assert not caplog.records
        warn_if_exposed("0.0.0.0", tls=True, auth=False)
    assert "WITHOUT AUTHENTICATION" in caplog.text


def test_each_client_has_its_own_concurrency_limit(service):
    """With one request in flight per client, Alice's second concurrent request is refused
    RESOURCE_EXHAUSTED while Bob's goes through."""
    gateway = _Gateway(service, auth_tokens=TOKENS, max_in_flight_per_client=1)
    try:
        with client_channel(gateway.address) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            long = pb.GenerateRequest(prompt="a", max_new_tokens=300, ignore_eos=True)
            first = stub.Generate.future(long, metadata=bearer(TOKENS["alice"]), timeout=120)
            deadline = time.monotonic() + 30
            while not gateway.server.core.per_client["alice"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as err:
                _generate(channel, TOKENS["alice"], prompt="x")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "'alice' holds 1 requests" in err.value.details()
            assert _generate(channel, TOKENS["bob"], prompt="x").token_ids
            assert len(first.result().token_ids) == 300
            assert _generate(channel, TOKENS["alice"], prompt="x").token_ids  # freed again
    finally:
        gateway.close()


def test_server_generated_session_ids(secure, pki):
    """new_session: a 128-bit id made by the server, returned by Generate and on the last
    chunk of GenerateStream, continuing like any session; with session_id too: refused."""
    with client_channel(secure.address, str(pki / "ca.pem")) as channel:
        first = _generate(channel, TOKENS["alice"], prompt="hello", new_session=True)
        assert len(first.session_id) == 32 and int(first.session_id, 16) >= 0
        again = _generate(channel, TOKENS["alice"], prompt=" more", session_id=first.session_id)
        assert again.prompt_tokens > first.prompt_tokens
        stream = pb_grpc.GeneratorStub(channel).GenerateStream(
            pb.GenerateRequest(prompt="hi", max_new_tokens=2, new_session=True),
            metadata=bearer(TOKENS["alice"]),
            timeout=60,
        )
        *_, last = list(stream)
        assert len(last.session_id) == 32 and last.session_id != first.session_id
        with pytest.raises(grpc.RpcError) as err:
            _generate(channel, TOKENS["alice"], prompt="x", new_session=True, session_id="s")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("new_session:")
