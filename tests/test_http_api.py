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

from protos import blockspec_pb2 as pb
from service.auth import BearerAuth
from service.gateway import Refusal
from service.http_api import ApiError, OpenAIFrontend
from tests.test_service import poll_gateway_metrics, stats, wait_idle

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
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.index(stop)]


def test_prompt_as_token_ids(service, client, model):
    ids = [5, 17, 42, 7]
    out = client.completions.create(model=model, prompt=ids, max_tokens=8, seed=3)
    ref = grpc_answer(service, prompt_token_ids=ids, max_new_tokens=8, seed=3)
    assert out.choices[0].text == ref.text and out.usage.prompt_tokens == 4


@pytest.mark.parametrize(
    ("fields", "param", "status"),
    [
        (dict(max_tokens=0), "max_tokens", 400),  # given, so not the default (unlike gRPC's 0)
        (dict(max_tokens=100_000), "max_tokens", 400),  # the shared limit (max_new_tokens)
        (dict(extra_body=dict(gamma=999)), "gamma", 400),
        (dict(extra_body=dict(method="nope")), "method", 400),
        (dict(extra_body=dict(method="token", k=3)), "k", 400),
        (dict(temperature=-1), "temperature", 400),
        (dict(n=2), "n", 400),
        (dict(logprobs=2), "logprobs", 400),
        (dict(presence_penalty=0.5), "presence_penalty", 400),
        (dict(echo=True), "echo", 400),
        (dict(seed=-4), "seed", 400),
        (dict(prompt=""), "prompt", 400),
        (dict(model="gpt-4o"), "model", 404),
    ],
)
def test_bad_fields_get_an_openai_error_naming_the_field(client, model, fields, param, status):
    kwargs = dict(model=model, prompt="hello", max_tokens=4) | fields
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**kwargs)
    assert err.value.status_code == status
    body = err.value.body
    assert body["param"] == param and body["message"].startswith(param), body
    assert body["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


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
    assert err.value.body["param"] == "messages"
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
    named = ApiError.from_refusal(Refusal(code, "at most 512", field="max_new_tokens"))
    assert named.param == "max_tokens" and named.message == "max_tokens: at most 512"


class _GenerationService:
    """Only what OpenAIFrontend.authorize reads: the gateway's real BearerAuth."""

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
    """POST /v1/completions on a gateway's GenerationService, without the proxy: (status, JSON)."""
    response = await OpenAIFrontend(service, "target").complete(_request({}, body), False)
    return response.status_code, json.loads(response.body)


def test_authorization_mirrors_the_grpc_interceptor():
    frontend = OpenAIFrontend(_GenerationService(BearerAuth({"alice": "s3cret"})), "target")
    frontend.authorize(_request({"Authorization": "Bearer s3cret"}))
    for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 403)):
        with pytest.raises(ApiError) as err:
            frontend.authorize(_request(headers))
        assert err.value.status == status
    open_frontend = OpenAIFrontend(_GenerationService(BearerAuth({})), "target")
    open_frontend.authorize(_request({}))  # auth off: anyone


def test_http_api_settings_default_to_loopback_8000_and_accept_0_for_off():
    from service.config import Settings

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
