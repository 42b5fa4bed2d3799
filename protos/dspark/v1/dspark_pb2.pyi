from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_BONUS: _ClassVar[Outcome]
    OUTCOME_RECOVERED: _ClassVar[Outcome]
    OUTCOME_FIRST: _ClassVar[Outcome]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_BONUS: Outcome
OUTCOME_RECOVERED: Outcome
OUTCOME_FIRST: Outcome

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "min_tokens", "logit_bias", "stop_token_ids", "logprobs", "prompt_logprobs", "allowed_token_ids", "bad_words", "grammar", "typical_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    prompt_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    grammar: Grammar
    typical_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., typical_p: _Optional[float] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "top", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SparseQ(_message.Message):
    __slots__ = ("width", "token_ids", "probs")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    width: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: Tensor
    def __init__(self, width: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("tokens", "q", "confidences", "peaks", "ahead", "fanout")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    PEAKS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: SparseQ
    confidences: _containers.RepeatedScalarFieldContainer[float]
    peaks: _containers.RepeatedScalarFieldContainer[float]
    ahead: bool
    fanout: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseQ, _Mapping]] = ..., confidences: _Optional[_Iterable[float]] = ..., peaks: _Optional[_Iterable[float]] = ..., ahead: _Optional[bool] = ..., fanout: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "params", "resume_ids", "feature_dtype", "traceparent", "share_prefix_of", "plain_depth", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    SHARE_PREFIX_OF_FIELD_NUMBER: _ClassVar[int]
    PLAIN_DEPTH_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    resume_ids: _containers.RepeatedScalarFieldContainer[int]
    feature_dtype: DType
    traceparent: str
    share_prefix_of: str
    plain_depth: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., resume_ids: _Optional[_Iterable[int]] = ..., feature_dtype: _Optional[_Union[DType, str]] = ..., traceparent: _Optional[str] = ..., share_prefix_of: _Optional[str] = ..., plain_depth: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("request_id", "cycle", "emitted", "committed", "features", "logprobs", "prompt_logprobs", "feature_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    EMITTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    emitted: _containers.RepeatedScalarFieldContainer[int]
    committed: int
    features: Tensor
    logprobs: TokenLogprobs
    prompt_logprobs: TokenLogprobs
    feature_start: int
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., emitted: _Optional[_Iterable[int]] = ..., committed: _Optional[int] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., feature_start: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "cycle", "draft", "feature_dtype", "traceparent", "plain_depth", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PLAIN_DEPTH_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    draft: DraftBlock
    feature_dtype: DType
    traceparent: str
    plain_depth: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., draft: _Optional[_Union[DraftBlock, _Mapping]] = ..., feature_dtype: _Optional[_Union[DType, str]] = ..., traceparent: _Optional[str] = ..., plain_depth: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("request_id", "cycle", "emitted", "num_drafts", "num_accepted", "outcome", "feature_start", "features", "committed", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    EMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    emitted: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: int
    num_accepted: int
    outcome: Outcome
    feature_start: int
    features: Tensor
    committed: int
    logprobs: TokenLogprobs
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., emitted: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[int] = ..., num_accepted: _Optional[int] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., feature_start: _Optional[int] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., committed: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpsPoint(_message.Message):
    __slots__ = ("batch_tokens", "step_ms")
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    batch_tokens: int
    step_ms: float
    def __init__(self, batch_tokens: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("model", "vocab_size", "max_len", "num_slots", "tap_layers", "hidden_size", "sps", "engine_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TAP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_len: int
    num_slots: int
    tap_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    sps: _containers.RepeatedCompositeFieldContainer[SpsPoint]
    engine_id: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_len: _Optional[int] = ..., num_slots: _Optional[int] = ..., tap_layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., sps: _Optional[_Iterable[_Union[SpsPoint, _Mapping]]] = ..., engine_id: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("running", "waiting", "kv_used", "kv_total", "step_ms_ema", "steps", "streams", "batch_tokens")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_EMA_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    step_ms_ema: float
    steps: int
    streams: int
    batch_tokens: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used: _Optional[int] = ..., kv_total: _Optional[int] = ..., step_ms_ema: _Optional[float] = ..., steps: _Optional[int] = ..., streams: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("request_id", "context_ids", "features", "params", "cycle", "traceparent", "method", "output_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    params: SamplingParams
    cycle: int
    traceparent: str
    method: str
    output_start: int
    def __init__(self, request_id: _Optional[str] = ..., context_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cycle: _Optional[int] = ..., traceparent: _Optional[str] = ..., method: _Optional[str] = ..., output_start: _Optional[int] = ...) -> None: ...

class OpenReply(_message.Message):
    __slots__ = ("context_length", "method", "block_size")
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    context_length: int
    method: str
    block_size: int
    def __init__(self, context_length: _Optional[int] = ..., method: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "cycle", "new_ids", "feature_start", "features", "gamma", "traceparent", "ahead", "accept", "taken")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    NEW_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    new_ids: _containers.RepeatedScalarFieldContainer[int]
    feature_start: int
    features: Tensor
    gamma: int
    traceparent: str
    ahead: bool
    accept: _containers.RepeatedScalarFieldContainer[float]
    taken: bool
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., new_ids: _Optional[_Iterable[int]] = ..., feature_start: _Optional[int] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., gamma: _Optional[int] = ..., traceparent: _Optional[str] = ..., ahead: _Optional[bool] = ..., accept: _Optional[_Iterable[float]] = ..., taken: _Optional[bool] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("request_id", "cycle", "block", "pushed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    block: DraftBlock
    pushed: _containers.RepeatedCompositeFieldContainer[PushedBlock]
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., block: _Optional[_Union[DraftBlock, _Mapping]] = ..., pushed: _Optional[_Iterable[_Union[PushedBlock, _Mapping]]] = ...) -> None: ...

class PushedBlock(_message.Message):
    __slots__ = ("accepted", "token", "block")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token: int
    block: DraftBlock
    def __init__(self, accepted: _Optional[int] = ..., token: _Optional[int] = ..., block: _Optional[_Union[DraftBlock, _Mapping]] = ...) -> None: ...

class DrafterLoadReply(_message.Message):
    __slots__ = ("contexts", "streams", "queued", "step_ms_ema", "steps")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_EMA_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    contexts: int
    streams: int
    queued: int
    step_ms_ema: float
    steps: int
    def __init__(self, contexts: _Optional[int] = ..., streams: _Optional[int] = ..., queued: _Optional[int] = ..., step_ms_ema: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class Speculative(_message.Message):
    __slots__ = ("method", "policy", "gamma", "min_tokens_per_s", "ahead")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    method: str
    policy: str
    gamma: int
    min_tokens_per_s: float
    ahead: bool
    def __init__(self, method: _Optional[str] = ..., policy: _Optional[str] = ..., gamma: _Optional[int] = ..., min_tokens_per_s: _Optional[float] = ..., ahead: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "prompt", "params", "stop", "stop_token_ids", "speculative", "ignore_eos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    params: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculative: Speculative
    ignore_eos: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., speculative: _Optional[_Union[Speculative, _Mapping]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "prompt_tokens", "completion_tokens", "cycle", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cycle: int
    logprobs: TokenLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cycle: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...
