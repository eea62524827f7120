"""Checking a wire request against a deployment's limits: defaults filled in, bad fields named.

Pure functions of (request, limits): the gateway runs them before a request reaches any replica,
so a bad request costs nothing and disturbs nobody.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from protos import blockspec_pb2 as pb
from service.engine import PLAIN
from service.verification import VERIFIERS


class InvalidArgument(ValueError):
    """A request field is out of range (INVALID_ARGUMENT); the message starts with its name."""


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


def prompt_ids(req: pb.GenerateRequest, tokenizer, continues_session: bool) -> list[int]:
    """The request's prompt as token ids: exactly one of prompt / prompt_token_ids / messages
    (rendered with the tokenizer's chat template, ending in the assistant's generation prompt)."""
    given = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(req, f)]
    if len(given) > 1:
        raise InvalidArgument(f"{given[0]}: set one of prompt, prompt_token_ids, messages")
    if req.prompt_token_ids:
        return list(req.prompt_token_ids)
    if not req.messages:
        return tokenizer(req.prompt)["input_ids"]
    if not tokenizer.chat_template:
        raise InvalidArgument("messages: the target model has no chat template; send a prompt")
    if continues_session:
        # A template renders a whole conversation (some add a system turn when the first message
        # is not one), so new turns cannot be rendered alone: the session holds tokens, not turns.
        raise InvalidArgument(
            "messages: this session already has turns; send the next turn as prompt text "
            "(render it with Info.chat_template)"
        )
    if any(not m.role for m in req.messages):
        raise InvalidArgument("messages: every message needs a role")
    turns = [{"role": m.role, "content": m.content} for m in req.messages]
    try:
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # the template's own checks (jinja raise_exception)
        raise InvalidArgument(f"messages: the chat template refused them: {err}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_request(
    req: pb.GenerateRequest, limits: Limits, prompt_ids: list[int], history_len: int = 0
) -> dict[str, Any]:
    """The replica's payload for `req` (prompt already tokenized into `prompt_ids`; a session's
    `history_len` tokens come before it). Raises InvalidArgument naming the field."""
    if not prompt_ids:
        raise InvalidArgument("prompt: empty (set prompt or prompt_token_ids)")
    if any(not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise InvalidArgument(f"prompt_token_ids: ids must lie in [0, {limits.vocab_size})")
    method = req.method or limits.default_method
    if method != PLAIN and method not in VERIFIERS:
        raise InvalidArgument(
            f"method: unknown {method!r}; expected none or one of {', '.join(VERIFIERS)}"
        )
    k = req.k or 1
    gamma = req.gamma or limits.default_gamma
    if method != PLAIN:
        if not 1 <= k <= limits.max_k:
            raise InvalidArgument(f"k: {k} out of range [1, {limits.max_k}]")
        if VERIFIERS[method].single_path and k != 1:
            raise InvalidArgument(f"k: method {method!r} verifies a single path; k must be 1")
        if not 1 <= gamma <= limits.max_gamma:
            raise InvalidArgument(f"gamma: {gamma} out of range [1, {limits.max_gamma}]")
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
    context = history_len + len(prompt_ids)
    need = context + max_new + (gamma if method != PLAIN else 0) + 2
    if need > limits.max_context:
        where = f" ({history_len} from the session)" if history_len else ""
        raise InvalidArgument(
            f"prompt: {context} tokens{where} + max_new_tokens {max_new} + γ exceed the model "
            f"context ({limits.max_context})"
        )
    return dict(
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
