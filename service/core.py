"""The application core: one request from its validated parameters to typed events, for
every protocol. It knows no transport: the gRPC servicer (service/gateway.py) and the OpenAI
HTTP API (service/http_api.py) are adapters that map their wire format, credentials and
deadline onto a `Caller` and the events and `Refusal`s back onto theirs.

Per request: tokenize and check it (INVALID_ARGUMENT, naming the field), build it after its
session's history, stream the replica's tokens back as text (stop strings cut by
service/detokenizer.py), retry once on another replica when one dies before anything was
sent, record metrics, save the session. It ends in a `Refusal` when it does not end OK:
RESOURCE_EXHAUSTED when the replicas' queues are full (the core holds at most max_replicas + 1
replicas' worth of requests) or a client holds its limit, DEADLINE_EXCEEDED at the caller's
deadline, UNAVAILABLE while draining or when a replica failed. Status codes are gRPC's
(grpc.StatusCode): the one vocabulary both adapters map from.
"""

from __future__ import annotations

import collections
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import ray
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from ray.serve.exceptions import BackPressureError

from blockspec.service.auth import BearerAuth
from blockspec.service.coordinator import DeadlineExceeded, Overloaded, ReplicaFailed, RequestLost
from blockspec.service.detokenizer import TextStream
from blockspec.service.policy import AUTO
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
from blockspec.service.sessions import Session, SessionStore, StoreUnavailableError


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
class Caller:
    """Who sends a request and until when, as each adapter reads it off its wire."""

    credentials: Sequence[tuple[str, str]]  # ("authorization", "Bearer ...") when sent
    peer: str  # the client's address, "ipv4:HOST:PORT" (grpc's peer format)
    deadline: float | None = None  # time.monotonic() seconds; None: none

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)


@dataclass(frozen=True)
class Text:
    """New output: its text (what the stop strings left of it) and its token ids."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Summary:
    """A finished request's speculation stats, named as the wire contract's SpeculationStats."""

    target_calls: int
    accepted_tokens: int
    tokens_per_call: float
    accepted_per_position: list[int]
    cached_prompt_tokens: int
    mean_batch_size: float
    step_ms: dict[str, float]  # per target call, by phase (StepTimes.PHASES)
    steps_by_config: dict[str, int]
    method: str
    k: int
    gamma: int


@dataclass(frozen=True)
class Finished:
    """The last event: the text the detokenizer held back, why it ended and its stats."""

    text: str
    finish_reason: str  # "length" or "stop"
    stats: Summary
    replica: str
    session_id: str


def summary(stats: RequestStats, cached_tokens: int, request: GenerationRequest) -> Summary:
    """A finished request's stats, with the configuration it ran (the validator's, defaults
    filled in; auto's K and γ are its steps')."""
    calls = max(stats.target_calls, 1)
    return Summary(
        target_calls=stats.target_calls,
        accepted_tokens=stats.accepted,
        tokens_per_call=stats.tokens_per_call,
        accepted_per_position=list(stats.accepted_per_position),
        cached_prompt_tokens=cached_tokens,
        mean_batch_size=stats.mean_batch_size,
        step_ms={name: 1e3 * getattr(stats.steps, name) / calls for name in StepTimes.PHASES},
        steps_by_config=dict(stats.steps_by_config),
        method=request.method,
        k=0 if request.method == AUTO else request.k,
        gamma=0 if request.method == AUTO else request.gamma,
    )


@dataclass
class Call:
    """One request as the core tracks it: its accounting, its replica stream, its session."""

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


class Generation:
    """One request opened on the core: its events, and its end, which the adapter calls when
    its exchange ends however it ends (answered, failed, the client gone or out of time): a
    replica still working on it is told to stop (its KV slot freed) and it is counted."""

    def __init__(self, core: GenerationCore, params: RequestParams, caller: Caller, call: Call):
        self.call, self._core, self._params, self._caller = call, core, params, caller

    def events(self) -> AsyncIterator[Text | Finished]:
        """Text events, then one Finished; raises a Refusal when the request does not end OK."""
        return self._core._serve(self._params, self._caller, self.call)

    def end(self) -> None:
        self._core._end(self.call)


class GenerationCore:
    """The requests of one gateway, over the replicas (a Serve DeploymentHandle)."""

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

    def open(self, params: RequestParams, caller: Caller, unary: bool = False) -> Generation:
        """Take a request (counted in flight from here until `Generation.end`). unary: the
        client gets the output only at its end, so a replica's death before the end is retried
        on another replica even after output."""
        method = params.method or self.info.default_method
        call = Call(method, time.perf_counter(), unary=unary)
        call.principal = self.auth.principal(caller.credentials)
        # A client: its principal, or without authentication its address.
        call.client = call.principal or caller.peer.rsplit(":", 1)[0]
        self.in_flight += 1
        self.metrics.in_flight.inc()
        self.per_client[call.client] += 1
        return Generation(self, params, caller, call)

    def facts(self) -> dict[str, Any]:
        """What the deployment serves and its limits, named as the wire contract's InfoResponse."""
        i = self.info
        return dict(
            draft_model=i.draft_model,
            target_model=i.target_model,
            vocab_size=i.vocab_size,
            methods=[dict(vars(m)) for m in i.methods],
            limits=dict(
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
            chat_roles=list(CHAT_ROLES),
        )

    async def _serve(
        self, params: RequestParams, caller: Caller, call: Call
    ) -> AsyncIterator[Text | Finished]:
        """The events of one request, settled OK at their end; raises a Refusal when it fails."""
        try:
            async for event in self._generate(params, caller, call):
                yield event
            # Settled before the adapter sends the end, so a client that has its answer also
            # sees it counted.
            self._settle(call, grpc.StatusCode.OK)
        except Exception as exc:
            call.finished = True  # a failed stream (e.g. back-pressure) has nothing to cancel
            refusal = refusal_of(exc)
            self._settle(call, refusal.code)
            raise refusal from exc

    def _end(self, call: Call) -> None:
        # A client cancel or deadline can end an exchange while its adapter writes an event,
        # outside the events' generator, which is then dropped without seeing an exception:
        # so the exchange's end stops the replica's work (frees its KV slot) and settles.
        try:
            if call.stream is not None and not call.finished:
                call.stream.cancel()
        except Exception:  # cancel() re-raises a failed assignment's error: nothing to stop
            pass
        finally:
            self._settle(call, grpc.StatusCode.CANCELLED)  # ended before completing or failing

    def _settle(self, call: Call, code: grpc.StatusCode) -> None:
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
        self, params: RequestParams, caller: Caller, call: Call
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
        remaining = caller.time_remaining()
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
        self, params: RequestParams, caller: Caller, call: Call
    ) -> AsyncIterator[Text | Finished]:
        if self.draining:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "server is draining; retry elsewhere")
        # Checked before the first await, so a burst cannot overshoot it (Serve's handle queue
        # limit can: it counts a request as queued only after it has checked the limit).
        if self.in_flight > self.max_in_flight:
            raise Overloaded(f"the gateway holds {self.max_in_flight} requests")
        most = self.max_per_client
        if most and self.per_client[call.client] > most:
            raise Overloaded(f"client {call.client!r} holds {most} requests (its limit)")
        request, session = await self._request(params, caller, call)
        if call.unary and not request.stop:  # no stop string to cut at: the tokens can wait
            request = replace(request, read_at_end=True)
        for attempt in (1, 2):
            text = TextStream(self.tokenizer, list(request.stop))
            output: list[int] = []
            call.reply = ""
            held: list[Text] = []
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
                    chunk = Text(delta, new_ids)
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
        stats = summary(final.stats, final.cached_tokens, request)
        yield Finished(tail, final.finish_reason, stats, final.replica, call.session_id)

    async def _save_session(
        self,
        old: Session | None,
        request: GenerationRequest,
        output: list[int],
        final: FinishedEvent,
        call: Call,
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
