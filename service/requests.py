"""The request contract, from the edge to the engine: what a client asked for
(:class:`RequestParams`, parsed by the gRPC gateway or the HTTP API), the one validator that
checks it against a deployment's :class:`Limits` (:class:`RequestValidator`), and the frozen
:class:`GenerationRequest` it builds, which the gateway sends to a replica and the engine runs
as it is (the engine does not check it again).

Every bound lives here, and so does every INVALID_ARGUMENT message: :class:`InvalidArgument`
carries the field at fault as data (the gateway answers "field: message", the HTTP API names it
as OpenAI's ``param``). The checks are pure functions of (params, limits): the gateway runs them
before a request reaches any replica, so a bad request costs nothing and disturbs nobody. Code
that drives an engine directly (tests, scripts, ``blockspec generate --local``) builds its
requests through the same validator (:func:`make_request`).

Messages between the gateway and a replica (dataclasses, pickled by Ray on the way): the gateway
sends a replica one :class:`GenerationRequest`; the replica streams back :class:`TokensEvent`
per decode step that produced tokens, then one :class:`FinishedEvent`. :class:`ReplicaInfo` and
:class:`ReplicaStats` are a replica's description and counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blockspec.service.policy import AUTO, PLAIN
from blockspec.verification import VERIFIERS
from blockspec.workers.models import render_chat
from blockspec.workers.sampling import SamplingParams

if TYPE_CHECKING:  # the engine imports this module
    from blockspec.service.results import RequestStats


class InvalidArgument(ValueError):
    """A request field the caller got wrong (gRPC INVALID_ARGUMENT, HTTP 400): `field` names it
    (the wire contract's name), `message` says what is wrong with it, `code` which kind of wrong
    it is, in OpenAI's words (the HTTP API's error ``code``)."""

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(field, message, code)  # all in args: Ray pickles the exception by them
        self.field, self.message, self.code = field, message, code

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class Limits:
    """What a deployment can serve: the bounds the validator checks a request against, and the
    defaults it fills in. max_k / max_gamma None: no bound beyond >= 1 (an engine driven
    directly)."""

    vocab_size: int
    max_context: int  # cache positions per request
    max_new_tokens: int
    max_k: int | None
    max_gamma: int | None
    default_method: str
    default_gamma: int
    default_max_new_tokens: int

    @staticmethod
    def for_engine(vocab_size: int, max_context: int) -> Limits:
        """An engine's own limits, without a deployment's caps on K, γ and output length."""
        return Limits(vocab_size, max_context, max_context, None, None, "block", 4, 128)


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class RequestParams:
    """What a client asked for, parsed from the wire (gRPC or HTTP) and not yet checked: the
    validator's input. None means the deployment's default; a prompt is exactly one of
    `prompt`, `prompt_token_ids` and `messages`."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[ChatTurn, ...] = ()
    max_new_tokens: int | None = None
    method: str | None = None
    k: int | None = None
    gamma: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: tuple[int, ...] = ()
    session_id: str = ""
    new_session: bool = False
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request with its defaults filled in (built only by RequestValidator): what the
    gateway sends a replica and the engine runs."""

    prompt_ids: tuple[int, ...]  # a session's history, then this request's prompt
    max_new_tokens: int
    method: str
    k: int  # 1 for plain decoding and auto
    gamma: int  # 1 for plain decoding
    sampling: SamplingParams
    seed: int | None  # None: the engine draws one
    stop_token_ids: tuple[int, ...] = ()  # EOS included unless the client ignores it
    stop: tuple[str, ...] = ()  # stop strings: the gateway's detokenizer cuts them
    session_id: str | None = None  # park the KV under this key when finished (max_sessions > 0)
    # Without a session: whose cached prefixes this request may reuse and leave its own KV to
    # (the caller's principal; automatic prefix caching); None: neither.
    cache_scope: str | None = None
    deadline: float | None = None  # time.time() seconds; None: none
    # The caller reads the tokens only when the request finishes (a unary call without stop
    # strings): the replica sends the first step's tokens, then the rest with the finish,
    # rather than an event a step (each is a message between processes, and CPU on both ends)
    read_at_end: bool = False


@dataclass
class TokensEvent:
    """New output tokens of one decode step, with a request's stats so far when it has stop
    strings (what a stream cut at one finishes with; None otherwise)."""

    token_ids: list[int]
    stats: RequestStats | None
    cached_tokens: int  # prompt tokens whose KV a parked session supplied
    replica: str  # the replica serving it


@dataclass
class FinishedEvent:
    """The end of a request's stream."""

    finish_reason: str  # "length" | "stop"
    stats: RequestStats
    cached_tokens: int  # prompt tokens whose KV a parked session supplied
    replica: str  # the replica that served it ("" when unknown)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    single_path: bool
    description: str


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's models, methods and limits (the gateway's Info RPC and its validator)."""

    draft_model: str
    target_model: str
    vocab_size: int
    max_context: int
    tensor_parallel: int
    methods: tuple[MethodInfo, ...]
    default_method: str
    default_gamma: int
    default_max_new_tokens: int
    max_new_tokens: int
    max_k: int
    max_gamma: int
    max_batch: int
    max_queued: int

    def limits(self) -> Limits:
        return Limits(
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            max_new_tokens=self.max_new_tokens,
            max_k=self.max_k,
            max_gamma=self.max_gamma,
            default_method=self.default_method,
            default_gamma=self.default_gamma,
            default_max_new_tokens=self.default_max_new_tokens,
        )


@dataclass
class ReplicaStats:
    """Cumulative coordinator counters of one replica (tests, load tests, chaos runs)."""

    replica: str
    pid: int
    steps: int
    batch_sizes: dict[int, int]  # batch size -> steps that ran it
    step_seconds: dict[str, float]  # by phase (StepTimes.PHASES)
    finished: int
    cancelled: int
    rejected: int
    recoveries: int
    in_flight: int
    active: int
    parked_sessions: list[str] = field(default_factory=list)


# Size limits checked before any work (tokenizing, stop-string matching on every chunk).
CHARS_PER_POSITION = 32  # more text per context position cannot fit: refused untokenized
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_STOP_TOKEN_IDS = 64
# OpenAI's bounds, held by every wire (one contract): temperature in [0, 2], and the roles a
# chat message may have.
MAX_TEMPERATURE = 2.0
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


def context_needed(prompt_tokens: int, max_new_tokens: int, method: str, gamma: int) -> int:
    """Cache positions a request may occupy: its prompt and output, plus the last step's
    overshoot (a step scores γ draft tokens past the last output token, and emits up to γ + 1
    tokens whose KV stays even past a stop) and 2 for the tokens pending in the caches. `auto`
    needs no more than plain decoding: it only drafts as far as a request's context allows."""
    return prompt_tokens + max_new_tokens + (gamma if method not in (PLAIN, AUTO) else 0) + 2


def _check_range(name: str, value: int, most: int | None) -> None:
    if most is None and value < 1:
        raise InvalidArgument(name, f"{value} must be >= 1", "integer_below_min_value")
    if most is not None and not 1 <= value <= most:
        code = "integer_below_min_value" if value < 1 else "integer_above_max_value"
        raise InvalidArgument(name, f"{value} out of range [1, {most}]", code)


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidArgument(name, f"ids must lie in [0, {vocab_size})")


class RequestValidator:
    """The one place a request is checked: against `limits`, with `tokenizer` (None: token-id
    prompts only, no EOS) for text prompts and chat messages. Two phases, because the gateway
    reads the session store in between: `prompt_ids` needs no session, `request` builds the
    engine's request after the session's history."""

    def __init__(self, limits: Limits, tokenizer=None):
        self.limits, self.tokenizer = limits, tokenizer

    def prompt_ids(self, params: RequestParams) -> list[int]:
        """The request's prompt as token ids (chat messages rendered with the tokenizer's
        template, ending in the assistant's generation prompt), after the size checks that
        come before any work."""
        self._check_sizes(params)
        _check_roles(params.messages)
        given = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(params, f)]
        if len(given) > 1:
            raise InvalidArgument(given[0], "set one of prompt, prompt_token_ids, messages")
        if params.new_session and params.session_id:
            raise InvalidArgument("new_session", "set it or session_id, not both")
        if params.prompt_token_ids or not (params.prompt or params.messages):
            return list(params.prompt_token_ids)
        if self.tokenizer is None:
            raise InvalidArgument(given[0], "this engine takes prompt_token_ids only")
        if not params.messages:
            return self.tokenizer(params.prompt)["input_ids"]
        return self._render(params.messages)

    def continue_conversation(
        self, stored: Sequence[ChatTurn], messages: tuple[ChatTurn, ...], spoken: Sequence[int]
    ) -> tuple[tuple[ChatTurn, ...], list[int]]:
        """A chat session's next prompt: its stored turns and the new ones, rendered whole with
        the chat template (a template renders a conversation, not a turn: some add a system
        turn or mark the last one). Returns (all the turns, their token ids).

        A client may send only the next turn, or, as every OpenAI client does, the whole
        conversation again: messages that begin with the stored turns add only the rest.

        `spoken` are the session's tokens so far (the last prompt and the reply as generated).
        Where the rendered text begins with their text, the prompt is those very tokens and
        the rest of the text tokenized: the replica's parked KV then covers the whole history.
        Tokenizing the reply's text again could split it otherwise than the model generated
        it, and the cache would cover only up to the first difference."""
        stored = tuple(stored)
        resent = messages[: len(stored)] == stored
        new = messages[len(stored) :] if resent else messages
        if not new:
            raise InvalidArgument("messages", "no new turn: they repeat the session's history")
        turns = (*stored, *new)
        ids = self._render(turns)
        text = self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        said = self.tokenizer.decode(list(spoken), clean_up_tokenization_spaces=False)
        if not spoken or not text.startswith(said):
            return turns, ids
        rest = self.tokenizer(text[len(said) :], add_special_tokens=False)["input_ids"]
        return turns, [*spoken, *rest]

    def request(
        self,
        params: RequestParams,
        prompt_ids: list[int],
        history: Sequence[int] = (),
        session_key: str | None = None,
        cache_scope: str | None = None,
        deadline: float | None = None,
        drawn_seed: int | None = None,
    ) -> GenerationRequest:
        """The engine's request for `params`, whose prompt is `prompt_ids` (from `prompt_ids`)
        after a session's `history` (stored under `session_key`). `drawn_seed` stands in for a
        seed the client left unset (the gateway draws one, so that a retry redraws the same)."""
        limits = self.limits
        if not prompt_ids:
            raise InvalidArgument("prompt", "empty (set prompt, prompt_token_ids or messages)")
        if params.messages and history:
            # A template renders a whole conversation (some add a system turn when the first
            # message is not one), so new turns cannot follow a history of raw text: a chat
            # session keeps its turns and is rendered whole (continue_conversation).
            raise InvalidArgument(
                "messages",
                "this session was started with prompt text; continue it with prompt text",
            )
        _check_ids("prompt_token_ids", prompt_ids, limits.vocab_size)
        method, k, gamma = self._speculation(params)
        max_new = _default(params.max_new_tokens, limits.default_max_new_tokens)
        _check_range("max_new_tokens", max_new, limits.max_new_tokens)
        sampling = _sampling(params)
        seed = _default(params.seed, drawn_seed)
        if seed is not None and not 0 <= seed < 1 << 64:
            raise InvalidArgument("seed", f"must lie in [0, 2^64), got {seed}")
        self._check_context(len(history) + len(prompt_ids), max_new, method, gamma, len(history))
        return GenerationRequest(
            prompt_ids=(*history, *prompt_ids),
            max_new_tokens=max_new,
            method=method,
            k=k,
            gamma=gamma,
            sampling=sampling,
            seed=seed,
            stop_token_ids=self._stop_token_ids(params),
            stop=self._stop_strings(params),
            session_id=session_key,
            cache_scope=None if session_key else cache_scope,
            deadline=deadline,
        )

    # ------------------------------------------------------------------------- the checks
    def _check_sizes(self, params: RequestParams) -> None:
        """Refuse a request too large to be worth reading (before tokenizing it)."""
        most_chars = CHARS_PER_POSITION * self.limits.max_context
        chars = len(params.prompt) + sum(len(m.content) + len(m.role) for m in params.messages)
        if chars > most_chars:
            raise InvalidArgument(
                "messages" if params.messages else "prompt",
                f"{chars} characters cannot fit the model context "
                f"({self.limits.max_context} tokens)",
            )
        if len(params.prompt_token_ids) > self.limits.max_context:
            raise InvalidArgument(
                "prompt_token_ids",
                f"{len(params.prompt_token_ids)} ids exceed the model context "
                f"({self.limits.max_context})",
            )
        if len(params.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in params.stop):
            raise InvalidArgument(
                "stop",
                f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
                "array_above_max_length",
            )
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", "array_above_max_length"
            )

    def _render(self, messages: tuple[ChatTurn, ...]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidArgument(
                "messages", "the target model has no chat template; send a prompt"
            )
        try:
            return render_chat(
                self.tokenizer, [{"role": m.role, "content": m.content} for m in messages]
            )
        except Exception as err:  # the template's own checks (jinja raise_exception)
            raise InvalidArgument("messages", f"the chat template refused them: {err}") from None

    def _speculation(self, params: RequestParams) -> tuple[str, int, int]:
        """(method, K, γ) with the defaults filled in; plain decoding runs with K = γ = 1 and
        auto chooses K and γ itself (service/policy.py), so their k and gamma are ignored (but
        an explicit k or gamma below 1 is a mistake whatever the method)."""
        limits = self.limits
        method = params.method or limits.default_method
        k = _default(params.k, 1)
        gamma = _default(params.gamma, limits.default_gamma)
        if method not in (PLAIN, AUTO) and method not in VERIFIERS:
            raise InvalidArgument(
                "method",
                f"unknown {method!r}; expected none, auto or one of {', '.join(VERIFIERS)}",
            )
        for name in ("k", "gamma"):
            if getattr(params, name) is not None:
                _check_range(name, getattr(params, name), None)
        if method == PLAIN:
            return method, 1, 1
        if method == AUTO:
            return method, 1, gamma
        _check_range("k", k, limits.max_k)
        if VERIFIERS[method].single_path and k != 1:
            raise InvalidArgument("k", f"method {method!r} verifies a single path; k must be 1")
        _check_range("gamma", gamma, limits.max_gamma)
        return method, k, gamma

    def _check_context(
        self, prompt_tokens: int, max_new_tokens: int, method: str, gamma: int, history: int
    ) -> None:
        """Refuse a request that cannot fit the context; `history` of the prompt tokens came
        from a session (named in the message)."""
        most = self.limits.max_context
        if context_needed(prompt_tokens, max_new_tokens, method, gamma) > most:
            where = f" ({history} from the session)" if history else ""
            raise InvalidArgument(
                "prompt",
                f"{prompt_tokens} tokens{where} + max_new_tokens {max_new_tokens} + γ "
                f"exceed the model context ({most})",
                "context_length_exceeded",
            )

    def _stop_token_ids(self, params: RequestParams) -> tuple[int, ...]:
        _check_ids("stop_token_ids", params.stop_token_ids, self.limits.vocab_size)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None or params.ignore_eos:
            return params.stop_token_ids
        return (*params.stop_token_ids, eos)

    @staticmethod
    def _stop_strings(params: RequestParams) -> tuple[str, ...]:
        if any(not s for s in params.stop):
            raise InvalidArgument("stop", "empty stop string")
        return params.stop


def _default(value, default):
    return default if value is None else value


def _check_roles(messages: tuple[ChatTurn, ...]) -> None:
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role",
                f"{m.role!r} is not a role; expected one of {', '.join(CHAT_ROLES)}",
            )


def _sampling(params: RequestParams) -> SamplingParams:
    temperature = _default(params.temperature, 1.0)
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        code = "decimal_above_max_value" if temperature > MAX_TEMPERATURE else "invalid_value"
        if temperature < 0:
            code = "decimal_below_min_value"
        raise InvalidArgument(
            "temperature", f"must lie in [0, {MAX_TEMPERATURE:g}], got {temperature}", code
        )
    top_k = _default(params.top_k, 0)
    if top_k < 0:
        raise InvalidArgument(
            "top_k", f"must be >= 0 (0 = off), got {top_k}", "integer_below_min_value"
        )
    top_p = _default(params.top_p, 1.0)
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        code = "decimal_above_max_value" if top_p > 1 else "invalid_value"
        if top_p <= 0:
            code = "decimal_below_min_value"
        raise InvalidArgument("top_p", f"must lie in (0, 1], got {top_p}", code)
    return SamplingParams(temperature, top_k, top_p)


def make_request(
    limits: Limits,
    prompt_ids: Sequence[int],
    max_new_tokens: int | None = None,
    method: str | None = None,
    k: int | None = None,
    gamma: int | None = None,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    session_id: str | None = None,
    cache_scope: str | None = None,
) -> GenerationRequest:
    """A checked request from token ids, for an engine driven directly (tests, scripts,
    ``blockspec generate --local``): the validator's, against `limits` (an engine's own:
    `SpeculativeEngine.limits`). Raises InvalidArgument."""
    sampling = sampling or SamplingParams()
    params = RequestParams(
        prompt_token_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        method=method,
        k=k,
        gamma=gamma,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=seed,
        stop_token_ids=tuple(stop_token_ids),
        session_id=session_id or "",
    )
    validator = RequestValidator(limits)
    ids = validator.prompt_ids(params)
    return validator.request(params, ids, session_key=session_id, cache_scope=cache_scope)
