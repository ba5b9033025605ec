from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_KV_LISTENER: _ClassVar[Role]
    ROLE_BROKER: _ClassVar[Role]

class CloseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLOSE_REASON_UNSPECIFIED: _ClassVar[CloseReason]
    CLOSE_REASON_BUFFER_OVERFLOW: _ClassVar[CloseReason]
    CLOSE_REASON_DRAINING: _ClassVar[CloseReason]
    CLOSE_REASON_UNSUBSCRIBED: _ClassVar[CloseReason]
    CLOSE_REASON_ERROR: _ClassVar[CloseReason]
ROLE_UNSPECIFIED: Role
ROLE_KV_LISTENER: Role
ROLE_BROKER: Role
CLOSE_REASON_UNSPECIFIED: CloseReason
CLOSE_REASON_BUFFER_OVERFLOW: CloseReason
CLOSE_REASON_DRAINING: CloseReason
CLOSE_REASON_UNSUBSCRIBED: CloseReason
CLOSE_REASON_ERROR: CloseReason

class SessionRequest(_message.Message):
    __slots__ = ("hello", "draining", "snapshot")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    draining: Draining
    snapshot: SnapshotChunk
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotChunk, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("welcome", "subscribe", "unsubscribe", "forbidden", "snapshot_request")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    FORBIDDEN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    subscribe: Subscribe
    unsubscribe: Unsubscribe
    forbidden: Forbidden
    snapshot_request: SnapshotRequest
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., subscribe: _Optional[_Union[Subscribe, _Mapping]] = ..., unsubscribe: _Optional[_Union[Unsubscribe, _Mapping]] = ..., forbidden: _Optional[_Union[Forbidden, _Mapping]] = ..., snapshot_request: _Optional[_Union[SnapshotRequest, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("client_id", "role", "sources")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    role: Role
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("session_id", "accepted_sources")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted_sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., accepted_sources: _Optional[_Iterable[str]] = ...) -> None: ...

class Subscribe(_message.Message):
    __slots__ = ("stream_id", "source", "last_event_id")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    source: str
    last_event_id: str
    def __init__(self, stream_id: _Optional[str] = ..., source: _Optional[str] = ..., last_event_id: _Optional[str] = ...) -> None: ...

class Unsubscribe(_message.Message):
    __slots__ = ("stream_id", "reason")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    reason: str
    def __init__(self, stream_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Forbidden(_message.Message):
    __slots__ = ("reason", "sources")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    reason: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reason: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("request_id", "source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source: str
    def __init__(self, request_id: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("request_id", "data", "last", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: bytes
    last: bool
    error: str
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("open", "data", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    data: StreamData
    close: StreamClose
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., data: _Optional[_Union[StreamData, _Mapping]] = ..., close: _Optional[_Union[StreamClose, _Mapping]] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class StreamData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class StreamClose(_message.Message):
    __slots__ = ("reason", "detail")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reason: CloseReason
    detail: str
    def __init__(self, reason: _Optional[_Union[CloseReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("stream_id", "bytes_received", "records_parsed", "last_event_id")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PARSED_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    bytes_received: int
    records_parsed: int
    last_event_id: str
    def __init__(self, stream_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., records_parsed: _Optional[int] = ..., last_event_id: _Optional[str] = ...) -> None: ...
