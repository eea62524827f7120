"""The OpenAI-compatible HTTP API (service/http_api.py), driven by the real `openai` SDK against
the live service (Serve's HTTP proxy in front of the same gateway as gRPC), and its error
mapping and authorization as units."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from starlette.requests import Request

from blockspec.protos import blockspec_pb2 as pb
from blockspec.service.auth import BearerAuth
from blockspec.service.core import Refusal
from blockspec.service.http_api import ApiError, OpenAIFrontend, request_timeout
from tests.test_service import poll_gateway_metrics, scrape, stats, wait_idle

pytestmark = pytest.mark.xdist_group("ray")  # with every test that uses the live service

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def client(service):
    return openai.OpenAI(base_url=service["http"] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(client) -> str:
    (only,) = client.models.list().data
    return only.id


def grpc_answer(service, **fields) -> pb.GenerateResponse:
    return service["stub"].Generate(pb.GenerateRequest(**fields))


def test_models_lists_the_served_target(client, model):
    assert model == "target"  # the tiny pair's target directory


@pytest.mark.parametrize("method", ["block", "gbv", "spectr_gbv"])
def test_seeded_completion_equals_the_grpc_answer(service, client, model, method):
    knobs = dict(method=method, k=1 if method == "block" else 2, gamma=3)
    out = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=24, seed=11, extra_body=knobs
    )
    ref = grpc_answer(service, prompt="Once upon a time", max_new_tokens=24, seed=11, **knobs)
    choice = out.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == ref.prompt_tokens
    assert out.usage.completion_tokens == len(ref.token_ids) == 24
    assert out.usage.total_tokens == ref.prompt_tokens + 24
    speculation = out.model_extra["blockspec"]
    assert speculation["target_calls"] == ref.stats.target_calls
    assert len(speculation["accepted_per_position"]) == 3


def test_seeded_chat_equals_the_grpc_answer_unary_and_streamed(service, client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=20, seed=5, temperature=0.8)
    out = client.chat.completions.create(**kwargs)
    wire = [pb.ChatMessage(**m) for m in MESSAGES]
    ref = grpc_answer(service, messages=wire, max_new_tokens=20, seed=5, temperature=0.8)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == ref.prompt_tokens
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["blockspec"]["target_calls"] == ref.stats.target_calls
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_adds_up_and_stop_strings_cut(client, model):
    kwargs = dict(model=model, prompt="The", max_tokens=30, seed=2)
    whole = client.completions.create(**kwargs).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(parts) == whole and len(parts) > 2
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    answer = client.completions.create(**kwargs, stop=[stop])
    cut = answer.choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.index(stop)]
    stats = answer.model_extra["blockspec"]  # what ran, as after any other finish
    assert stats["replica"] and stats["target_calls"] > 0 and stats["tokens_per_call"] >= 1
    assert stats["method"] and stats["gamma"] > 0 and stats["k"] == 1
    assert stats["cached_prompt_tokens"] == answer.usage.prompt_tokens_details.cached_tokens


def test_a_request_timeout_is_a_deadline_that_frees_the_replica(service, client, model):
    """X-Request-Timeout, and for an answer in one piece the SDK's own timeout, end the work at
    the deadline (504 `timeout`); the replica cancels the request instead of finishing its 300
    tokens (~4 s here) for nobody."""
    long = dict(model=model, prompt="x", max_tokens=300, extra_body=dict(ignore_eos=True))
    before = wait_idle(service).cancelled
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**long, extra_headers={"X-Request-Timeout": "0.5"})
    assert err.value.status_code == 504 and err.value.body["type"] == "timeout"
    assert time.monotonic() - start < 3
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(**long)
    idle = wait_idle(service, timeout=2.0)
    assert idle.active == 0 and idle.cancelled == before + 2


def test_prompt_as_token_ids(service, client, model):
    ids = [5, 17, 42, 7]
    out = client.completions.create(model=model, prompt=ids, max_tokens=8, seed=3)
    ref = grpc_answer(service, prompt_token_ids=ids, max_new_tokens=8, seed=3)
    assert out.choices[0].text == ref.text and out.usage.prompt_tokens == 4


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        (dict(max_tokens=0), "max_tokens", "integer_below_min_value"),
        (dict(max_tokens=100_000), "max_tokens", "integer_above_max_value"),  # max_new_tokens
        (dict(extra_body=dict(gamma=999)), "gamma", "integer_above_max_value"),
        (dict(extra_body=dict(k=0)), "k", "integer_below_min_value"),
        (dict(extra_body=dict(method="nope")), "method", "invalid_value"),
        (dict(extra_body=dict(method="token", k=3)), "k", "invalid_value"),
        (dict(temperature=-1), "temperature", "decimal_below_min_value"),
        (dict(temperature=2.5), "temperature", "decimal_above_max_value"),  # OpenAI's [0, 2]
        (dict(top_p=1.5), "top_p", "decimal_above_max_value"),
        (dict(n=2), "n", "unsupported_value"),
        (dict(n=0), "n", "integer_below_min_value"),
        (dict(logprobs=2), "logprobs", "unsupported_value"),
        (dict(presence_penalty=0.5), "presence_penalty", "unsupported_value"),
        (dict(echo=True), "echo", "unsupported_value"),
        (dict(seed=-4), "seed", "invalid_value"),
        (dict(prompt=""), "prompt", "invalid_value"),
        (dict(prompt="x " * 400), "prompt", "context_length_exceeded"),
        (dict(stop=["a"] * 17), "stop", "array_above_max_length"),
        (dict(extra_body=dict(max_tokens="5")), "max_tokens", "invalid_type"),  # no coercion
        (dict(extra_body=dict(seed=True)), "seed", "invalid_type"),
    ],
)
def test_bad_fields_get_an_openai_error_naming_the_field(client, model, fields, param, code):
    kwargs = dict(model=model, prompt="hello", max_tokens=4) | fields
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs)
    body = err.value.body
    assert body["param"] == param and body["message"].startswith(param), body
    assert body["type"] == "invalid_request_error" and body["code"] == code, body


def test_unknown_fields_and_models_are_refused_as_openai_refuses_them(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", extra_body=dict(frobnicate=1))
    assert err.value.body == {
        "message": "Unrecognized request argument supplied: frobnicate",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.BadRequestError) as err:  # a chat field is unknown here
        client.completions.create(model=model, prompt="x", extra_body=dict(messages=[]))
    assert err.value.body["message"] == "Unrecognized request argument supplied: messages"
    for call in (
        lambda m: client.completions.create(model=m, prompt="x", max_tokens=2),
        lambda m: client.chat.completions.create(model=m, messages=MESSAGES, max_tokens=2),
        lambda m: client.models.retrieve(m),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call("gpt-4o")
        assert err.value.body == {
            "message": "The model `gpt-4o` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    # blockspec's own fields stay accepted (docs/openai_api.md lists them).
    out = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=3,
        extra_body=dict(method="gbv", k=2, gamma=2, top_k=5, ignore_eos=True, new_session=True,
                        stop_token_ids=[1]),
    )  # fmt: skip
    extension = out.model_extra["blockspec"]
    assert (extension["method"], extension["k"], extension["gamma"]) == ("gbv", 2, 2)
    assert extension["session_id"]


def test_chat_roles_and_message_types_are_openais(client, model):
    for messages, param, code in [
        ([{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
        ([MESSAGES[0], {"role": "", "content": "x"}], "messages[1].role", "invalid_value"),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
        (
            [{"role": "user", "content": "x", "colour": 1}],
            "messages[0].colour",
            "unknown_parameter",
        ),
        ([{"content": "x"}], "messages[0].role", "missing_required_parameter"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        body = err.value.body
        assert (body["param"], body["code"], body["type"]) == (
            param, code, "invalid_request_error"
        ), body  # fmt: skip
    system = {"role": "developer", "content": "Be brief."}
    out = client.chat.completions.create(model=model, messages=[system, *MESSAGES], max_tokens=2)
    assert out.choices[0].message.role == "assistant"


def http_metrics(service) -> dict[str, float]:
    port = service["address"]["metrics_port"]
    return scrape(f"http://127.0.0.1:{port}/metrics", keep=("route", "status"))


def http_call(service, method: str, path: str, payload: bytes | None = None):
    """(status, JSON body) of one raw HTTP call."""
    req = urllib.request.Request(
        service["http"] + path,
        data=payload,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_unknown_routes_and_methods_answer_in_openais_schema_and_are_counted(service):
    counted = {
        'blockspec_http_requests_total{route="unmatched",status="404"}': 2,
        'blockspec_http_requests_total{route="/v1/chat/completions",status="405"}': 1,
        'blockspec_http_requests_total{route="/v1/completions",status="400"}': 2,
        'blockspec_http_requests_total{route="/v1/models",status="200"}': 1,
    }
    before = http_metrics(service)
    status, body = http_call(service, "GET", "/v1/frobnicate")
    assert status == 404 and "detail" not in body, body
    assert body["error"] == {
        "message": "Unknown request URL: GET /v1/frobnicate. Please check the URL for typos.",
        "type": "invalid_request_error",
        "param": None,
        "code": "unknown_url",
    }
    status, body = http_call(service, "POST", "/completions", b"{}")  # no /v1
    assert status == 404 and body["error"]["code"] == "unknown_url"
    status, body = http_call(service, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"] == "Invalid method for URL (GET /v1/chat/completions)"
    # Refused before blockspec's own checks: still counted.
    assert http_call(service, "POST", "/v1/completions", b"{not json")[0] == 400
    assert http_call(service, "POST", "/v1/completions", b'{"frobnicate": 1}')[0] == 400
    assert http_call(service, "GET", "/v1/models")[0] == 200
    deadline = time.monotonic() + 20  # counted once each answer has gone out
    while True:
        after = http_metrics(service)
        grown = {name: after.get(name, 0) - before.get(name, 0) for name in counted}
        if grown == counted or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert grown == counted, (before, after)


def test_model_and_info_routes_say_what_grpc_info_says(service, client, model):
    retrieved = client.models.retrieve(model)
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == (model, "model", "blockspec")
    status, info = http_call(service, "GET", "/v1/blockspec/info")
    assert status == 200
    ref = service["stub"].Info(pb.InfoRequest())
    assert info["model"] == model == ref.target_model
    assert info["vocab_size"] == ref.vocab_size
    assert [m["name"] for m in info["methods"]] == [m.name for m in ref.methods]
    assert info["limits"]["max_context"] == ref.limits.max_context
    assert info["limits"]["max_new_tokens"] == ref.limits.max_new_tokens
    assert info["limits"]["max_temperature"] == 2
    assert info["default_method"] == ref.default_method
    assert info["default_gamma"] == ref.default_gamma
    assert info["default_max_new_tokens"] == ref.default_max_new_tokens
    assert info["chat_template"] == ref.chat_template
    assert set(info["extra_body_fields"]) >= {"method", "k", "gamma", "session_id"}


def test_malformed_bodies_are_refused_and_the_server_stays_up(service, client, model):
    for payload in (b"{not json", b"[1, 2]", json.dumps({"model": model}).encode()):
        req = urllib.request.Request(
            service["http"] + "/v1/completions",
            data=payload,
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400
        error = json.loads(err.value.read())["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    with pytest.raises(openai.BadRequestError) as err:  # no chat template rendering: roles
        client.chat.completions.create(model=model, messages=[{"role": "", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as err:  # a stream refused before it starts
        client.completions.create(model=model, prompt="x", stream=True, extra_body=dict(gamma=999))
    assert err.value.body["param"] == "gamma"
    assert client.completions.create(model=model, prompt="ok", max_tokens=2).choices[0].text


def test_a_cancelled_stream_frees_its_slot(service, client, model):
    counted = 'blockspec_requests_total{code="CANCELLED",method="token"}'
    before = poll_gateway_metrics(service, lambda m: True).get(counted, 0)
    cancelled_before = stats(service).cancelled
    for _ in range(3):
        stream = client.completions.create(
            model=model,
            prompt="x",
            max_tokens=300,
            stream=True,
            extra_body=dict(method="token", ignore_eos=True),
        )
        next(iter(stream))
        stream.close()  # the client goes away mid-stream
    s = wait_idle(service)
    assert s.active == 0 and s.in_flight == 0
    assert s.cancelled >= cancelled_before + 3
    metrics = poll_gateway_metrics(
        service, lambda m: m.get(counted, 0) >= before + 3 and m["blockspec_in_flight"] == 0
    )
    assert metrics[counted] == before + 3 and metrics["blockspec_in_flight"] == 0, metrics
    assert client.completions.create(model=model, prompt="z", max_tokens=3).usage


def test_both_wires_open_their_requests_on_one_core(service):
    """A gRPC and an HTTP request with the same fields reach the same application core
    (a gateway's GenerationCore, as both of its APIs do) with equal parameters, temperature
    included; the HTTP one with no protobuf in them and its X-Request-Timeout as the caller's
    deadline. The replica then ran the same request: the seeded texts are equal."""
    import asyncio

    from google.protobuf.message import Message
    from ray import serve

    from blockspec.protos import blockspec_pb2_grpc as pb_grpc
    from blockspec.service.gateway import GatewayServer
    from tests.live_service import APP

    settings = service["settings"].model_copy(update=dict(port=0, metrics_port=0))
    replicas = serve.get_deployment_handle("Replica", APP)
    opened = []
    fields = dict(max_new_tokens=6, temperature=0.37, seed=5, method="token", ignore_eos=True)

    async def scenario():
        server = GatewayServer(settings, replicas, await replicas.info.remote())
        core_open = server.core.open

        def open_and_record(params, caller, unary=False):
            opened.append((params, caller))
            return core_open(params, caller, unary)

        server.core.open = open_and_record
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = pb_grpc.GeneratorStub(channel)
                reply = await stub.Generate(pb.GenerateRequest(prompt="a b", **fields))
            body = dict(
                model="target", prompt="a b", max_tokens=6, temperature=0.37, seed=5,
                method="token", ignore_eos=True,
            )  # fmt: skip
            frontend = OpenAIFrontend(server.core, "target")
            request = _request({"X-Request-Timeout": "30"}, body)
            response = await frontend.complete(request, False)
        finally:
            await server.drain()
        return reply, response.status_code, json.loads(response.body)

    reply, status, answer = asyncio.run(scenario())
    assert status == 200, answer
    (by_grpc, grpc_caller), (by_http, http_caller) = opened
    assert by_http.temperature == pytest.approx(0.37) == by_grpc.temperature  # a float32 there
    assert by_http.max_new_tokens == by_grpc.max_new_tokens == 6
    assert (by_http.prompt, by_http.seed, by_http.method) == ("a b", 5, "token")
    assert (by_grpc.prompt, by_grpc.seed, by_grpc.method) == ("a b", 5, "token")
    assert not any(isinstance(v, Message) for v in vars(by_http).values())
    assert grpc_caller.deadline is None and 25 < http_caller.time_remaining() <= 30
    assert answer["choices"][0]["text"] == reply.text and reply.text


# ----------------------------------------------------------------------------- units
@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_gateway_codes_map_to_http_statuses(code, status):
    err = ApiError.from_refusal(Refusal(code, "overloaded, retry later: the gateway holds 40"))
    assert err.status == status and err.param is None
    named = ApiError.from_refusal(Refusal(code, "at most 512", "max_new_tokens", "too_big"))
    assert named.param == "max_tokens" and named.message == "max_tokens: at most 512"
    assert named.body()["error"]["code"] == "too_big"
    # The context check names the prompt: a chat's prompt is its messages.
    context = Refusal(code, "exceeds", "prompt", "context_length_exceeded")
    assert ApiError.from_refusal(context, chat=True).param == "messages"
    assert ApiError.from_refusal(context).param == "prompt"


class _AuthOnly:
    """Only what OpenAIFrontend.authorize reads of the core: the gateway's real BearerAuth."""

    def __init__(self, auth: BearerAuth):
        self.auth = auth


def _request(headers: dict[str, str], body: dict | None = None) -> Request:
    """A starlette request as the proxy hands it over: headers, and a JSON body if given."""
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    payload = json.dumps(body or {}).encode()

    async def receive():
        return {"type": "http.request", "body": payload, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": raw, "client": None}
    return Request(scope, receive)


async def post_completion(service, body: dict):
    """POST /v1/completions on a gateway's GenerationCore, without the proxy: (status, JSON)."""
    response = await OpenAIFrontend(service, "target").complete(_request({}, body), False)
    return response.status_code, json.loads(response.body)


@pytest.mark.parametrize(
    ("headers", "stream", "seconds"),
    [
        ({}, False, None),
        ({"X-Request-Timeout": "2.5"}, True, 2.5),
        ({"X-Stainless-Read-Timeout": "30"}, False, 30.0),  # answered in one piece: the whole
        ({"X-Stainless-Read-Timeout": "30"}, True, None),  # a stream's: between chunks only
        ({"X-Request-Timeout": "4", "X-Stainless-Read-Timeout": "30"}, False, 4.0),
    ],
)
def test_the_request_timeout_headers(headers, stream, seconds):
    assert request_timeout(_request(headers), stream) == seconds


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_bad_request_timeout_is_refused_naming_the_header(value):
    with pytest.raises(ApiError) as err:
        request_timeout(_request({"X-Request-Timeout": value}), False)
    assert err.value.status == 400 and err.value.code == "invalid_header"
    assert err.value.message.startswith("header x-request-timeout: must be a positive number")


def test_authorization_mirrors_the_grpc_interceptor():
    frontend = OpenAIFrontend(_AuthOnly(BearerAuth({"alice": "s3cret"})), "target")
    frontend.authorize(_request({"Authorization": "Bearer s3cret"}))
    for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 403)):
        with pytest.raises(ApiError) as err:
            frontend.authorize(_request(headers))
        assert err.value.status == status
    open_frontend = OpenAIFrontend(_AuthOnly(BearerAuth({})), "target")
    open_frontend.authorize(_request({}))  # auth off: anyone


def test_http_api_settings_default_to_loopback_8000_and_accept_0_for_off():
    from blockspec.service.config import Settings

    assert Settings(http_port=0).http_port == 0
    assert Settings().http_port == 8000 and Settings().host == "127.0.0.1"


def test_chunks_arrive_as_they_are_produced(client, model):
    """SSE through Serve's proxy is not buffered: the first chunk comes long before the last."""
    start = time.monotonic()
    stream = client.completions.create(
        model=model, prompt="a", max_tokens=80, stream=True, extra_body=dict(ignore_eos=True)
    )
    arrivals = [time.monotonic() - start for _ in stream]
    assert len(arrivals) > 5
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals


async def post(frontend: OpenAIFrontend, body, chat: bool = False):
    """A POST on `frontend` without the proxy, `body` JSON (or raw bytes): (status, error)."""
    request = _request({}, None if isinstance(body, bytes) else body)
    if isinstance(body, bytes):
        request._body = body
    response = await frontend.complete(request, chat)
    return response.status_code, json.loads(response.body)["error"]


@pytest.mark.parametrize(
    ("body", "chat", "status", "param", "code"),
    [
        ({"model": "target", "prompt": "x", "frobnicate": 1}, False, 400, None, None),
        ({"model": "target", "prompt": "x", "max_completion_tokens": 2}, False, 400, None, None),
        ({"model": "target", "prompt": "x", "best_of": 2}, False, 400, "best_of",
         "unsupported_value"),
        ({"model": "target", "messages": [{"role": "user", "content": "x"}], "echo": True},
         True, 400, None, None),  # a completions field is unknown to chat
        ({"model": "target", "prompt": "x", "max_tokens": "5"}, False, 400, "max_tokens",
         "invalid_type"),
        ({"model": "target", "prompt": "x", "temperature": "hot"}, False, 400, "temperature",
         "invalid_type"),
        ({"prompt": "x"}, False, 400, "model", "missing_required_parameter"),
        ({"model": "target", "prompt": "x", "n": 3}, False, 400, "n", "unsupported_value"),
        ({"model": "target", "prompt": "x", "stream_options": {"include_usage": 1}}, False, 400,
         "stream_options.include_usage", "invalid_type"),
        ({"model": "target", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         True, 400, "messages[0].content[0].type", "invalid_value"),
        ({"model": "target", "messages": []}, True, 400, "messages", "invalid_value"),
        ({"model": "target", "messages": [{"role": "user", "content": None}]}, True, 400,
         "messages[0].content", "invalid_type"),  # OpenAI refuses a null user turn too
        ({"model": "target", "messages": [{"role": "user"}]}, True, 400,
         "messages[0].content", "missing_required_parameter"),
        ({"model": "other", "prompt": "x"}, False, 404, None, "model_not_found"),
        (b"{not json", False, 400, None, None),
        (b"[1]", False, 400, None, None),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_bodies_are_parsed_as_strictly_as_openai_parses_them(body, chat, status, param, code):
    """The parser's refusals, before any request path: no GenerationCore.open here."""
    frontend = OpenAIFrontend(_AuthOnly(BearerAuth({})), "target")
    got_status, error = await post(frontend, body, chat)
    assert (got_status, error["param"], error["code"]) == (status, param, code), error
    assert error["type"] == "invalid_request_error" and error["message"]
    if isinstance(body, dict) and "frobnicate" in body:
        assert error["message"] == "Unrecognized request argument supplied: frobnicate"


def test_the_docs_list_every_extra_field_refused_field_and_limit():
    """docs/openai_api.md is the API's reference: it must keep up with the code."""
    from pathlib import Path

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.http_api import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, EXTENSIONS
    from blockspec.service.requests import (
        CHARS_PER_POSITION,
        CHAT_ROLES,
        MAX_STOP_CHARS,
        MAX_STOP_STRINGS,
        MAX_STOP_TOKEN_IDS,
        MAX_TEMPERATURE,
    )

    doc = (Path(__file__).resolve().parents[1] / "docs/openai_api.md").read_text()
    for name in EXTENSIONS:
        assert f"| `{name}` |" in doc, name
    for name in (*CHAT_UNSUPPORTED, *COMPLETION_UNSUPPORTED):
        assert f"`{name}`" in doc, name
    assert ", ".join(f"`{role}`" for role in CHAT_ROLES) in doc
    assert f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters" in doc
    assert f"at most {MAX_STOP_TOKEN_IDS}" in doc
    assert f"at most {CHARS_PER_POSITION} characters per context position" in doc
    assert f"0 to {MAX_TEMPERATURE:g} (OpenAI's" in doc
    replica = ReplicaConfig()
    assert f"{replica.max_new_tokens} by default" in doc
    assert f"`default_max_new_tokens` ({replica.default_max_new_tokens} by default)" in doc
    assert f"{replica.max_len} by default" in doc
    assert f"{replica.max_k} / {replica.max_gamma} by default" in doc
