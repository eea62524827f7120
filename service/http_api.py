"""The OpenAI-compatible HTTP API, served by Ray Serve's HTTP proxy beside the gRPC API.

    POST /v1/chat/completions   messages through the target model's chat template
    POST /v1/completions        a prompt (text, or token ids)
    GET  /v1/models             the one model this deployment serves
    GET  /v1/models/{id}        that model (404 model_not_found for any other id)
    GET  /v1/blockspec/info     the gRPC Info: models, vocabulary, methods, limits, defaults

Both POSTs stream as server-sent events with ``"stream": true`` (ending in ``data: [DONE]``)
and report ``usage``. A request body is parsed into the validator's input
(:class:`service.requests.RequestParams`), its credentials and deadline into a
:class:`service.core.Caller`, and runs on the application core (service/core.py) that the
gRPC API runs on too: the same checks, limits, authentication, sessions, metrics and replicas,
one copy of each. Its refusals' status codes become HTTP statuses in OpenAI's error schema
(:data:`HTTP_STATUS`), the field at fault its ``param``.

OpenAI fields: ``model``, ``messages`` / ``prompt``, ``max_tokens`` (or
``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
``stream_options.include_usage``, ``n`` = 1, ``user`` (ignored). Fields this service cannot
honour (``n`` > 1, ``logprobs``, penalties, tools, ...) are refused by name, never ignored;
so is a field OpenAI does not have either ("Unrecognized request argument supplied: ...", as
OpenAI answers). blockspec's own knobs ride along as extra body fields (:data:`EXTENSIONS`);
the speculation stats come back under a ``blockspec`` key.

As strict as OpenAI's API, in OpenAI's error schema: types and unknown fields are this module's
to refuse (the parser's job), every bound is the validator's (service/requests.py, one place for
both wires), unknown routes and methods answer OpenAI's 404 / 405 bodies, and every answer is
counted by route and status (``blockspec_http_requests_total``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from blockspec.service.core import Caller, Finished, Generation, GenerationCore, Refusal, Text
from blockspec.service.requests import ChatTurn, RequestParams

# The gateway's status codes as HTTP statuses and OpenAI error types.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# Wire fields that OpenAI names otherwise: error messages name the field the client sent.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}
# OpenAI fields with no meaning here, per endpoint: accepted only at their default (value, or
# empty), else refused by name. Any other field OpenAI does not have is refused as unknown.
UNSUPPORTED: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "logprobs": None,
}
CHAT_UNSUPPORTED: dict[str, Any] = {
    **UNSUPPORTED,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": "none",
    "parallel_tool_calls": None,
    "functions": None,
    "function_call": "none",
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "store": False,
    "metadata": None,
    "service_tier": "auto",
    "reasoning_effort": None,
    "web_search_options": None,
}
COMPLETION_UNSUPPORTED: dict[str, Any] = {
    **UNSUPPORTED,
    "best_of": 1,
    "echo": False,
    "suffix": None,
}
# blockspec's own body fields (protos/blockspec.proto), accepted beside OpenAI's.
EXTENSIONS = (
    "method",
    "k",
    "gamma",
    "top_k",
    "session_id",
    "new_session",
    "ignore_eos",
    "stop_token_ids",
)

http_app = FastAPI(title="blockspec", docs_url=None, redoc_url=None, openapi_url=None)


class ApiError(Exception):
    """An HTTP error in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.param, self.code = param, code

    @staticmethod
    def from_refusal(refusal: Refusal, chat: bool = False) -> ApiError:
        """The gateway's refusal, its field (if any) under the name the client sent."""
        status, kind = HTTP_STATUS.get(refusal.code, (500, "server_error"))
        if refusal.field is None:
            return ApiError(status, kind, refusal.message)
        names = dict(OPENAI_NAMES, prompt="messages") if chat else OPENAI_NAMES
        param = names.get(refusal.field, refusal.field)
        return ApiError(status, kind, f"{param}: {refusal.message}", param, refusal.reason)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    text = f"{param}: {message}" if param else message
    return ApiError(400, "invalid_request_error", text, param, code)


def model_not_found(model: str) -> ApiError:
    """OpenAI's answer for a model it does not serve (404, ``model_not_found``)."""
    message = f"The model `{model}` does not exist or you do not have access to it."
    return ApiError(404, "invalid_request_error", message, None, "model_not_found")


def _param(loc: tuple) -> str:
    """A pydantic error location as OpenAI writes a param: messages[0].content."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "body"


def _client_loc(loc: tuple) -> tuple:
    """A pydantic error location without the union members' type tags (str, list[int], ...),
    which are no names the client sent."""
    tags = ("str", "int", "float", "bool", "none")
    return tuple(p for p in loc if not (isinstance(p, str) and (p in tags or "[" in p)))


def parse_error(err: ValidationError) -> ApiError:
    """A body's first type error, as OpenAI words it (missing, wrong type, wrong value)."""
    errors = [dict(e, loc=_client_loc(e["loc"])) for e in err.errors()]
    # A union (str | list[...]) fails once per member: the deepest failure is the telling one.
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]),
                key=lambda e: len(e["loc"]))  # fmt: skip
    param = _param(first["loc"])
    if first["type"] == "missing":
        return invalid(param, "missing required parameter", "missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return invalid(param, "unknown parameter", "unknown_parameter")
    if first["type"].endswith(("_type", "_parsing")):
        return invalid(param, f"invalid type: {first['msg']}", "invalid_type")
    return invalid(param, first["msg"])


class _Strict(BaseModel):
    """Strict types (no "5" for 5, no true for 1), no field beyond the declared ones."""

    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str  # the validator checks it (service/requests.py CHAT_ROLES)
    # Required, as OpenAI's: null is for an assistant turn with tool calls, which this API
    # does not take.
    content: str | list[TextPart]
    name: str | None = None  # OpenAI's participant name: accepted, not rendered
    tool_call_id: str | None = None  # a tool message's: accepted, not rendered

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(BaseModel):
    """Fields both endpoints share. Only types and names are checked here: the bounds are the
    validator's (service/requests.py). Extra fields are kept to be judged by name: OpenAI's
    that this service cannot honour (:attr:`unsupported`) are refused unless at their default,
    any other is unknown and refused."""

    model_config = ConfigDict(strict=True, extra="allow")
    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # blockspec's knobs (see protos/blockspec.proto)
    method: str | None = None
    k: int | None = None
    gamma: int | None = None
    top_k: int | None = None
    session_id: str | None = None
    new_session: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in self.unsupported:
                raise invalid(None, f"Unrecognized request argument supplied: {name}", None)
            if value is None or value is False or value == [] or value == self.unsupported[name]:
                continue
            raise invalid(name, f"{value!r} is not supported by this service", "unsupported_value")
        if self.n < 1:
            raise invalid("n", f"{self.n} must be >= 1", "integer_below_min_value")
        if self.n != 1:
            message = "only n = 1 is supported (one completion per request)"
            raise invalid("n", message, "unsupported_value")

    def params(self, **prompt) -> RequestParams:
        """The validator's input: this body's fields under the wire contract's names."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return RequestParams(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            method=self.method,
            k=self.k,
            gamma=self.gamma,
            top_k=self.top_k,
            session_id=self.session_id or "",
            new_session=self.new_session,
            ignore_eos=self.ignore_eos,
            stop=stops,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            **prompt,
        )


class ChatBody(_Body):
    unsupported: ClassVar[dict[str, Any]] = CHAT_UNSUPPORTED
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def request(self) -> RequestParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self.params(messages=tuple(ChatTurn(m.role, m.text()) for m in self.messages))


class CompletionBody(_Body):
    unsupported: ClassVar[dict[str, Any]] = COMPLETION_UNSUPPORTED
    prompt: str | list[str] | list[int]

    def request(self) -> RequestParams:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise invalid("prompt", "one prompt per request (a list of one string)")
            prompt = prompt[0]
        if isinstance(prompt, list):
            return self.params(prompt_token_ids=tuple(prompt))
        return self.params(prompt=prompt)


# A whole request's deadline, seconds from its arrival: this API's own header, and for a request
# answered in one piece the read timeout that OpenAI's SDKs send (no byte of the answer comes
# before its end, so the client gives up after that long). A stream's read timeout bounds the
# gaps between its chunks, not the whole: it sets no deadline.
TIMEOUT_HEADER = "x-request-timeout"
SDK_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"


def request_timeout(request: Request, stream: bool) -> float | None:
    """The request's deadline in seconds from now (None: none); a bad value is refused."""
    names = (TIMEOUT_HEADER,) if stream else (TIMEOUT_HEADER, SDK_READ_TIMEOUT_HEADER)
    for name in names:
        text = request.headers.get(name)
        if text is None:
            continue
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            message = f"header {name}: must be a positive number of seconds, got {text!r}"
            raise invalid(None, message, "invalid_header")
        return seconds
    return None


def caller_of(request: Request, timeout: float | None = None) -> Caller:
    """The core's caller: the request's credentials (its Authorization header), its client's
    address and its deadline (`request_timeout`)."""
    header = request.headers.get("authorization")
    credentials = (("authorization", header),) if header is not None else ()
    client = request.client
    peer = f"ipv4:{client.host}:{client.port}" if client else "unknown:0"
    return Caller(credentials, peer, None if timeout is None else time.monotonic() + timeout)


def _stats(event: Finished) -> dict:
    """The `blockspec` key of an answer: the request's stats, its replica and session."""
    stats = dataclasses.asdict(event.stats)
    return dict(stats, replica=event.replica, session_id=event.session_id or None)


class OpenAIFrontend:
    """The endpoints over a gateway's application core (service/core.py)."""

    def __init__(self, core: GenerationCore, model_id: str):
        global _metrics
        self.core, self.model_id = core, model_id
        self.created = int(time.time())
        # Counted by this process's HTTP app (CountAnswers), in the gateway's registry.
        _metrics = getattr(core, "metrics", None)

    def model_object(self) -> dict:
        return dict(id=self.model_id, object="model", created=self.created, owned_by="blockspec")

    def models(self) -> dict:
        return dict(object="list", data=[self.model_object()])

    def authorize(self, request: Request) -> None:
        """The gateway's token check (no token 401, an unknown one 403)."""
        refused = self.core.auth.refusal(caller_of(request).credentials)
        if refused is not None:
            code, message = refused
            status, kind = HTTP_STATUS[code]
            raise ApiError(status, kind, message)

    def list_models(self, request: Request):
        """GET /v1/models: the one model served (authorized as every call)."""
        try:
            self.authorize(request)
        except ApiError as err:
            return err.response()
        return self.models()

    def get_model(self, request: Request, model_id: str):
        """GET /v1/models/{id}: OpenAI's model object, or 404 model_not_found."""
        try:
            self.authorize(request)
            if model_id != self.model_id:
                raise model_not_found(model_id)
        except ApiError as err:
            return err.response()
        return self.model_object()

    async def info(self, request: Request):
        """GET /v1/blockspec/info: what gRPC's Info says (the core's facts), field for field,
        with the model id this API serves it under and the body fields it takes beside
        OpenAI's."""
        try:
            self.authorize(request)
        except ApiError as err:
            return err.response()
        facts = self.core.facts()
        return dict(facts, model=self.model_id, extra_body_fields=list(EXTENSIONS))

    async def complete(self, request: Request, chat: bool):
        try:
            self.authorize(request)
            body, params = await self._parse(request, ChatBody if chat else CompletionBody)
            timeout = request_timeout(request, body.stream)
        except ApiError as err:
            return err.response()
        generation = self.core.open(params, caller_of(request, timeout), unary=not body.stream)
        answer = _Answer(self.model_id, chat, generation.call)
        chunks = generation.events()
        streaming = False  # once the event stream owns the exchange, it ends it
        try:
            if not body.stream:
                async for chunk in chunks:
                    answer.add(chunk)
                return JSONResponse(answer.whole())
            first = await anext(chunks)  # errors before any output keep their HTTP status
            streaming = True
        except Refusal as refusal:
            return ApiError.from_refusal(refusal, chat).response()
        finally:
            if not streaming:
                generation.end()
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            self._events(answer, first, chunks, generation, usage, chat),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _events(
        self, answer, first, chunks, generation: Generation, usage: bool, chat: bool
    ) -> AsyncIterator[str]:
        async def all_chunks():
            yield first
            async for chunk in chunks:  # to its end: the core then counts the request OK
                yield chunk

        try:
            yield _sse(answer.head())
            async for chunk in all_chunks():
                event = answer.delta(chunk)
                if event is not None:
                    yield _sse(event)
            if usage:
                yield _sse(answer.usage_event())
        except Refusal as refusal:  # after the first chunk: the status line is long gone
            yield _sse(ApiError.from_refusal(refusal, chat).body())
        finally:
            generation.end()  # a client that went away lands here too: its slot is freed
        yield "data: [DONE]\n\n"

    async def _parse(self, request: Request, kind: type[_Body]):
        """The body, parsed and type-checked (the parser's refusals: not JSON, a wrong type,
        an unknown or unsupported field, another model), and the validator's input."""
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            message = f"We could not parse the JSON body of your request: {err}"
            raise invalid(None, message, None) from None
        if not isinstance(raw, dict):
            raise invalid(None, "The body of your request must be a JSON object.", None)
        try:
            body = kind.model_validate(raw)
        except ValidationError as err:
            raise parse_error(err) from None
        body.refuse_unsupported()
        if body.model != self.model_id:
            raise model_not_found(body.model)
        return body, body.request()


class _Answer:
    """One completion being assembled, as a whole response or as stream events."""

    def __init__(self, model_id: str, chat: bool, call):
        self.model_id, self.chat, self.call = model_id, chat, call
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        self.text: list[str] = []
        self.completion_tokens = 0
        self.finish: str | None = None
        self.stats: dict = {}
        self.cached_tokens = 0

    def add(self, event: Text | Finished) -> None:
        self.text.append(event.text)
        if isinstance(event, Text):
            self.completion_tokens += len(event.token_ids)
        else:
            self.finish = event.finish_reason
            self.stats = _stats(event)
            self.cached_tokens = event.stats.cached_prompt_tokens

    def usage(self) -> dict:
        """OpenAI's usage; cached_tokens: prompt tokens whose KV a parked session or a cached
        prefix supplied (not prefilled again)."""
        prompt = self.call.prompt_tokens
        done = self.completion_tokens
        return dict(
            prompt_tokens=prompt,
            completion_tokens=done,
            total_tokens=prompt + done,
            prompt_tokens_details=dict(cached_tokens=self.cached_tokens),
        )

    def _envelope(self, kind: str, choice: dict | None) -> dict:
        return dict(
            id=self.id,
            object=kind,
            created=self.created,
            model=self.model_id,
            choices=[] if choice is None else [dict(index=0, **choice)],
        )

    def whole(self) -> dict:
        text = "".join(self.text)
        body = dict(message=dict(role="assistant", content=text)) if self.chat else dict(text=text)
        out = self._envelope(self.kind, dict(body, finish_reason=self.finish, logprobs=None))
        return dict(out, usage=self.usage(), blockspec=self.stats)

    def _chunk(self, content: dict, finish: str | None = None) -> dict:
        payload = dict(delta=content) if self.chat else dict(text=content.get("content", ""))
        return self._envelope(self.chunk_kind, dict(payload, finish_reason=finish, logprobs=None))

    def head(self) -> dict:
        return self._chunk(dict(role="assistant", content="") if self.chat else {})

    def delta(self, event: Text | Finished) -> dict | None:
        self.add(event)
        if isinstance(event, Finished):
            content = dict(content=event.text) if event.text else {}
            return dict(self._chunk(content, self.finish), blockspec=self.stats)
        return self._chunk(dict(content=event.text)) if event.text else None

    def usage_event(self) -> dict:
        return dict(self._envelope(self.chunk_kind, None), usage=self.usage())


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------ OpenAI's answers, counted
_metrics = None  # the gateway's GatewayMetrics in this process (set by OpenAIFrontend)


@http_app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Routing's own errors (no such route, a route without this method) in OpenAI's words,
    instead of FastAPI's ``{"detail": ...}``."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Unknown request URL: {where}. Please check the URL for typos."
        err = ApiError(404, "invalid_request_error", message, None, "unknown_url")
    elif exc.status_code == 405:
        err = ApiError(405, "invalid_request_error", f"Invalid method for URL ({where})")
    else:
        err = ApiError(exc.status_code, "invalid_request_error", str(exc.detail))
    return err.response()


@http_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own request checks (422 by default): OpenAI's 400."""
    first = (exc.errors() or [{}])[0]
    loc = tuple(p for p in first.get("loc", ()) if p not in ("body", "path", "query"))
    return invalid(_param(loc), first.get("msg", "invalid request")).response()


class CountAnswers:
    """ASGI middleware: every HTTP answer in ``blockspec_http_requests_total`` by route template
    (``unmatched`` for no route) and status, the refusals no request path saw included. Plain
    ASGI, not BaseHTTPMiddleware, so streams and client disconnects pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _metrics is None:
            return await self.app(scope, receive, send)
        status = [500]  # an exception before the answer started: the server's error

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            # The router records the route it matched (fully, or all but the method) in the
            # scope it was handed: this one.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            _metrics.http.labels(route, str(status[0])).inc()


http_app.add_middleware(CountAnswers)
