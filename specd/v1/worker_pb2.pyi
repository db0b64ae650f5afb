from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transform(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "output_start", "min_p", "min_tokens", "suppressed_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    output_start: int
    min_p: float
    min_tokens: int
    suppressed_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., output_start: _Optional[int] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., suppressed_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Distributions(_message.Message):
    __slots__ = ("positions", "vocab_size", "probs", "token_ids", "support_offsets")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    positions: int
    vocab_size: int
    probs: bytes
    token_ids: bytes
    support_offsets: bytes
    def __init__(self, positions: _Optional[int] = ..., vocab_size: _Optional[int] = ..., probs: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., support_offsets: _Optional[bytes] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("session_id", "start", "tokens", "expires_in_ms", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    expires_in_ms: int
    cache_salt: bytes
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., expires_in_ms: _Optional[int] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("batch", "width", "ms")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    width: int
    ms: float
    def __init__(self, batch: _Optional[int] = ..., width: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class LoadCapVerdict(_message.Message):
    __slots__ = ("lower", "higher", "mean_log_ratio", "trials")
    LOWER_FIELD_NUMBER: _ClassVar[int]
    HIGHER_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOG_RATIO_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    lower: int
    higher: int
    mean_log_ratio: float
    trials: int
    def __init__(self, lower: _Optional[int] = ..., higher: _Optional[int] = ..., mean_log_ratio: _Optional[float] = ..., trials: _Optional[int] = ...) -> None: ...

class LoadCapLevel(_message.Message):
    __slots__ = ("model_pair", "load", "cap", "verdicts")
    MODEL_PAIR_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    model_pair: str
    load: int
    cap: int
    verdicts: _containers.RepeatedCompositeFieldContainer[LoadCapVerdict]
    def __init__(self, model_pair: _Optional[str] = ..., load: _Optional[int] = ..., cap: _Optional[int] = ..., verdicts: _Optional[_Iterable[_Union[LoadCapVerdict, _Mapping]]] = ...) -> None: ...

class LoadCapTable(_message.Message):
    __slots__ = ("levels",)
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    levels: _containers.RepeatedCompositeFieldContainer[LoadCapLevel]
    def __init__(self, levels: _Optional[_Iterable[_Union[LoadCapLevel, _Mapping]]] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("carrier",)
    class CarrierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CARRIER_FIELD_NUMBER: _ClassVar[int]
    carrier: _containers.ScalarMap[str, str]
    def __init__(self, carrier: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("name", "weights_digest", "tokenizer_fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights_digest: str
    tokenizer_fingerprint: str
    def __init__(self, name: _Optional[str] = ..., weights_digest: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("delta", "draft_length", "transform", "seed", "draft_model", "trace_context", "min_confidence", "vocab_limit", "expected_model", "pre_draft", "recovery", "grammar")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRANSFORM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MODEL_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    delta: SequenceDelta
    draft_length: int
    transform: Transform
    seed: int
    draft_model: str
    trace_context: TraceContext
    min_confidence: float
    vocab_limit: int
    expected_model: ModelIdentity
    pre_draft: PreDraft
    recovery: Recovery
    grammar: str
    def __init__(self, delta: _Optional[_Union[SequenceDelta, _Mapping]] = ..., draft_length: _Optional[int] = ..., transform: _Optional[_Union[Transform, _Mapping]] = ..., seed: _Optional[int] = ..., draft_model: _Optional[str] = ..., trace_context: _Optional[_Union[TraceContext, _Mapping]] = ..., min_confidence: _Optional[float] = ..., vocab_limit: _Optional[int] = ..., expected_model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., pre_draft: _Optional[_Union[PreDraft, _Mapping]] = ..., recovery: _Optional[_Union[Recovery, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("target_row", "uniform")
    TARGET_ROW_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_FIELD_NUMBER: _ClassVar[int]
    target_row: Distributions
    uniform: float
    def __init__(self, target_row: _Optional[_Union[Distributions, _Mapping]] = ..., uniform: _Optional[float] = ...) -> None: ...

class PreDraft(_message.Message):
    __slots__ = ("draft_length", "seed")
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    draft_length: int
    seed: int
    def __init__(self, draft_length: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_tokens", "draft_token_probs", "recovered_token", "forward_ms", "batch", "pre_drafted")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_probs: _containers.RepeatedScalarFieldContainer[float]
    recovered_token: int
    forward_ms: float
    batch: BatchInfo
    pre_drafted: bool
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., draft_token_probs: _Optional[_Iterable[float]] = ..., recovered_token: _Optional[int] = ..., forward_ms: _Optional[float] = ..., batch: _Optional[_Union[BatchInfo, _Mapping]] = ..., pre_drafted: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("delta", "draft_tokens", "transform", "trace_context", "draft_token_probs", "uniforms", "run_ahead_steps", "logprobs", "allowed_tokens", "ahead_uniforms", "expected_model")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFORM_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    RUN_AHEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MODEL_FIELD_NUMBER: _ClassVar[int]
    delta: SequenceDelta
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    transform: Transform
    trace_context: TraceContext
    draft_token_probs: _containers.RepeatedScalarFieldContainer[float]
    uniforms: _containers.RepeatedScalarFieldContainer[float]
    run_ahead_steps: int
    logprobs: int
    allowed_tokens: bytes
    ahead_uniforms: _containers.RepeatedScalarFieldContainer[float]
    expected_model: ModelIdentity
    def __init__(self, delta: _Optional[_Union[SequenceDelta, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., transform: _Optional[_Union[Transform, _Mapping]] = ..., trace_context: _Optional[_Union[TraceContext, _Mapping]] = ..., draft_token_probs: _Optional[_Iterable[float]] = ..., uniforms: _Optional[_Iterable[float]] = ..., run_ahead_steps: _Optional[int] = ..., logprobs: _Optional[int] = ..., allowed_tokens: _Optional[bytes] = ..., ahead_uniforms: _Optional[_Iterable[float]] = ..., expected_model: _Optional[_Union[ModelIdentity, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("target_argmax", "target_probs", "forward_ms", "batch", "accepted", "bonus_token", "ran_ahead", "logprobs")
    TARGET_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RAN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    target_argmax: _containers.RepeatedScalarFieldContainer[int]
    target_probs: Distributions
    forward_ms: float
    batch: BatchInfo
    accepted: int
    bonus_token: int
    ran_ahead: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, target_argmax: _Optional[_Iterable[int]] = ..., target_probs: _Optional[_Union[Distributions, _Mapping]] = ..., forward_ms: _Optional[float] = ..., batch: _Optional[_Union[BatchInfo, _Mapping]] = ..., accepted: _Optional[int] = ..., bonus_token: _Optional[int] = ..., ran_ahead: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token", "top_ids", "top_logprobs", "row")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    token: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    row: bytes
    def __init__(self, token: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., row: _Optional[bytes] = ...) -> None: ...

class BatchInfo(_message.Message):
    __slots__ = ("size", "tokens", "queue_ms", "forwards", "sessions", "cached_tokens")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    size: int
    tokens: int
    queue_ms: float
    forwards: int
    sessions: int
    cached_tokens: int
    def __init__(self, size: _Optional[int] = ..., tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., forwards: _Optional[int] = ..., sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StepStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ProposeSteps(_message.Message):
    __slots__ = ("steps", "ended_sessions")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ENDED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[ProposeStep]
    ended_sessions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, steps: _Optional[_Iterable[_Union[ProposeStep, _Mapping]]] = ..., ended_sessions: _Optional[_Iterable[str]] = ...) -> None: ...

class ProposeStep(_message.Message):
    __slots__ = ("step_id", "request")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request: ProposeRequest
    def __init__(self, step_id: _Optional[int] = ..., request: _Optional[_Union[ProposeRequest, _Mapping]] = ...) -> None: ...

class ProposeResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("step_id", "status", "response")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    status: StepStatus
    response: ProposeResponse
    def __init__(self, step_id: _Optional[int] = ..., status: _Optional[_Union[StepStatus, _Mapping]] = ..., response: _Optional[_Union[ProposeResponse, _Mapping]] = ...) -> None: ...

class VerifySteps(_message.Message):
    __slots__ = ("steps", "ended_sessions")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ENDED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[VerifyStep]
    ended_sessions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, steps: _Optional[_Iterable[_Union[VerifyStep, _Mapping]]] = ..., ended_sessions: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyStep(_message.Message):
    __slots__ = ("step_id", "request")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request: VerifyRequest
    def __init__(self, step_id: _Optional[int] = ..., request: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifyResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("step_id", "status", "response")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    status: StepStatus
    response: VerifyResponse
    def __init__(self, step_id: _Optional[int] = ..., status: _Optional[_Union[StepStatus, _Mapping]] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "max_context", "tokenizer_fingerprint", "tokenizer_files", "eos_token_ids", "weights_digest", "parameter_bytes", "card_json", "model_path", "forward_costs")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    CARD_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COSTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_context: int
    tokenizer_fingerprint: str
    tokenizer_files: _containers.ScalarMap[str, bytes]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    weights_digest: str
    parameter_bytes: int
    card_json: str
    model_path: str
    forward_costs: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., weights_digest: _Optional[str] = ..., parameter_bytes: _Optional[int] = ..., card_json: _Optional[str] = ..., model_path: _Optional[str] = ..., forward_costs: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ...) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("models", "protocol")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    protocol: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., protocol: _Optional[int] = ...) -> None: ...
