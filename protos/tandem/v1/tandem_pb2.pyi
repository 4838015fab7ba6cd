from google.api import annotations_pb2 as _annotations_pb2
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
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class SeqStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQ_STATUS_OK: _ClassVar[SeqStatus]
    SEQ_STATUS_STALE: _ClassVar[SeqStatus]
    SEQ_STATUS_OUT_OF_MEMORY: _ClassVar[SeqStatus]
    SEQ_STATUS_INVALID: _ClassVar[SeqStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
SEQ_STATUS_OK: SeqStatus
SEQ_STATUS_STALE: SeqStatus
SEQ_STATUS_OUT_OF_MEMORY: SeqStatus
SEQ_STATUS_INVALID: SeqStatus

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
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
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StopParams(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "ignore_eos", "prompt_len")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    prompt_len: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("forward_ms", "total_ms")
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    forward_ms: float
    total_ms: float
    def __init__(self, forward_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class MemoryState(_message.Message):
    __slots__ = ("free_kv_tokens", "total_kv_tokens", "num_seqs")
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    free_kv_tokens: int
    total_kv_tokens: int
    num_seqs: int
    def __init__(self, free_kv_tokens: _Optional[int] = ..., total_kv_tokens: _Optional[int] = ..., num_seqs: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("token_ids", "parents", "draft_probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: Tensor
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_path", "architecture", "vocab_size", "max_context_len", "eos_token_ids", "algorithm", "memory", "device", "dtype", "protocol", "hidden_size", "accelerator")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    architecture: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    algorithm: str
    memory: MemoryState
    device: str
    dtype: str
    protocol: str
    hidden_size: int
    accelerator: str
    def __init__(self, model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., algorithm: _Optional[str] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., protocol: _Optional[str] = ..., hidden_size: _Optional[int] = ..., accelerator: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetPrefillSeq(_message.Message):
    __slots__ = ("seq_id", "token_ids", "sample_next_token", "sampling", "stop", "return_features", "return_logprobs", "top_logprobs", "prefill_draft", "propose_next")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NEXT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_next_token: bool
    sampling: SamplingParams
    stop: StopParams
    return_features: bool
    return_logprobs: bool
    top_logprobs: int
    prefill_draft: bool
    propose_next: SpecParams
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample_next_token: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prefill_draft: _Optional[bool] = ..., propose_next: _Optional[_Union[SpecParams, _Mapping]] = ...) -> None: ...

class TargetPrefillRequest(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[TargetPrefillSeq]
    def __init__(self, seqs: _Optional[_Iterable[_Union[TargetPrefillSeq, _Mapping]]] = ...) -> None: ...

class TargetPrefillResult(_message.Message):
    __slots__ = ("seq_id", "status", "token_ids", "finish_reason", "features", "error", "logprobs", "num_cached_tokens", "proposal")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    status: SeqStatus
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    features: Tensor
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    num_cached_tokens: int
    proposal: ProposeResult
    def __init__(self, seq_id: _Optional[str] = ..., status: _Optional[_Union[SeqStatus, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., proposal: _Optional[_Union[ProposeResult, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TargetPrefillResponse(_message.Message):
    __slots__ = ("results", "timings", "memory")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TargetPrefillResult]
    timings: StepTimings
    memory: MemoryState
    def __init__(self, results: _Optional[_Iterable[_Union[TargetPrefillResult, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ...) -> None: ...

class VerifySeq(_message.Message):
    __slots__ = ("seq_id", "committed_len", "root_token_id", "tree", "sampling", "stop", "return_features", "num_decode_steps", "return_logprobs", "top_logprobs", "propose_next")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NEXT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    committed_len: int
    root_token_id: int
    tree: DraftTree
    sampling: SamplingParams
    stop: StopParams
    return_features: bool
    num_decode_steps: int
    return_logprobs: bool
    top_logprobs: int
    propose_next: SpecParams
    def __init__(self, seq_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., root_token_id: _Optional[int] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., num_decode_steps: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., propose_next: _Optional[_Union[SpecParams, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("seqs", "batch_may_grow")
    SEQS_FIELD_NUMBER: _ClassVar[int]
    BATCH_MAY_GROW_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[VerifySeq]
    batch_may_grow: bool
    def __init__(self, seqs: _Optional[_Iterable[_Union[VerifySeq, _Mapping]]] = ..., batch_may_grow: _Optional[bool] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("seq_id", "status", "token_ids", "num_accepted_drafts", "num_draft_tokens", "finish_reason", "features", "error", "num_steps", "logprobs", "proposal")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    status: SeqStatus
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_drafts: int
    num_draft_tokens: int
    finish_reason: FinishReason
    features: Tensor
    error: str
    num_steps: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    proposal: ProposeResult
    def __init__(self, seq_id: _Optional[str] = ..., status: _Optional[_Union[SeqStatus, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ..., num_steps: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., proposal: _Optional[_Union[ProposeResult, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "timings", "memory")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    timings: StepTimings
    memory: MemoryState
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released", "memory")
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    memory: MemoryState
    def __init__(self, num_released: _Optional[int] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ...) -> None: ...

class CorpusDocument(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AddExternalCorpusRequest(_message.Message):
    __slots__ = ("corpus_id", "documents")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    documents: _containers.RepeatedCompositeFieldContainer[CorpusDocument]
    def __init__(self, corpus_id: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[CorpusDocument, _Mapping]]] = ...) -> None: ...

class RemoveExternalCorpusRequest(_message.Message):
    __slots__ = ("corpus_id",)
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    def __init__(self, corpus_id: _Optional[str] = ...) -> None: ...

class ListExternalCorporaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExternalCorpora(_message.Message):
    __slots__ = ("corpus_token_counts", "loaded_token_count")
    class CorpusTokenCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CORPUS_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    corpus_token_counts: _containers.ScalarMap[str, int]
    loaded_token_count: int
    def __init__(self, corpus_token_counts: _Optional[_Mapping[str, int]] = ..., loaded_token_count: _Optional[int] = ...) -> None: ...

class SpecParams(_message.Message):
    __slots__ = ("num_steps", "topk", "num_draft_tokens")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    topk: int
    num_draft_tokens: int
    def __init__(self, num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftPrefillSeq(_message.Message):
    __slots__ = ("seq_id", "token_ids", "features")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DraftPrefillRequest(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[DraftPrefillSeq]
    def __init__(self, seqs: _Optional[_Iterable[_Union[DraftPrefillSeq, _Mapping]]] = ...) -> None: ...

class DraftPrefillResult(_message.Message):
    __slots__ = ("seq_id", "status", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    status: SeqStatus
    error: str
    def __init__(self, seq_id: _Optional[str] = ..., status: _Optional[_Union[SeqStatus, str]] = ..., error: _Optional[str] = ...) -> None: ...

class DraftPrefillResponse(_message.Message):
    __slots__ = ("results", "timings", "memory")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftPrefillResult]
    timings: StepTimings
    memory: MemoryState
    def __init__(self, results: _Optional[_Iterable[_Union[DraftPrefillResult, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ...) -> None: ...

class ProposeSeq(_message.Message):
    __slots__ = ("seq_id", "committed_len", "new_token_ids", "features", "spec", "append_guess", "sampling")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    APPEND_GUESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    committed_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    spec: SpecParams
    append_guess: bool
    sampling: SamplingParams
    def __init__(self, seq_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., spec: _Optional[_Union[SpecParams, _Mapping]] = ..., append_guess: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[ProposeSeq]
    def __init__(self, seqs: _Optional[_Iterable[_Union[ProposeSeq, _Mapping]]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("seq_id", "status", "tree", "base_committed_len", "error", "guessed_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    BASE_COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GUESSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    status: SeqStatus
    tree: DraftTree
    base_committed_len: int
    error: str
    guessed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., status: _Optional[_Union[SeqStatus, str]] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., base_committed_len: _Optional[int] = ..., error: _Optional[str] = ..., guessed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results", "timings", "memory")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    timings: StepTimings
    memory: MemoryState
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("num_steps", "activities", "record_shapes", "with_stack", "profile_id", "output_dir")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITIES_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    activities: _containers.RepeatedScalarFieldContainer[str]
    record_shapes: bool
    with_stack: bool
    profile_id: str
    output_dir: str
    def __init__(self, num_steps: _Optional[int] = ..., activities: _Optional[_Iterable[str]] = ..., record_shapes: _Optional[bool] = ..., with_stack: _Optional[bool] = ..., profile_id: _Optional[str] = ..., output_dir: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileState(_message.Message):
    __slots__ = ("active", "files", "num_steps", "process")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    active: bool
    files: _containers.RepeatedScalarFieldContainer[str]
    num_steps: int
    process: str
    def __init__(self, active: _Optional[bool] = ..., files: _Optional[_Iterable[str]] = ..., num_steps: _Optional[int] = ..., process: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_detokenize", "return_logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_detokenize: bool
    return_logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_detokenize: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "verify_steps", "accepted_draft_tokens", "proposed_draft_tokens", "mean_accept_length", "predraft_hits", "predraft_misses", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    verify_steps: int
    accepted_draft_tokens: int
    proposed_draft_tokens: int
    mean_accept_length: float
    predraft_hits: int
    predraft_misses: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., proposed_draft_tokens: _Optional[int] = ..., mean_accept_length: _Optional[float] = ..., predraft_hits: _Optional[int] = ..., predraft_misses: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "matched_stop", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: GenerateUsage
    matched_stop: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[GenerateUsage, _Mapping]] = ..., matched_stop: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GatewayInfo(_message.Message):
    __slots__ = ("model", "speculative_algorithm", "spec", "max_context_len", "target_addresses", "draft_addresses", "protocol")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    model: str
    speculative_algorithm: str
    spec: SpecParams
    max_context_len: int
    target_addresses: _containers.RepeatedScalarFieldContainer[str]
    draft_addresses: _containers.RepeatedScalarFieldContainer[str]
    protocol: str
    def __init__(self, model: _Optional[str] = ..., speculative_algorithm: _Optional[str] = ..., spec: _Optional[_Union[SpecParams, _Mapping]] = ..., max_context_len: _Optional[int] = ..., target_addresses: _Optional[_Iterable[str]] = ..., draft_addresses: _Optional[_Iterable[str]] = ..., protocol: _Optional[str] = ...) -> None: ...
