"""The OpenAI-compatible HTTP API, served by Ray Serve's HTTP proxy beside the gRPC API.

    POST /v1/chat/completions   messages through the target model's chat template
    POST /v1/completions        a prompt (text, or token ids)
    GET  /v1/models             the one model this deployment serves

Both POSTs stream as server-sent events with ``"stream": true`` (ending in ``data: [DONE]``)
and report ``usage``. A request body is parsed into the validator's input
(:class:`service.requests.RequestParams`) and runs through the gRPC gateway's own request path
(:meth:`service.gateway.GenerationService.open`): the same checks, limits, authentication,
sessions, metrics and replicas, one copy of each. Its status codes become HTTP statuses in
OpenAI's error schema (:data:`HTTP_STATUS`), the field at fault its ``param``.

OpenAI fields: ``model``, ``messages`` / ``prompt``, ``max_tokens`` (or
``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
``stream_options.include_usage``, ``n`` = 1, ``user`` (ignored). Fields this service cannot
honour (``n`` > 1, ``logprobs``, penalties, tools, ...) are refused by name, never ignored.
blockspec's own knobs ride along as extra body fields (``method``, ``k``, ``gamma``, ``top_k``,
``session_id``, ``new_session``, ``ignore_eos``, ``stop_token_ids``); the speculation stats
come back under a ``blockspec`` key.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protos import blockspec_pb2 as pb
from service.gateway import Refusal
from service.requests import ChatTurn, RequestParams

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
FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop"}
# OpenAI fields with no meaning here: accepted only at their default (value), else refused.
UNSUPPORTED: dict[str, Any] = {
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "logprobs": None,
    "top_logprobs": None,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
}

http_app = FastAPI(title="blockspec", docs_url=None, redoc_url=None, openapi_url=None)


class ApiError(Exception):
    """An HTTP error in OpenAI's schema."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    @staticmethod
    def from_refusal(refusal: Refusal) -> ApiError:
        """The gateway's refusal, its field (if any) under the name the client sent."""
        status, kind = HTTP_STATUS.get(refusal.code, (500, "server_error"))
        if refusal.field is None:
            return ApiError(status, kind, refusal.message)
        param = OPENAI_NAMES.get(refusal.field, refusal.field)
        return ApiError(status, kind, f"{param}: {refusal.message}", param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", f"{param}: {message}", param)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    """Fields both endpoints share; unknown fields are ignored (clients add their own). Only
    types are checked here: the bounds are the validator's (service/requests.py)."""

    model_config = ConfigDict(extra="allow")

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
        if self.n != 1:
            raise invalid("n", "only n = 1 is supported (one completion per request)")
        for name, default in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value is None or value is False or value == default or value == []:
                continue
            if name == "response_format" and value == {"type": "text"}:
                continue
            raise invalid(name, f"{value!r} is not supported by this service")

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
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def request(self) -> RequestParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self.params(messages=tuple(ChatTurn(m.role, m.text()) for m in self.messages))


class CompletionBody(_Body):
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


class _Context:
    """What service.gateway.GenerationService uses of a grpc.aio.ServicerContext, for one
    HTTP call."""

    def __init__(self, request: Request):
        self.metadata = self.metadata_of(request)
        client = request.client
        self.address = f"ipv4:{client.host}:{client.port}" if client else "unknown:0"
        self.callbacks: list[Callable] = []

    @staticmethod
    def metadata_of(request: Request) -> list[tuple[str, str]]:
        """The request's credentials as gRPC call metadata."""
        header = request.headers.get("authorization")
        return [("authorization", header)] if header is not None else []

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return self.address

    def add_done_callback(self, callback: Callable) -> None:
        self.callbacks.append(callback)

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> None:
        """The HTTP exchange ended (answered, failed, or the client went away)."""
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self)


def _stats(chunk: pb.GenerateChunk, call) -> dict:
    stats = (
        MessageToDict(
            chunk.stats,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        if chunk.HasField("stats")
        else {}
    )
    return dict(stats, replica=chunk.replica, session_id=call.session_id or None)


class OpenAIFrontend:
    """The three endpoints over a gateway's GenerationService (service.gateway)."""

    def __init__(self, service, model_id: str):
        self.service, self.model_id = service, model_id
        self.created = int(time.time())

    def models(self) -> dict:
        model = dict(id=self.model_id, object="model", created=self.created, owned_by="blockspec")
        return dict(object="list", data=[model])

    def authorize(self, request: Request) -> None:
        """The gateway's token check (no token 401, an unknown one 403)."""
        refused = self.service.auth.refusal(_Context.metadata_of(request))
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

    async def complete(self, request: Request, chat: bool):
        try:
            self.authorize(request)
            body, params = await self._parse(request, ChatBody if chat else CompletionBody)
        except ApiError as err:
            return err.response()
        context = _Context(request)
        call, chunks = self.service.open(params, context, unary=not body.stream)
        answer = _Answer(self.model_id, chat, call)
        streaming = False  # once the event stream owns the exchange, it ends it
        try:
            if not body.stream:
                async for chunk in chunks:
                    answer.add(chunk)
                return JSONResponse(answer.whole())
            first = await anext(chunks)  # errors before any output keep their HTTP status
            streaming = True
        except Refusal as refusal:
            return ApiError.from_refusal(refusal).response()
        finally:
            if not streaming:
                context.done()
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            self._events(answer, first, chunks, context, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _events(self, answer, first, chunks, context, usage: bool) -> AsyncIterator[str]:
        async def all_chunks():
            yield first
            async for chunk in chunks:  # to its end: the gateway then counts the request OK
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
            yield _sse(ApiError.from_refusal(refusal).body())
        finally:
            context.done()  # a client that went away lands here too: its slot is freed
        yield "data: [DONE]\n\n"

    async def _parse(self, request: Request, kind: type[_Body]):
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, "invalid_request_error", f"body: not JSON ({err})") from None
        if not isinstance(raw, dict):
            raise ApiError(400, "invalid_request_error", "body: a JSON object is expected")
        try:
            body = kind.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or "body"
            raise invalid(param, first["msg"]) from None
        if body.model != self.model_id:
            raise ApiError(
                404,
                "not_found_error",
                f"model: {body.model!r} is not served here; GET /v1/models lists {self.model_id!r}",
                "model",
            )
        body.refuse_unsupported()
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

    def add(self, chunk: pb.GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason:
            self.finish = FINISH[chunk.finish_reason]
            self.stats = _stats(chunk, self.call)
            self.cached_tokens = chunk.stats.cached_prompt_tokens

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

    def delta(self, chunk: pb.GenerateChunk) -> dict | None:
        self.add(chunk)
        if chunk.finish_reason:
            content = dict(content=chunk.text) if chunk.text else {}
            return dict(self._chunk(content, self.finish), blockspec=self.stats)
        return self._chunk(dict(content=chunk.text)) if chunk.text else None

    def usage_event(self) -> dict:
        return dict(self._envelope(self.chunk_kind, None), usage=self.usage())


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
