"""The gRPC gateway: the public API (protos/blockspec.proto) in front of the replica deployment.

Why our own `grpc.aio` server instead of Serve's gRPC proxy: the proxy rewrites application
status codes to INTERNAL (ray-project/ray#58851) and cost ~7–10 ms per unary call here; the
contract below needs exact codes. The gateway reaches replicas through a Serve
`DeploymentHandle`, so Serve's routing and autoscaling (on ongoing requests) stay in charge.

Per request: check fields (INVALID_ARGUMENT, naming the field), tokenize, prepend the session's
history, stream the replica's tokens back as text (stop strings cut here), record metrics, save
the session. Codes: RESOURCE_EXHAUSTED when the replicas' queues are full (the gateway holds
at most max_replicas + 1 replicas' worth of requests), DEADLINE_EXCEEDED / CANCELLED stop the
request and free its KV cache, UNAVAILABLE while draining or when a replica failed. Also
grpc.health.v1 (NOT_SERVING while draining) and server reflection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from ray.serve.exceptions import BackPressureError
from transformers import AutoTokenizer

from protos import blockspec_pb2 as pb
from protos import blockspec_pb2_grpc as pb_grpc
from service.auth import BearerAuth, server_credentials, warn_if_exposed
from service.config import Settings
from service.coordinator import DeadlineExceeded, Overloaded, ReplicaFailed, RequestLost
from service.detokenizer import TextStream
from service.engine import InvalidArgument
from service.requests import (
    FinishedEvent,
    GenerateJob,
    Limits,
    SpeculationStats,
    check_request,
    check_sizes,
    prompt_ids,
)
from service.sessions import Session, SessionStore, StoreUnavailableError, open_store

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP}


class GatewayMetrics:
    """Request-level metrics (Prometheus, on the gateway's /metrics). Step-level ones (phase
    times, batch size, queue depth) come from the replicas through Ray's metrics agent."""

    def __init__(self, registry: CollectorRegistry):
        def counter(name, doc, labels=("method",)):
            return Counter(name, doc, labels, registry=registry)

        self.requests = counter(
            "blockspec_requests", "Finished requests by gRPC code", ("method", "code")
        )
        self.output_tokens = counter("blockspec_output_tokens", "Generated tokens")
        self.target_calls = counter("blockspec_target_calls", "Target forward passes (steps)")
        self.accepted = counter(
            "blockspec_accepted_tokens",
            "Draft tokens accepted, by draft position (0-based)",
            ("method", "position"),
        )
        self.block_efficiency = Histogram(
            "blockspec_block_efficiency",
            "Emitted tokens per target call, per request",
            ["method"],
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 17),
            registry=registry,
        )
        self.latency = Histogram(
            "blockspec_request_seconds", "Request latency", ["method"], registry=registry
        )
        self.first_token = Histogram(
            "blockspec_time_to_first_token_seconds",
            "Time to first token",
            ["method"],
            registry=registry,
        )
        self.in_flight = Gauge("blockspec_in_flight", "Requests being served", registry=registry)

    def finished(self, method: str, stats: SpeculationStats, tokens: int) -> None:
        self.output_tokens.labels(method).inc(tokens)
        self.target_calls.labels(method).inc(stats.target_calls)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted.labels(method, str(position)).inc(count)
        if stats.target_calls:
            self.block_efficiency.labels(method).observe(stats.tokens_per_call)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code for an error raised by validation, the handle or a replica."""
    # Serve re-raises a replica's exception as a RayTaskError that is also an instance of the
    # original class; its cause carries the original message.
    cause = getattr(exc, "cause", None) or exc
    text = str(cause)
    if isinstance(exc, _Abort):
        return exc.code, exc.message
    if isinstance(exc, ValueError):  # InvalidArgument, or the engine's own field checks
        return grpc.StatusCode.INVALID_ARGUMENT, text
    if isinstance(exc, Overloaded | BackPressureError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded, retry later: {text}"
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, text
    if isinstance(exc, ReplicaFailed | RequestLost | StoreUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, text
    return grpc.StatusCode.INTERNAL, f"{type(cause).__name__}: {text}"


@dataclass(frozen=True)
class _Undecodable:
    """A request payload that did not parse: the RPC answers INVALID_ARGUMENT with `message`
    (grpc itself would answer UNKNOWN)."""

    message: str


def _add_generator(servicer: GenerationService, server: grpc.aio.Server) -> None:
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


def _stats_message(stats: SpeculationStats) -> pb.SpeculationStats:
    fields = dict(vars(stats), step_ms=pb.StepBreakdown(**stats.step_ms))
    return pb.SpeculationStats(**fields)


@dataclass
class _Call:
    """One Generate/GenerateStream RPC, as its end (the done callback) needs to see it."""

    method: str
    start: float  # perf_counter seconds
    settled: bool = False  # counted in the metrics and out of the in-flight count
    stream: Any = None  # the replica's Serve stream, once sent
    finished: bool = False  # that stream ended: nothing to cancel
    prompt_tokens: int = 0
    unary: bool = False  # Generate: the client gets the chunks only at the end
    principal: str | None = None  # whose token the call carries ("" without auth)
    client: str = ""  # principal, or the peer's address
    session_id: str = ""  # the request's, or the one the server made for it
    sent: int = 0  # chunks the client has been sent
    first_token_s: float = 0.0


class GenerationService(pb_grpc.GeneratorServicer):
    """The Generator service of the wire contract (one per gateway), over the replicas."""

    def __init__(
        self,
        replicas,
        tokenizer,
        limits: Limits,
        info: dict,
        store: SessionStore,
        metrics: GatewayMetrics,
        max_in_flight: int,
        auth: BearerAuth | None = None,
        max_per_client: int | None = None,
    ):
        self.replicas = replicas  # DeploymentHandle of service.replica.Replica
        self.tokenizer, self.limits, self.info = tokenizer, limits, info
        self.store, self.metrics = store, metrics
        self.auth = auth or BearerAuth({})
        self.max_per_client = max_per_client
        self.per_client: collections.Counter[str] = collections.Counter()  # requests in flight
        self.max_in_flight = max_in_flight
        self.draining = False
        self.in_flight = 0

    # ----------------------------------------------------------------------------- RPCs
    async def Info(self, request, context) -> pb.InfoResponse:
        await _refuse_undecodable(request, context)
        i = self.info
        return pb.InfoResponse(
            draft_model=i["draft_model"],
            target_model=i["target_model"],
            vocab_size=i["vocab_size"],
            methods=[pb.MethodInfo(**m) for m in i["methods"]],
            limits=pb.Limits(
                max_new_tokens=i["max_new_tokens"],
                max_k=i["max_k"],
                max_gamma=i["max_gamma"],
                max_context=i["max_context"],
                max_batch=i["max_batch"],
                max_queued=i["max_queued"],
            ),
            default_method=i["default_method"],
            default_gamma=i["default_gamma"],
            tensor_parallel=i["tensor_parallel"],
            chat_template=_default_template(self.tokenizer.chat_template),
        )

    async def Generate(self, request, context) -> pb.GenerateResponse:
        await _refuse_undecodable(request, context)
        text, ids, last, call = [], [], None, self._call(request, unary=True)
        async for chunk in self._serve(request, context, call):
            text.append(chunk.text)
            ids += chunk.token_ids
            last = chunk
        return pb.GenerateResponse(
            text="".join(text),
            token_ids=ids,
            finish_reason=last.finish_reason,
            stats=last.stats,
            prompt_tokens=call.prompt_tokens,
            session_id=call.session_id,
            replica=last.replica,
        )

    async def GenerateStream(self, request, context) -> AsyncIterator[pb.GenerateChunk]:
        await _refuse_undecodable(request, context)
        async for chunk in self._serve(request, context, self._call(request)):
            yield chunk

    def open(
        self, request: pb.GenerateRequest, context, unary: bool = False
    ) -> tuple[_Call, AsyncIterator[pb.GenerateChunk]]:
        """One request through this path for another ingress (service/http_api.py): `context`
        offers what this class uses of a grpc.aio.ServicerContext, its abort() raises, and it
        calls the done callbacks when its exchange ends. The call's prompt_tokens and
        session_id are set once the first chunk has arrived."""
        call = self._call(request, unary=unary)
        return call, self._serve(request, context, call)

    # ----------------------------------------------------------------------------- core
    def _call(self, request, unary: bool = False) -> _Call:
        method = request.method or self.limits.default_method
        return _Call(method, time.perf_counter(), unary=unary)

    async def _serve(self, request, context, call: _Call) -> AsyncIterator[pb.GenerateChunk]:
        self.in_flight += 1
        self.metrics.in_flight.inc()
        call.principal = self.auth.principal(context.invocation_metadata())
        # A client: its principal, or without authentication its address.
        call.client = call.principal or context.peer().rsplit(":", 1)[0]
        self.per_client[call.client] += 1
        # A client cancel or deadline can end the RPC while grpc is writing a chunk, outside
        # this generator, which is then dropped without seeing an exception. So the RPC's own
        # end does the accounting and stops the replica's work (frees its KV slot).
        context.add_done_callback(lambda _: self._rpc_done(call))
        try:
            async for chunk in self._generate(request, context, call):
                yield chunk
            # Settled before grpc sends the status, so a client that has its answer also sees
            # it counted.
            self._settle(call, grpc.StatusCode.OK)
        except Exception as exc:
            call.finished = True  # a failed stream (e.g. back-pressure) has nothing to cancel
            code, message = _status_of(exc)
            self._settle(call, code)
            await context.abort(code, message)

    def _rpc_done(self, call: _Call) -> None:
        try:
            if call.stream is not None and not call.finished:
                call.stream.cancel()
        except Exception:  # cancel() re-raises a failed assignment's error: nothing to stop
            pass
        finally:
            self._settle(call, grpc.StatusCode.CANCELLED)  # ended before completing or failing

    def _settle(self, call: _Call, code: grpc.StatusCode) -> None:
        """Request accounting, once per RPC."""
        if call.settled:
            return
        call.settled = True
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        self.per_client[call.client] -= 1
        if not self.per_client[call.client]:
            del self.per_client[call.client]
        self.metrics.requests.labels(call.method, code.name).inc()
        if code == grpc.StatusCode.OK:
            self.metrics.latency.labels(call.method).observe(time.perf_counter() - call.start)

    async def _job(self, request, context, call: _Call) -> tuple[GenerateJob, Session | None]:
        """The replica's job for `request`, checked, after its session's history (if any; the
        session's key, under the caller's principal, is the job's session_id)."""
        check_sizes(request, self.limits)
        ids = prompt_ids(request, self.tokenizer)  # before any await on the store
        if call.principal is None:  # the interceptor lets no such call through
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing")
        if request.new_session and request.session_id:
            raise InvalidArgument("new_session: set it or session_id, not both")
        call.session_id = secrets.token_hex(16) if request.new_session else request.session_id
        # Another client's session id names another session.
        key = f"{call.principal}/{call.session_id}" if call.principal else call.session_id
        session = await self.store.get(key) if key else None
        history = session.tokens if session else []
        job = check_request(request, self.limits, ids, len(history))
        job.prompt_ids = history + ids
        job.session_id = key or None
        call.prompt_tokens = len(job.prompt_ids)
        eos = self.tokenizer.eos_token_id
        if eos is not None and not request.ignore_eos:
            job.stop_token_ids.append(eos)
        remaining = context.time_remaining()
        job.deadline = time.time() + remaining if remaining is not None else None
        if job.seed is None:  # drawn here, so that a retry on another replica redraws the same
            job.seed = secrets.randbits(63)
        return job, session

    async def _generate(self, request, context, call: _Call) -> AsyncIterator[pb.GenerateChunk]:
        if self.draining:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry elsewhere")
        # Checked before the first await, so a burst cannot overshoot it (Serve's handle queue
        # limit can: it counts a request as queued only after it has checked the limit).
        if self.in_flight > self.max_in_flight:
            raise Overloaded(f"the gateway holds {self.max_in_flight} requests")
        most = self.max_per_client
        if most and self.per_client[call.client] > most:
            raise Overloaded(f"client {call.client!r} holds {most} requests (its limit)")
        job, session = await self._job(request, context, call)
        for attempt in (1, 2):
            text = TextStream(self.tokenizer, list(request.stop))
            output: list[int] = []
            held: list[pb.GenerateChunk] = []
            routing = job.session_id or ""  # its replica keeps the session's KV cache
            handle = self.replicas.options(stream=True, multiplexed_model_id=routing)
            stream = call.stream = handle.generate.remote(job)
            final: FinishedEvent | None = None
            try:
                async for event in stream:  # TokensEvent..., FinishedEvent
                    if isinstance(event, FinishedEvent):
                        final = event
                        continue
                    delta, new_ids = text.feed(event.token_ids)
                    output += new_ids
                    if not call.first_token_s:
                        call.first_token_s = time.perf_counter() - call.start
                        self.metrics.first_token.labels(call.method).observe(call.first_token_s)
                    chunk = pb.GenerateChunk(text=delta, token_ids=new_ids)
                    if text.stopped:
                        stream.cancel()  # the replica frees the request's KV slot
                        held.append(chunk)
                        final = FinishedEvent("stop", stats=None, replica="")
                        break
                    if not (delta or new_ids):
                        continue
                    if call.unary:  # the client gets it only at the end: a retry is safe
                        held.append(chunk)
                    else:
                        call.sent += 1
                        yield chunk
                break
            except ray.exceptions.RayActorError as exc:  # the replica's process died
                if call.sent or attempt == 2:
                    raise ReplicaFailed(
                        f"the replica serving this request died after {call.sent} chunks were "
                        "sent; retry the request"
                    ) from exc
        for chunk in held:
            yield chunk
        call.finished = True
        if final is None:
            raise RuntimeError("the replica's stream ended without a finish event")
        if final.stats is not None:
            self.metrics.finished(call.method, final.stats, len(output))
        if job.session_id:
            await self._save_session(session, job, output, final)
        yield pb.GenerateChunk(
            text=text.flush(),
            finish_reason=FINISH[final.finish_reason],
            stats=_stats_message(final.stats) if final.stats else None,
            replica=final.replica,
            session_id=call.session_id,
        )

    async def _save_session(
        self,
        old: Session | None,
        job: GenerateJob,
        output: list[int],
        final: FinishedEvent,
    ) -> None:
        now = time.time()
        tokens = job.prompt_ids + output
        await self.store.put(
            Session(
                session_id=job.session_id,
                tokens=tokens,
                settings=dict(
                    method=job.method, k=job.k, gamma=job.gamma, temperature=job.temperature
                ),
                replica=final.replica or None,
                kv_length=len(tokens) - 1 if final.replica else 0,
                created=old.created if old else now,
                updated=now,
                turns=(old.turns if old else 0) + 1,
            )
        )


def _default_template(template: str | dict | None) -> str:
    """A tokenizer's chat template: one Jinja string, or named ones (the one named default)."""
    if isinstance(template, dict):
        return template.get("default", "")
    return template or ""


class GatewayServer:
    """The gRPC server with health and reflection, and the Prometheus endpoint."""

    def __init__(self, settings: Settings, replicas, info: dict):
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
        self.servicer = GenerationService(
            replicas,
            tokenizer,
            Limits.from_info(info),
            info,
            self.store,
            self.metrics,
            max_in_flight,
            auth,
            settings.max_in_flight_per_client,
        )
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(interceptors=[auth])
        _add_generator(self.servicer, self.server)
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
        self.servicer.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.servicer.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        with contextlib.suppress(Exception):
            await self.store.close()
        if self.metrics_port:
            self._metrics_server.shutdown()
