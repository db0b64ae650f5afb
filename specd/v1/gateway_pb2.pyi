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
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "structured")
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
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadCapRow(_message.Message):
    __slots__ = ("model_pair", "load", "prior", "cap", "learned", "origin")
    MODEL_PAIR_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PRIOR_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    model_pair: str
    load: int
    prior: int
    cap: int
    learned: bool
    origin: str
    def __init__(self, model_pair: _Optional[str] = ..., load: _Optional[int] = ..., prior: _Optional[int] = ..., cap: _Optional[int] = ..., learned: _Optional[bool] = ..., origin: _Optional[str] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("mode", "draft_length", "min_draft_length", "max_draft_length", "draft_model", "policy", "min_draft_confidence", "overlap")
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    draft_length: int
    min_draft_length: int
    max_draft_length: int
    draft_model: str
    policy: str
    min_draft_confidence: float
    overlap: bool
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., draft_length: _Optional[int] = ..., min_draft_length: _Optional[int] = ..., max_draft_length: _Optional[int] = ..., draft_model: _Optional[str] = ..., policy: _Optional[str] = ..., min_draft_confidence: _Optional[float] = ..., overlap: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "speculation", "task_type", "user_segment", "n", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    USER_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    sampling: SamplingParams
    speculation: SpeculationParams
    task_type: str
    user_segment: str
    n: int
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., task_type: _Optional[str] = ..., user_segment: _Optional[str] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("steps", "proposed_tokens", "accepted_tokens", "acceptance_rate", "draft_lengths", "accepted_lengths", "mean_tokens_per_step", "prompt_tokens", "generated_tokens", "draft_ms", "verify_ms", "total_ms", "seed", "draft_model", "session_reopens", "proposed_per_position", "accepted_per_position", "task_type", "policy", "draft_cost_ratio", "verify_cost_ratio", "mean_verify_batch_size", "mean_verify_batch_tokens", "verify_queue_ms", "pre_draft_hits", "pre_draft_steps", "proposers", "cached_tokens")
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
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    MEAN_VERIFY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEAN_VERIFY_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
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
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    task_type: str
    policy: str
    draft_cost_ratio: float
    verify_cost_ratio: float
    mean_verify_batch_size: float
    mean_verify_batch_tokens: float
    verify_queue_ms: float
    pre_draft_hits: int
    pre_draft_steps: int
    proposers: _containers.RepeatedScalarFieldContainer[str]
    cached_tokens: int
    def __init__(self, steps: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., draft_lengths: _Optional[_Iterable[int]] = ..., accepted_lengths: _Optional[_Iterable[int]] = ..., mean_tokens_per_step: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., seed: _Optional[int] = ..., draft_model: _Optional[str] = ..., session_reopens: _Optional[int] = ..., proposed_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., task_type: _Optional[str] = ..., policy: _Optional[str] = ..., draft_cost_ratio: _Optional[float] = ..., verify_cost_ratio: _Optional[float] = ..., mean_verify_batch_size: _Optional[float] = ..., mean_verify_batch_tokens: _Optional[float] = ..., verify_queue_ms: _Optional[float] = ..., pre_draft_hits: _Optional[int] = ..., pre_draft_steps: _Optional[int] = ..., proposers: _Optional[_Iterable[str]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "trace_id", "logprobs", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    trace_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    choices: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., trace_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "stats", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "trace_id", "logprobs", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    trace_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., trace_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class AcceptanceStatsRequest(_message.Message):
    __slots__ = ("group_by", "filter", "window")
    class FilterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    group_by: _containers.RepeatedScalarFieldContainer[str]
    filter: _containers.ScalarMap[str, str]
    window: bool
    def __init__(self, group_by: _Optional[_Iterable[str]] = ..., filter: _Optional[_Mapping[str, str]] = ..., window: _Optional[bool] = ...) -> None: ...

class AcceptanceRow(_message.Message):
    __slots__ = ("labels", "drafts", "draft_tokens", "accepted_tokens", "emitted_tokens", "acceptance_rate", "mean_acceptance_length", "proposed_per_position", "accepted_per_position", "acceptance_by_generation_bucket")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AcceptanceByGenerationBucketEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_GENERATION_BUCKET_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    acceptance_by_generation_bucket: _containers.ScalarMap[str, float]
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., emitted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., proposed_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., acceptance_by_generation_bucket: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CostRow(_message.Message):
    __slots__ = ("model_pair", "target_step_ms", "draft_ms_per_token", "draft_cost_ratio", "verify_cost_ratio")
    class VerifyCostRatioEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_PAIR_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    model_pair: str
    target_step_ms: float
    draft_ms_per_token: float
    draft_cost_ratio: float
    verify_cost_ratio: _containers.ScalarMap[int, float]
    def __init__(self, model_pair: _Optional[str] = ..., target_step_ms: _Optional[float] = ..., draft_ms_per_token: _Optional[float] = ..., draft_cost_ratio: _Optional[float] = ..., verify_cost_ratio: _Optional[_Mapping[int, float]] = ...) -> None: ...

class AcceptanceStatsResponse(_message.Message):
    __slots__ = ("rows", "costs", "window_steps")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[AcceptanceRow]
    costs: _containers.RepeatedCompositeFieldContainer[CostRow]
    window_steps: int
    def __init__(self, rows: _Optional[_Iterable[_Union[AcceptanceRow, _Mapping]]] = ..., costs: _Optional[_Iterable[_Union[CostRow, _Mapping]]] = ..., window_steps: _Optional[int] = ...) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("name", "vocab_size", "max_context", "tokenizer_fingerprint", "weights_digest", "parameter_bytes", "card_json", "model_path", "usable", "problem", "model_free")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    CARD_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    USABLE_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FREE_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_context: int
    tokenizer_fingerprint: str
    weights_digest: str
    parameter_bytes: int
    card_json: str
    model_path: str
    usable: bool
    problem: str
    model_free: bool
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., weights_digest: _Optional[str] = ..., parameter_bytes: _Optional[int] = ..., card_json: _Optional[str] = ..., model_path: _Optional[str] = ..., usable: _Optional[bool] = ..., problem: _Optional[str] = ..., model_free: _Optional[bool] = ...) -> None: ...

class GatewayInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GatewayInfoResponse(_message.Message):
    __slots__ = ("target", "drafts", "max_draft_length", "default_draft_length", "auto_policy", "task_drafts", "draft_selection", "diagnostic_segment", "drift_min_drop", "drift_baseline_pinned", "load_caps")
    class TaskDraftsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    AUTO_POLICY_FIELD_NUMBER: _ClassVar[int]
    TASK_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SELECTION_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTIC_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_MIN_DROP_FIELD_NUMBER: _ClassVar[int]
    DRIFT_BASELINE_PINNED_FIELD_NUMBER: _ClassVar[int]
    LOAD_CAPS_FIELD_NUMBER: _ClassVar[int]
    target: ServedModel
    drafts: _containers.RepeatedCompositeFieldContainer[ServedModel]
    max_draft_length: int
    default_draft_length: int
    auto_policy: str
    task_drafts: _containers.ScalarMap[str, str]
    draft_selection: str
    diagnostic_segment: str
    drift_min_drop: float
    drift_baseline_pinned: bool
    load_caps: _containers.RepeatedCompositeFieldContainer[LoadCapRow]
    def __init__(self, target: _Optional[_Union[ServedModel, _Mapping]] = ..., drafts: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ..., max_draft_length: _Optional[int] = ..., default_draft_length: _Optional[int] = ..., auto_policy: _Optional[str] = ..., task_drafts: _Optional[_Mapping[str, str]] = ..., draft_selection: _Optional[str] = ..., diagnostic_segment: _Optional[str] = ..., drift_min_drop: _Optional[float] = ..., drift_baseline_pinned: _Optional[bool] = ..., load_caps: _Optional[_Iterable[_Union[LoadCapRow, _Mapping]]] = ...) -> None: ...
