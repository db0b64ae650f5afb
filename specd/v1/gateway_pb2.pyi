from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_FIXED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_FIXED: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("mode", "draft_length", "min_draft_length", "max_draft_length", "draft_model")
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    draft_length: int
    min_draft_length: int
    max_draft_length: int
    draft_model: str
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., draft_length: _Optional[int] = ..., min_draft_length: _Optional[int] = ..., max_draft_length: _Optional[int] = ..., draft_model: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "speculation", "task_type", "user_segment")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    USER_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    sampling: SamplingParams
    speculation: SpeculationParams
    task_type: str
    user_segment: str
    def __init__(self, prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., task_type: _Optional[str] = ..., user_segment: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("steps", "proposed_tokens", "accepted_tokens", "acceptance_rate", "draft_lengths", "accepted_lengths", "mean_tokens_per_step", "prompt_tokens", "generated_tokens", "draft_ms", "verify_ms", "total_ms", "seed", "draft_model", "session_reopens")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_REOPENS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    proposed_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    draft_lengths: _containers.RepeatedScalarFieldContainer[int]
    accepted_lengths: _containers.RepeatedScalarFieldContainer[int]
    mean_tokens_per_step: float
    prompt_tokens: int
    generated_tokens: int
    draft_ms: float
    verify_ms: float
    total_ms: float
    seed: int
    draft_model: str
    session_reopens: int
    def __init__(self, steps: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., draft_lengths: _Optional[_Iterable[int]] = ..., accepted_lengths: _Optional[_Iterable[int]] = ..., mean_tokens_per_step: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., seed: _Optional[int] = ..., draft_model: _Optional[str] = ..., session_reopens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "trace_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    trace_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "trace_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    trace_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...
