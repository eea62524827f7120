"""Checking a wire request against a deployment's limits, and the messages between the gateway
and a replica.

The checks are pure functions of (request, limits): the gateway runs them before a request
reaches any replica, so a bad request costs nothing and disturbs nobody. Method, K, γ and the
context budget are checked by the same functions the engine uses (service/engine.py).

Messages (dataclasses, pickled by Ray on the way): the gateway sends a replica one
:class:`GenerateJob`; the replica streams back :class:`TokensEvent` per decode step that produced
tokens, then one :class:`FinishedEvent`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from protos import blockspec_pb2 as pb
from service.engine import InvalidArgument, check_context, check_method
from workers.models import render_chat


@dataclass
class GenerateJob:
    """A checked request, as the gateway sends it to a replica (defaults filled in)."""

    prompt_ids: list[int]  # a session's history, then this request's prompt
    max_new_tokens: int
    method: str
    k: int
    gamma: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # the gateway adds EOS
    session_id: str | None = None
    deadline: float | None = None  # time.time() seconds; None: none


@dataclass
class TokensEvent:
    """New output tokens of one decode step."""

    token_ids: list[int]


@dataclass
class SpeculationStats:
    """A finished request's speculation stats (the fields of pb.SpeculationStats)."""

    target_calls: int
    accepted_tokens: int  # draft tokens accepted, all steps
    tokens_per_call: float  # block efficiency
    accepted_per_position: list[int]  # [γ]: steps that accepted draft position i
    cached_prompt_tokens: int  # prompt tokens whose KV a parked session supplied
    mean_batch_size: float
    step_ms: dict[str, float]  # mean wall ms per step by phase (StepTimes.PHASES)
    steps_by_config: dict[str, int]  # steps per "none" / "method/K/γ"


@dataclass
class FinishedEvent:
    """The end of a request's stream."""

    finish_reason: str  # "length" | "stop"
    stats: SpeculationStats | None  # None when the gateway stopped it (a stop string)
    replica: str  # the replica that served it ("" when unknown)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_new_tokens: int
    max_k: int
    max_gamma: int
    default_method: str
    default_gamma: int
    default_max_new_tokens: int

    @staticmethod
    def from_info(info: dict[str, Any]) -> Limits:
        return Limits(**{name: info[name] for name in Limits.__dataclass_fields__})


# Size limits checked before any work (tokenizing, stop-string matching on every chunk).
CHARS_PER_POSITION = 32  # more text per context position cannot fit: refused untokenized
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_STOP_TOKEN_IDS = 64


def check_sizes(req: pb.GenerateRequest, limits: Limits) -> None:
    """Raise InvalidArgument, naming the field, for a request too large to be worth reading."""
    most = CHARS_PER_POSITION * limits.max_context
    text = len(req.prompt) + sum(len(m.content) + len(m.role) for m in req.messages)
    if text > most:
        field = "messages" if req.messages else "prompt"
        raise InvalidArgument(
            f"{field}: {text} characters cannot fit the model context ({limits.max_context} tokens)"
        )
    if len(req.prompt_token_ids) > limits.max_context:
        raise InvalidArgument(
            f"prompt_token_ids: {len(req.prompt_token_ids)} ids exceed the model context "
            f"({limits.max_context})"
        )
    if len(req.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in req.stop):
        raise InvalidArgument(
            f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters"
        )
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")


def prompt_ids(req: pb.GenerateRequest, tokenizer) -> list[int]:
    """The request's prompt as token ids: exactly one of prompt / prompt_token_ids / messages
    (rendered with the tokenizer's chat template, ending in the assistant's generation prompt).
    Needs no session: the gateway runs it before it reads the session store."""
    given = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(req, f)]
    if len(given) > 1:
        raise InvalidArgument(f"{given[0]}: set one of prompt, prompt_token_ids, messages")
    if req.prompt_token_ids:
        return list(req.prompt_token_ids)
    if not req.messages:
        return tokenizer(req.prompt)["input_ids"]
    if not tokenizer.chat_template:
        raise InvalidArgument("messages: the target model has no chat template; send a prompt")
    if any(not m.role for m in req.messages):
        raise InvalidArgument("messages: every message needs a role")
    try:
        return render_chat(
            tokenizer, [{"role": m.role, "content": m.content} for m in req.messages]
        )
    except Exception as err:  # the template's own checks (jinja raise_exception)
        raise InvalidArgument(f"messages: the chat template refused them: {err}") from None


def check_request(
    req: pb.GenerateRequest, limits: Limits, prompt_ids: list[int], history_len: int = 0
) -> GenerateJob:
    """The replica's job for `req` (prompt already tokenized into `prompt_ids`; a session's
    `history_len` tokens come before it, and the caller prepends them). Raises InvalidArgument
    naming the field."""
    if not prompt_ids:
        raise InvalidArgument("prompt: empty (set prompt, prompt_token_ids or messages)")
    if req.messages and history_len:
        # A template renders a whole conversation (some add a system turn when the first message
        # is not one), so new turns cannot be rendered alone: the session holds tokens, not turns.
        raise InvalidArgument(
            "messages: this session already has turns; send the next turn as prompt text "
            "(render it with Info.chat_template)"
        )
    if any(not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise InvalidArgument(f"prompt_token_ids: ids must lie in [0, {limits.vocab_size})")
    method = req.method or limits.default_method
    k = req.k or 1
    gamma = req.gamma or limits.default_gamma
    check_method(method, k, gamma, limits.max_k, limits.max_gamma)
    max_new = req.max_new_tokens or limits.default_max_new_tokens
    if not 1 <= max_new <= limits.max_new_tokens:
        raise InvalidArgument(
            f"max_new_tokens: {max_new} out of range [1, {limits.max_new_tokens}]"
        )
    temperature = req.temperature if req.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidArgument(f"temperature: must be finite and >= 0, got {temperature}")
    if req.top_k < 0:
        raise InvalidArgument(f"top_k: must be >= 0 (0 = off), got {req.top_k}")
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidArgument(f"top_p: must lie in (0, 1], got {top_p}")
    if any(not 0 <= t < limits.vocab_size for t in req.stop_token_ids):
        raise InvalidArgument(f"stop_token_ids: ids must lie in [0, {limits.vocab_size})")
    if any(not s for s in req.stop):
        raise InvalidArgument("stop: empty stop string")
    check_context(
        history_len + len(prompt_ids), max_new, method, gamma, limits.max_context, history_len
    )
    return GenerateJob(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        method=method,
        k=k,
        gamma=gamma,
        temperature=temperature,
        top_k=req.top_k,
        top_p=top_p,
        seed=req.seed if req.HasField("seed") else None,
        stop_token_ids=list(req.stop_token_ids),
        session_id=req.session_id or None,
    )
