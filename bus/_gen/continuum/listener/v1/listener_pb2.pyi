from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Engine(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_UNSPECIFIED: _ClassVar[Engine]
    ENGINE_VLLM: _ClassVar[Engine]
    ENGINE_SGLANG: _ClassVar[Engine]
    ENGINE_TRTLLM: _ClassVar[Engine]
ENGINE_UNSPECIFIED: Engine
ENGINE_VLLM: Engine
ENGINE_SGLANG: Engine
ENGINE_TRTLLM: Engine

class SourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SourcesResponse(_message.Message):
    __slots__ = ("epoch", "sources")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    def __init__(self, epoch: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("backend_name", "engine", "endpoints", "model", "last_event_id")
    BACKEND_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    backend_name: str
    engine: Engine
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    model: str
    last_event_id: str
    def __init__(self, backend_name: _Optional[str] = ..., engine: _Optional[_Union[Engine, str]] = ..., endpoints: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., last_event_id: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: str
    def __init__(self, backend: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("epoch", "backends")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    backends: _containers.RepeatedCompositeFieldContainer[BackendStats]
    def __init__(self, epoch: _Optional[str] = ..., backends: _Optional[_Iterable[_Union[BackendStats, _Mapping]]] = ...) -> None: ...

class BackendStats(_message.Message):
    __slots__ = ("backend", "seq", "last_event_id", "history_records", "oldest_seq", "subscribers", "events_published", "resyncs_published", "resync_blocks", "overflows", "source_counters")
    class SourceCountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_RECORDS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOWS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    seq: int
    last_event_id: str
    history_records: int
    oldest_seq: int
    subscribers: int
    events_published: int
    resyncs_published: int
    resync_blocks: int
    overflows: int
    source_counters: _containers.ScalarMap[str, float]
    def __init__(self, backend: _Optional[str] = ..., seq: _Optional[int] = ..., last_event_id: _Optional[str] = ..., history_records: _Optional[int] = ..., oldest_seq: _Optional[int] = ..., subscribers: _Optional[int] = ..., events_published: _Optional[int] = ..., resyncs_published: _Optional[int] = ..., resync_blocks: _Optional[int] = ..., overflows: _Optional[int] = ..., source_counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("backend", "last_event_id")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    backend: str
    last_event_id: str
    def __init__(self, backend: _Optional[str] = ..., last_event_id: _Optional[str] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("id", "event", "json")
    ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    event: str
    json: bytes
    def __init__(self, id: _Optional[str] = ..., event: _Optional[str] = ..., json: _Optional[bytes] = ...) -> None: ...
