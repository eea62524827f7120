"""Conversations however the client sends them, on a live local deployment (the tiny pair):

- over gRPC, a session and the next turn as `messages`: the server renders the chat template
  over the stored turns and the new one, and the replica's parked KV covers what the new prompt
  shares with the last prompt and reply;
- over HTTP (`chat.completions`), with `session_id` in the body (the client sends the next turn,
  or the whole conversation again), and stateless: the whole conversation, no session, where
  the longest cached prefix of the caller's earlier requests supplies the KV;
- each turn's reuse reported in the gRPC stats and in OpenAI's
  `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import time

import openai
import pytest

from blockspec.protos import blockspec_pb2 as pb

pytestmark = pytest.mark.xdist_group("ray")

QUESTIONS = [
    "My name is Alice.",
    "What is my name?",
    "Write a haiku about rain.",
    "Now one about snow.",
    "Which of the two did you like more?",
]
TURN = dict(max_new_tokens=12, temperature=0, ignore_eos=True)


def test_a_grpc_session_continues_with_messages_and_reuses_its_kv(service):
    stub = service["stub"]
    first = stub.Generate(
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=QUESTIONS[0])],
                           new_session=True, **TURN)
    )  # fmt: skip
    sid, previous = first.session_id, first.prompt_tokens + len(first.token_ids)
    assert sid and first.stats.cached_prompt_tokens == 0
    for question in QUESTIONS[1:]:
        turn = stub.Generate(
            pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=question)],
                               session_id=sid, **TURN)
        )  # fmt: skip
        assert turn.prompt_tokens > previous  # the whole conversation is the prompt
        assert turn.stats.cached_prompt_tokens >= 0.9 * previous, (turn.stats, previous)
        previous = turn.prompt_tokens + len(turn.token_ids)


@pytest.fixture
def client(service):
    return openai.OpenAI(base_url=service["http"] + "/v1", api_key="unused", max_retries=0)


def chat(client, messages: list[dict], **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=TURN["max_new_tokens"],
        temperature=0,
        extra_body=dict(ignore_eos=True, **extra),
    )


@pytest.mark.parametrize("resend", [False, True], ids=["next-turn", "whole-history"])
def test_an_http_session_continues_and_reports_cached_tokens(service, client, resend):
    history: list[dict] = []
    session, previous = None, 0
    for i, question in enumerate(QUESTIONS):
        history.append(dict(role="user", content=question))
        sent = history if resend or session is None else history[-1:]
        extra = dict(session_id=session) if session else dict(new_session=True)
        answer = chat(client, sent, **extra)
        session = answer.model_extra["blockspec"]["session_id"]
        cached = answer.usage.prompt_tokens_details.cached_tokens
        if i:
            assert cached >= 0.9 * previous, (i, cached, previous)
        history.append(dict(role="assistant", content=answer.choices[0].message.content))
        previous = answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_stateless_client_reuses_the_longest_cached_prefix(service, client):
    history: list[dict] = [dict(role="system", content=f"Conversation {time.time_ns()}.")]
    previous = 0
    for i, question in enumerate(QUESTIONS):
        history.append(dict(role="user", content=question))
        answer = chat(client, history)
        cached = answer.usage.prompt_tokens_details.cached_tokens
        if i:
            assert cached >= 0.9 * previous, (i, cached, previous)
        history.append(dict(role="assistant", content=answer.choices[0].message.content))
        previous = answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_session_of_prompt_text_refuses_messages(service):
    stub = service["stub"]
    first = stub.Generate(pb.GenerateRequest(prompt="Hello", new_session=True, **TURN))
    with pytest.raises(Exception) as refused:
        stub.Generate(
            pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")],
                               session_id=first.session_id, **TURN)
        )  # fmt: skip
    assert "messages: this session was started with prompt text" in str(refused.value)
