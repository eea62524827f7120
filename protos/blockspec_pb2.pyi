from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "method", "gamma", "k", "session_id", "stop", "stop_token_ids", "ignore_eos", "messages", "new_session")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    method: str
    gamma: int
    k: int
    session_id: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    new_session: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., method: _Optional[str] = ..., gamma: _Optional[int] = ..., k: _Optional[int] = ..., session_id: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., new_session: _Optional[bool] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("target_calls", "accepted_tokens", "tokens_per_call", "accepted_per_position", "cached_prompt_tokens", "mean_batch_size", "step_ms", "steps_by_config", "method", "k", "gamma")
    class StepsByConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TARGET_CALLS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_CONFIG_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    target_calls: int
    accepted_tokens: int
    tokens_per_call: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    cached_prompt_tokens: int
    mean_batch_size: float
    step_ms: StepBreakdown
    steps_by_config: _containers.ScalarMap[str, int]
    method: str
    k: int
    gamma: int
    def __init__(self, target_calls: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., tokens_per_call: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., cached_prompt_tokens: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., step_ms: _Optional[_Union[StepBreakdown, _Mapping]] = ..., steps_by_config: _Optional[_Mapping[str, int]] = ..., method: _Optional[str] = ..., k: _Optional[int] = ..., gamma: _Optional[int] = ...) -> None: ...

class StepBreakdown(_message.Message):
    __slots__ = ("draft", "tree", "target", "transfer", "verify", "overhead", "prefill")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    draft: float
    tree: float
    target: float
    transfer: float
    verify: float
    overhead: float
    prefill: float
    def __init__(self, draft: _Optional[float] = ..., tree: _Optional[float] = ..., target: _Optional[float] = ..., transfer: _Optional[float] = ..., verify: _Optional[float] = ..., overhead: _Optional[float] = ..., prefill: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "prompt_tokens", "session_id", "replica")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: SpeculationStats
    prompt_tokens: int
    session_id: str
    replica: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., session_id: _Optional[str] = ..., replica: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "replica", "session_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: SpeculationStats
    replica: str
    session_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., replica: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MethodInfo(_message.Message):
    __slots__ = ("name", "single_path", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SINGLE_PATH_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    single_path: bool
    description: str
    def __init__(self, name: _Optional[str] = ..., single_path: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_new_tokens", "max_k", "max_gamma", "max_context", "max_batch", "max_queued", "max_temperature", "max_stop_strings", "max_stop_chars", "max_stop_token_ids", "max_prompt_chars")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    max_k: int
    max_gamma: int
    max_context: int
    max_batch: int
    max_queued: int
    max_temperature: float
    max_stop_strings: int
    max_stop_chars: int
    max_stop_token_ids: int
    max_prompt_chars: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., max_k: _Optional[int] = ..., max_gamma: _Optional[int] = ..., max_context: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_queued: _Optional[int] = ..., max_temperature: _Optional[float] = ..., max_stop_strings: _Optional[int] = ..., max_stop_chars: _Optional[int] = ..., max_stop_token_ids: _Optional[int] = ..., max_prompt_chars: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("draft_model", "target_model", "vocab_size", "methods", "limits", "default_method", "default_gamma", "tensor_parallel", "chat_template", "default_max_new_tokens", "chat_roles")
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GAMMA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_ROLES_FIELD_NUMBER: _ClassVar[int]
    draft_model: str
    target_model: str
    vocab_size: int
    methods: _containers.RepeatedCompositeFieldContainer[MethodInfo]
    limits: Limits
    default_method: str
    default_gamma: int
    tensor_parallel: int
    chat_template: str
    default_max_new_tokens: int
    chat_roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, draft_model: _Optional[str] = ..., target_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., methods: _Optional[_Iterable[_Union[MethodInfo, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., default_method: _Optional[str] = ..., default_gamma: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., chat_template: _Optional[str] = ..., default_max_new_tokens: _Optional[int] = ..., chat_roles: _Optional[_Iterable[str]] = ...) -> None: ...
