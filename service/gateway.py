"""The gRPC gateway: the public API (protos/blockspec.proto) in front of the replica deployment.

Why our own `grpc.aio` server instead of Serve's gRPC proxy: the proxy rewrites application
status codes to INTERNAL (ray-project/ray#58851) and add a hop per unary call; the
contract below needs exact codes. The gateway reaches replicas through a Serve
`DeploymentHandle`, so Serve's routing and autoscaling (on ongoing requests) stay in charge.

The requests themselves are the application core's (service/core.py): the Generator servicer
here maps protobuf onto the core's parameters and events and its Refusals onto status codes,
and the call's deadline and end onto the core's. Also grpc.health.v1 (NOT_SERVING while
draining), server reflection and the Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.json_format import ParseDict
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server
from transformers import AutoTokenizer

from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.auth import BearerAuth, server_credentials, warn_if_exposed
from blockspec.service.config import Settings
from blockspec.service.core import (
    Caller,
    GatewayMetrics,
    Generation,
    GenerationCore,
    Refusal,
    Summary,
    Text,
)
from blockspec.service.ports import GRPC_EXCLUSIVE
from blockspec.service.requests import (
    ChatTurn,
    ReplicaInfo,
    RequestParams,
)
from blockspec.service.sessions import open_store

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP}


@dataclass(frozen=True)
class _Undecodable:
    """A request payload that did not parse: the RPC answers INVALID_ARGUMENT with `message`
    (grpc itself would answer UNKNOWN)."""

    message: str


def _add_generator(servicer: GeneratorServicer, server: grpc.aio.Server) -> None:
    """pb_grpc.add_GeneratorServicer_to_server, except that a payload that does not parse
    reaches the method as `_Undecodable` instead of failing inside grpc."""

    class Recorder:  # takes the generated handler table instead of a server
        def add_generic_rpc_handlers(self, handlers) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            self.service, self.handlers = service, handlers

    def lenient(parse):
        def deserialize(payload: bytes):
            try:
                return parse(payload)
            except DecodeError as exc:
                return _Undecodable(f"request: the payload did not parse ({exc})")

        return deserialize

    table = Recorder()
    pb_grpc.add_GeneratorServicer_to_server(servicer, table)
    handlers = {
        name: handler._replace(request_deserializer=lenient(handler.request_deserializer))
        for name, handler in table.handlers.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(table.service, handlers),)
    )
    server.add_registered_method_handlers(table.service, handlers)


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


# GenerateRequest's fields with explicit presence: unset is the deployment's default (None),
# set is the value, 0 included (the validator judges it).
OPTIONAL_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "gamma", "k")


def request_params(request: pb.GenerateRequest) -> RequestParams:
    """The validator's input from the wire request (unset optional fields and an empty method
    mean the default)."""
    optional = {name: getattr(request, name) for name in OPTIONAL_FIELDS}
    return RequestParams(
        prompt=request.prompt,
        prompt_token_ids=tuple(request.prompt_token_ids),
        messages=tuple(ChatTurn(m.role, m.content) for m in request.messages),
        method=request.method or None,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        session_id=request.session_id,
        new_session=request.new_session,
        ignore_eos=request.ignore_eos,
        **{name: value for name, value in optional.items() if request.HasField(name)},
    )


class GeneratorServicer(pb_grpc.GeneratorServicer):
    """The wire contract's Generator service: an adapter over the application core
    (service/core.py), mapping protobuf onto its parameters and events, and Refusals onto
    gRPC status codes."""

    def __init__(self, core: GenerationCore):
        self.core = core

    async def Info(self, request, context) -> pb.InfoResponse:
        await _refuse_undecodable(request, context)
        return ParseDict(self.core.facts(), pb.InfoResponse())

    async def Generate(self, request, context) -> pb.GenerateResponse:
        await _refuse_undecodable(request, context)
        generation = self._open(request, context, unary=True)
        text, ids, last = [], [], None
        try:
            async for event in generation.events():
                text.append(event.text)
                if isinstance(event, Text):
                    ids += event.token_ids
                last = event
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.details)
        return pb.GenerateResponse(
            text="".join(text),
            token_ids=ids,
            finish_reason=FINISH[last.finish_reason],
            stats=_stats(last.stats),
            prompt_tokens=generation.call.prompt_tokens,
            session_id=last.session_id,
            replica=last.replica,
        )

    async def GenerateStream(self, request, context) -> AsyncIterator[pb.GenerateChunk]:
        await _refuse_undecodable(request, context)
        generation = self._open(request, context)
        try:
            async for event in generation.events():
                if isinstance(event, Text):
                    yield pb.GenerateChunk(text=event.text, token_ids=event.token_ids)
                else:
                    yield pb.GenerateChunk(
                        text=event.text,
                        finish_reason=FINISH[event.finish_reason],
                        stats=_stats(event.stats),
                        replica=event.replica,
                        session_id=event.session_id,
                    )
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.details)

    def _open(self, request, context, unary: bool = False) -> Generation:
        """The request on the core; the RPC's end (however it ends) ends it there."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        caller = Caller(tuple(context.invocation_metadata()), context.peer(), deadline)
        generation = self.core.open(request_params(request), caller, unary=unary)
        context.add_done_callback(lambda _: generation.end())
        return generation


def _stats(summary: Summary) -> pb.SpeculationStats:
    return ParseDict(dataclasses.asdict(summary), pb.SpeculationStats())


class GatewayServer:
    """The gRPC server with health and reflection, and the Prometheus endpoint."""

    def __init__(self, settings: Settings, replicas, info: ReplicaInfo):
        self.settings = settings
        tokenizer = AutoTokenizer.from_pretrained(
            settings.replica.target_dir, local_files_only=True
        )
        auth = BearerAuth(settings.tokens())
        registry = CollectorRegistry()
        self.metrics = GatewayMetrics(registry)
        self.metrics_port = None
        if settings.metrics_port:
            server, _ = start_http_server(
                settings.metrics_port, addr=settings.host, registry=registry
            )
            self.metrics_port = server.server_port
            self._metrics_server = server
        self.store = open_store(settings.redis_url, settings.session_ttl_s)
        # Every replica full (max_batch + max_queued each) and one replica's worth waiting.
        capacity = settings.replica.max_batch + settings.replica.max_queued
        max_in_flight = (settings.autoscaling.max_replicas + 1) * capacity
        self.core = GenerationCore(
            replicas,
            tokenizer,
            info,
            self.store,
            self.metrics,
            max_in_flight,
            auth,
            settings.max_in_flight_per_client,
        )
        self.health = health.aio.HealthServicer()
        # Exclusive: another server that binds this port later fails instead of sharing it.
        self.server = grpc.aio.server(interceptors=[auth], options=GRPC_EXCLUSIVE)
        _add_generator(GeneratorServicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        address = f"{settings.host}:{settings.port}"
        tls = bool(settings.tls_cert_file)
        if tls:
            credentials = server_credentials(
                settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
            )
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        # Serve's HTTP proxy, when on, speaks plain HTTP on the same host.
        warn_if_exposed(settings.host, tls and not settings.http_port, auth.enabled)
        if not self.port:
            raise RuntimeError(f"cannot listen on {settings.host}:{settings.port}")

    async def start(self) -> None:
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """Stop taking requests (UNAVAILABLE, health NOT_SERVING), let in-flight ones finish
        for up to drain_timeout_s, then stop."""
        self.core.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.core.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        with contextlib.suppress(Exception):
            await self.store.close()
        if self.metrics_port:
            self._metrics_server.shutdown()
