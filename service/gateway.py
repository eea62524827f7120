"""The gRPC gateway: the public API (protos/blockspec.proto) in front of the replica deployment.

Why our own `grpc.aio` server instead of Serve's gRPC proxy: the proxy rewrites application
status codes to INTERNAL (ray-project/ray#58851) and add a hop per unary call; the
contract below needs exact codes. The gateway reaches replicas through a Serve
`DeploymentHandle`, so Serve's routing and autoscaling (on ongoing requests) stay in charge.

Per request: parse it into the validator's input (service/requests.py), tokenize and check it
(INVALID_ARGUMENT, naming the field), build it after the session's history, stream the
replica's tokens back as text (stop strings cut by service/detokenizer.py), record metrics,
save the session. Codes: RESOURCE_EXHAUSTED when the replicas' queues are full (the gateway holds
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
from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.auth import BearerAuth, server_credentials, warn_if_exposed
from blockspec.service.config import Settings
from blockspec.service.coordinator import DeadlineExceeded, Overloaded, ReplicaFailed, RequestLost
from blockspec.service.detokenizer import TextStream
from blockspec.service.policy import AUTO
from blockspec.service.ports import GRPC_EXCLUSIVE
from blockspec.service.requests import (
    CHARS_PER_POSITION,
    CHAT_ROLES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    ChatTurn,
    FinishedEvent,
    GenerationRequest,
    InvalidArgument,
    ReplicaInfo,
    RequestParams,
    RequestValidator,
)
from blockspec.service.results import RequestStats, StepTimes
from blockspec.service.sessions import Session, SessionStore, StoreUnavailableError, open_store
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from ray.serve.exceptions import BackPressureError
from transformers import AutoTokenizer

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
        # Every answer of the HTTP API, refusals before the request path (unparsable bodies,
        # unknown fields, models or routes, tokens) included: by route template and status.
        self.http = Counter(
            "blockspec_http_requests",
            "HTTP API answers by route and status",
            ("route", "status"),
            registry=registry,
        )

    def finished(self, method: str, stats: RequestStats, tokens: int) -> None:
        self.output_tokens.labels(method).inc(tokens)
        self.target_calls.labels(method).inc(stats.target_calls)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted.labels(method, str(position)).inc(count)
        if stats.target_calls:
            self.block_efficiency.labels(method).observe(stats.tokens_per_call)


class Refusal(Exception):
    """How a request ends when it does not end OK: its gRPC code and message, and for
    INVALID_ARGUMENT the request field at fault and the kind of fault (the HTTP API's OpenAI
    ``param`` and ``code``)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str | None = None,
        reason: str | None = None,
    ):
        super().__init__(code, message, field, reason)
        self.code, self.message, self.field, self.reason = code, message, field, reason

    @property
    def details(self) -> str:
        """The gRPC status details: the field first, when there is one."""
        return f"{self.field}: {self.message}" if self.field else self.message


def refusal_of(exc: BaseException) -> Refusal:
    """The refusal for an error raised by validation, the handle or a replica."""
    # Serve re-raises a replica's exception as a RayTaskError that is also an instance of the
    # original class; its cause carries the original message.
    cause = getattr(exc, "cause", None) or exc
    text = str(cause)
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, InvalidArgument):
        return Refusal(grpc.StatusCode.INVALID_ARGUMENT, cause.message, cause.field, cause.code)
    if isinstance(exc, Overloaded | BackPressureError):
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded, retry later: {text}")
    if isinstance(exc, DeadlineExceeded):
        return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, text)
    if isinstance(exc, ReplicaFailed | RequestLost | StoreUnavailableError):
        return Refusal(grpc.StatusCode.UNAVAILABLE, text)
    return Refusal(grpc.StatusCode.INTERNAL, f"{type(cause).__name__}: {text}")


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


def speculation_stats(
    stats: RequestStats, cached_tokens: int, request: GenerationRequest
) -> pb.SpeculationStats:
    """A finished request's stats, from the engine's own to the wire's, with the configuration
    it ran (the validator's, defaults filled in; auto's K and γ are its steps')."""
    calls = max(stats.target_calls, 1)
    step_ms = {name: 1e3 * getattr(stats.steps, name) / calls for name in StepTimes.PHASES}
    return pb.SpeculationStats(
        target_calls=stats.target_calls,
        accepted_tokens=stats.accepted,
        tokens_per_call=stats.tokens_per_call,
        accepted_per_position=stats.accepted_per_position,
        cached_prompt_tokens=cached_tokens,
        mean_batch_size=stats.mean_batch_size,
        step_ms=pb.StepBreakdown(**step_ms),
        steps_by_config=dict(stats.steps_by_config),
        method=request.method,
        k=0 if request.method == AUTO else request.k,
        gamma=0 if request.method == AUTO else request.gamma,
    )


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
    turns: tuple[ChatTurn, ...] = ()  # a chat session's turns, this request's included
    reply: str = ""  # the text generated so far


class GenerationService(pb_grpc.GeneratorServicer):
    """The Generator service of the wire contract (one per gateway), over the replicas."""

    def __init__(
        self,
        replicas,
        tokenizer,
        info: ReplicaInfo,
        store: SessionStore,
        metrics: GatewayMetrics,
        max_in_flight: int,
        auth: BearerAuth | None = None,
        max_per_client: int | None = None,
    ):
        self.replicas = replicas  # DeploymentHandle of service.replica.Replica
        self.tokenizer, self.info = tokenizer, info
        self.validator = RequestValidator(info.limits(), tokenizer)
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
            draft_model=i.draft_model,
            target_model=i.target_model,
            vocab_size=i.vocab_size,
            methods=[pb.MethodInfo(**vars(m)) for m in i.methods],
            limits=pb.Limits(
                max_new_tokens=i.max_new_tokens,
                max_k=i.max_k,
                max_gamma=i.max_gamma,
                max_context=i.max_context,
                max_batch=i.max_batch,
                max_queued=i.max_queued,
                max_temperature=MAX_TEMPERATURE,
                max_stop_strings=MAX_STOP_STRINGS,
                max_stop_chars=MAX_STOP_CHARS,
                max_stop_token_ids=MAX_STOP_TOKEN_IDS,
                max_prompt_chars=CHARS_PER_POSITION * i.max_context,
            ),
            default_method=i.default_method,
            default_gamma=i.default_gamma,
            tensor_parallel=i.tensor_parallel,
            chat_template=_default_template(self.tokenizer.chat_template),
            default_max_new_tokens=i.default_max_new_tokens,
            chat_roles=CHAT_ROLES,
        )

    async def Generate(self, request, context) -> pb.GenerateResponse:
        await _refuse_undecodable(request, context)
        params = request_params(request)
        text, ids, last, call = [], [], None, self._call(params, unary=True)
        try:
            async for chunk in self._serve(params, context, call):
                text.append(chunk.text)
                ids += chunk.token_ids
                last = chunk
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.details)
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
        params = request_params(request)
        try:
            async for chunk in self._serve(params, context, self._call(params)):
                yield chunk
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.details)

    def open(
        self, params: RequestParams, context, unary: bool = False
    ) -> tuple[_Call, AsyncIterator[pb.GenerateChunk]]:
        """One request through this path for another ingress (service/http_api.py), which
        parsed it into `params`: `context` offers what this class uses of a
        grpc.aio.ServicerContext and calls the done callbacks when its exchange ends. The chunks
        end in a `Refusal` when the request does not end OK. The call's prompt_tokens and
        session_id are set once the first chunk has arrived."""
        call = self._call(params, unary=unary)
        return call, self._serve(params, context, call)

    # ----------------------------------------------------------------------------- core
    def _call(self, params: RequestParams, unary: bool = False) -> _Call:
        method = params.method or self.info.default_method
        return _Call(method, time.perf_counter(), unary=unary)

    async def _serve(
        self, params: RequestParams, context, call: _Call
    ) -> AsyncIterator[pb.GenerateChunk]:
        """The chunks of one request, with its accounting; raises a Refusal when it fails."""
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
            async for chunk in self._generate(params, context, call):
                yield chunk
            # Settled before grpc sends the status, so a client that has its answer also sees
            # it counted.
            self._settle(call, grpc.StatusCode.OK)
        except Exception as exc:
            call.finished = True  # a failed stream (e.g. back-pressure) has nothing to cancel
            refusal = refusal_of(exc)
            self._settle(call, refusal.code)
            raise refusal from exc

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

    async def _request(
        self, params: RequestParams, context, call: _Call
    ) -> tuple[GenerationRequest, Session | None]:
        """The replica's request for `params`, checked, after its session's history (if any;
        the session's key, under the caller's principal, is the request's session_id)."""
        ids = self.validator.prompt_ids(params)  # before any await on the store
        if call.principal is None:  # the interceptor lets no such call through
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing")
        call.session_id = secrets.token_hex(16) if params.new_session else params.session_id
        # Another client's session id names another session.
        key = f"{call.principal}/{call.session_id}" if call.principal else call.session_id
        session = await self.store.get(key) if key else None
        history = session.tokens if session else ()
        call.turns = params.messages if key else ()
        if params.messages and session is not None and session.messages is not None:
            # A chat session's next turn: the template renders the whole conversation, and
            # the replica's parked KV covers what it shares with the last prompt and reply.
            stored = [ChatTurn(**turn) for turn in session.messages]
            call.turns, ids = self.validator.continue_conversation(
                stored, params.messages, session.tokens
            )
            history = ()
        remaining = context.time_remaining()
        request = self.validator.request(
            params,
            ids,
            history=history,
            session_key=key or None,
            cache_scope=call.principal,  # one principal's prefixes never serve another's
            deadline=time.time() + remaining if remaining is not None else None,
            # drawn here, so that a retry on another replica redraws the same
            drawn_seed=secrets.randbits(63),
        )
        call.prompt_tokens = len(request.prompt_ids)
        return request, session

    async def _generate(
        self, params: RequestParams, context, call: _Call
    ) -> AsyncIterator[pb.GenerateChunk]:
        if self.draining:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "server is draining; retry elsewhere")
        # Checked before the first await, so a burst cannot overshoot it (Serve's handle queue
        # limit can: it counts a request as queued only after it has checked the limit).
        if self.in_flight > self.max_in_flight:
            raise Overloaded(f"the gateway holds {self.max_in_flight} requests")
        most = self.max_per_client
        if most and self.per_client[call.client] > most:
            raise Overloaded(f"client {call.client!r} holds {most} requests (its limit)")
        request, session = await self._request(params, context, call)
        for attempt in (1, 2):
            text = TextStream(self.tokenizer, list(request.stop))
            output: list[int] = []
            call.reply = ""
            held: list[pb.GenerateChunk] = []
            routing = request.session_id or ""  # its replica keeps the session's KV cache
            handle = self.replicas.options(stream=True, multiplexed_model_id=routing)
            stream = call.stream = handle.generate.remote(request)
            final: FinishedEvent | None = None
            try:
                async for event in stream:  # TokensEvent..., FinishedEvent
                    if isinstance(event, FinishedEvent):
                        final = event
                        continue
                    delta, new_ids = text.feed(event.token_ids)
                    output += new_ids
                    call.reply += delta
                    if not call.first_token_s:
                        call.first_token_s = time.perf_counter() - call.start
                        self.metrics.first_token.labels(call.method).observe(call.first_token_s)
                    chunk = pb.GenerateChunk(text=delta, token_ids=new_ids)
                    if text.stopped:
                        stream.cancel()  # the replica parks the request's KV (engine.cancel)
                        held.append(chunk)
                        # What ran up to here: the stats of the step that found the stop.
                        final = FinishedEvent(
                            "stop", event.stats, event.cached_tokens, event.replica
                        )
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
        self.metrics.finished(call.method, final.stats, len(output))
        tail = text.flush()
        call.reply += tail
        if request.session_id:
            await self._save_session(session, request, output, final, call)
        stats = speculation_stats(final.stats, final.cached_tokens, request)
        yield pb.GenerateChunk(
            text=tail,
            finish_reason=FINISH[final.finish_reason],
            stats=stats,
            replica=final.replica,
            session_id=call.session_id,
        )

    async def _save_session(
        self,
        old: Session | None,
        request: GenerationRequest,
        output: list[int],
        final: FinishedEvent,
        call: _Call,
    ) -> None:
        now = time.time()
        tokens = [*request.prompt_ids, *output]
        reply = {"role": "assistant", "content": call.reply}
        turns = [{"role": t.role, "content": t.content} for t in call.turns]
        temperature = request.sampling.temperature
        await self.store.put(
            Session(
                session_id=request.session_id,
                tokens=tokens,
                messages=[*turns, reply] if call.turns else None,
                settings=dict(
                    method=request.method, k=request.k, gamma=request.gamma, temperature=temperature
                ),
                replica=final.replica or None,
                kv_length=len(tokens) - 1,
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
        self.servicer = GenerationService(
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
