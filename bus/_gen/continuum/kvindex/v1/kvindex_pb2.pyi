from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU_HOT: _ClassVar[Tier]
    TIER_STORAGE_WARM: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_GPU_HOT: Tier
TIER_STORAGE_WARM: Tier

class QueryRequest(_message.Message):
    __slots__ = ("prefix_hash", "chain_key")
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_KEY_FIELD_NUMBER: _ClassVar[int]
    prefix_hash: str
    chain_key: str
    def __init__(self, prefix_hash: _Optional[str] = ..., chain_key: _Optional[str] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("prefix_hash", "entries", "chain_key")
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_KEY_FIELD_NUMBER: _ClassVar[int]
    prefix_hash: str
    entries: _containers.RepeatedCompositeFieldContainer[IndexEntry]
    chain_key: str
    def __init__(self, prefix_hash: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[IndexEntry, _Mapping]]] = ..., chain_key: _Optional[str] = ...) -> None: ...

class IndexEntry(_message.Message):
    __slots__ = ("backend", "token_count", "tier", "expires_at_unix_ms")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    token_count: int
    tier: Tier
    expires_at_unix_ms: int
    def __init__(self, backend: _Optional[str] = ..., token_count: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("prefix_hash", "request", "chain")
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    prefix_hash: str
    request: ChatRequest
    chain: PromptChain
    def __init__(self, prefix_hash: _Optional[str] = ..., request: _Optional[_Union[ChatRequest, _Mapping]] = ..., chain: _Optional[_Union[PromptChain, _Mapping]] = ...) -> None: ...

class PromptChain(_message.Message):
    __slots__ = ("keys", "prompt_bytes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    prompt_bytes: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., prompt_bytes: _Optional[int] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "request_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_json: bytes
    def __init__(self, model: _Optional[str] = ..., request_json: _Optional[bytes] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("prefix_hash", "scores", "selected_backend", "threshold", "conversation")
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SELECTED_BACKEND_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    prefix_hash: str
    scores: _containers.RepeatedCompositeFieldContainer[BackendScore]
    selected_backend: str
    threshold: float
    conversation: ConversationScore
    def __init__(self, prefix_hash: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[BackendScore, _Mapping]]] = ..., selected_backend: _Optional[str] = ..., threshold: _Optional[float] = ..., conversation: _Optional[_Union[ConversationScore, _Mapping]] = ...) -> None: ...

class ConversationScore(_message.Message):
    __slots__ = ("chain_length", "prompt_bytes", "prompt_tokens", "scores", "selected_backend", "outcome")
    CHAIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SELECTED_BACKEND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    chain_length: int
    prompt_bytes: int
    prompt_tokens: int
    scores: _containers.RepeatedCompositeFieldContainer[BackendScore]
    selected_backend: str
    outcome: str
    def __init__(self, chain_length: _Optional[int] = ..., prompt_bytes: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[BackendScore, _Mapping]]] = ..., selected_backend: _Optional[str] = ..., outcome: _Optional[str] = ...) -> None: ...

class BackendScore(_message.Message):
    __slots__ = ("backend", "overlap", "load", "health", "final_score", "tier", "token_count", "held_tokens", "chain_depth", "cost", "in_flight_prefill_tokens", "in_flight_requests")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    FINAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_DEPTH_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    overlap: float
    load: float
    health: float
    final_score: float
    tier: Tier
    token_count: int
    held_tokens: int
    chain_depth: int
    cost: float
    in_flight_prefill_tokens: int
    in_flight_requests: int
    def __init__(self, backend: _Optional[str] = ..., overlap: _Optional[float] = ..., load: _Optional[float] = ..., health: _Optional[float] = ..., final_score: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ..., token_count: _Optional[int] = ..., held_tokens: _Optional[int] = ..., chain_depth: _Optional[int] = ..., cost: _Optional[float] = ..., in_flight_prefill_tokens: _Optional[int] = ..., in_flight_requests: _Optional[int] = ...) -> None: ...

class BackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendsResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[BackendStatus]
    def __init__(self, backends: _Optional[_Iterable[_Union[BackendStatus, _Mapping]]] = ...) -> None: ...

class BackendStatus(_message.Message):
    __slots__ = ("name", "transport", "connected", "events_received", "events_processed", "events_dropped", "index_created", "index_evicted", "reconnects", "last_event_at_unix_ms", "last_event_id", "entries", "chain_entries")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    INDEX_CREATED_FIELD_NUMBER: _ClassVar[int]
    INDEX_EVICTED_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    transport: str
    connected: bool
    events_received: int
    events_processed: int
    events_dropped: int
    index_created: int
    index_evicted: int
    reconnects: int
    last_event_at_unix_ms: int
    last_event_id: str
    entries: int
    chain_entries: int
    def __init__(self, name: _Optional[str] = ..., transport: _Optional[str] = ..., connected: _Optional[bool] = ..., events_received: _Optional[int] = ..., events_processed: _Optional[int] = ..., events_dropped: _Optional[int] = ..., index_created: _Optional[int] = ..., index_evicted: _Optional[int] = ..., reconnects: _Optional[int] = ..., last_event_at_unix_ms: _Optional[int] = ..., last_event_id: _Optional[str] = ..., entries: _Optional[int] = ..., chain_entries: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("total_entries", "prefix_count", "backend_counts", "index_backend", "fallback_active", "queries", "hits", "evictions", "chain")
    TOTAL_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_COUNT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_COUNTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_BACKEND_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    total_entries: int
    prefix_count: int
    backend_counts: _containers.RepeatedCompositeFieldContainer[BackendCount]
    index_backend: str
    fallback_active: bool
    queries: int
    hits: int
    evictions: int
    chain: ChainIndexStats
    def __init__(self, total_entries: _Optional[int] = ..., prefix_count: _Optional[int] = ..., backend_counts: _Optional[_Iterable[_Union[BackendCount, _Mapping]]] = ..., index_backend: _Optional[str] = ..., fallback_active: _Optional[bool] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., chain: _Optional[_Union[ChainIndexStats, _Mapping]] = ...) -> None: ...

class ChainIndexStats(_message.Message):
    __slots__ = ("total_entries", "key_count", "backend_counts", "fallback_active", "queries", "hits", "evictions", "predicted_keys")
    TOTAL_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    KEY_COUNT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_COUNTS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    total_entries: int
    key_count: int
    backend_counts: _containers.RepeatedCompositeFieldContainer[BackendCount]
    fallback_active: bool
    queries: int
    hits: int
    evictions: int
    predicted_keys: int
    def __init__(self, total_entries: _Optional[int] = ..., key_count: _Optional[int] = ..., backend_counts: _Optional[_Iterable[_Union[BackendCount, _Mapping]]] = ..., fallback_active: _Optional[bool] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., predicted_keys: _Optional[int] = ...) -> None: ...

class BackendCount(_message.Message):
    __slots__ = ("backend", "entries")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    entries: int
    def __init__(self, backend: _Optional[str] = ..., entries: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: str
    def __init__(self, backend: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed", "chain_removed")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHAIN_REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    chain_removed: int
    def __init__(self, removed: _Optional[int] = ..., chain_removed: _Optional[int] = ...) -> None: ...
