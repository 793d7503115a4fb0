from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("layer", "address", "nbytes")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    address: int
    nbytes: int
    def __init__(self, layer: _Optional[int] = ..., address: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Destination(_message.Message):
    __slots__ = ("session", "regions")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    session: str
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, session: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "destination", "layout_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    destination: Destination
    layout_hash: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., destination: _Optional[_Union[Destination, _Mapping]] = ..., layout_hash: _Optional[str] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage", "compute_s", "transfer_wait_s", "bytes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    compute_s: float
    transfer_wait_s: float
    bytes: int
    def __init__(self, stage: _Optional[int] = ..., compute_s: _Optional[float] = ..., transfer_wait_s: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("request_id", "first_token", "first_logprob", "bytes_moved", "stages", "queue_s", "first_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    first_logprob: float
    bytes_moved: int
    stages: _containers.RepeatedCompositeFieldContainer[StageTiming]
    queue_s: float
    first_top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., bytes_moved: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., queue_s: _Optional[float] = ..., first_top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("stage", "first_layer", "last_layer")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    stage: int
    first_layer: int
    last_layer: int
    def __init__(self, stage: _Optional[int] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model", "layout_hash", "stages", "cache_dtype", "num_layers", "drafter_layers", "vocab_size", "max_prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout_hash: str
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    cache_dtype: str
    num_layers: int
    drafter_layers: int
    vocab_size: int
    max_prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., layout_hash: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., cache_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., drafter_layers: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...
