from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_TYPE_UNSPECIFIED: _ClassVar[TokenType]
    TOKEN_TYPE_SYSTEM: _ClassVar[TokenType]
    TOKEN_TYPE_USER: _ClassVar[TokenType]
    TOKEN_TYPE_ASSISTANT: _ClassVar[TokenType]
    TOKEN_TYPE_REASONING: _ClassVar[TokenType]
    TOKEN_TYPE_TOOL_DEFINITION: _ClassVar[TokenType]
    TOKEN_TYPE_TOOL_IO: _ClassVar[TokenType]

class SessionClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_CLASS_UNSPECIFIED: _ClassVar[SessionClass]
    SESSION_CLASS_CHAT: _ClassVar[SessionClass]
    SESSION_CLASS_AGENT: _ClassVar[SessionClass]
    SESSION_CLASS_SINGLE: _ClassVar[SessionClass]

class BlockEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_EVENT_KIND_UNSPECIFIED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_REQUEST_STARTED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_INSERTED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_HIT: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_RELEASED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_REMOVED: _ClassVar[BlockEventKind]
TOKEN_TYPE_UNSPECIFIED: TokenType
TOKEN_TYPE_SYSTEM: TokenType
TOKEN_TYPE_USER: TokenType
TOKEN_TYPE_ASSISTANT: TokenType
TOKEN_TYPE_REASONING: TokenType
TOKEN_TYPE_TOOL_DEFINITION: TokenType
TOKEN_TYPE_TOOL_IO: TokenType
SESSION_CLASS_UNSPECIFIED: SessionClass
SESSION_CLASS_CHAT: SessionClass
SESSION_CLASS_AGENT: SessionClass
SESSION_CLASS_SINGLE: SessionClass
BLOCK_EVENT_KIND_UNSPECIFIED: BlockEventKind
BLOCK_EVENT_KIND_REQUEST_STARTED: BlockEventKind
BLOCK_EVENT_KIND_INSERTED: BlockEventKind
BLOCK_EVENT_KIND_HIT: BlockEventKind
BLOCK_EVENT_KIND_RELEASED: BlockEventKind
BLOCK_EVENT_KIND_REMOVED: BlockEventKind

class BlockEvent(_message.Message):
    __slots__ = ("kind", "block_hash", "parent_hash", "session_id", "token_type", "offset", "timestamp", "session_class", "features", "tools", "request")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SESSION_CLASS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    kind: BlockEventKind
    block_hash: bytes
    parent_hash: bytes
    session_id: str
    token_type: TokenType
    offset: int
    timestamp: float
    session_class: SessionClass
    features: _containers.RepeatedScalarFieldContainer[float]
    tools: bool
    request: RequestFeatures
    def __init__(self, kind: _Optional[_Union[BlockEventKind, str]] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., session_id: _Optional[str] = ..., token_type: _Optional[_Union[TokenType, str]] = ..., offset: _Optional[int] = ..., timestamp: _Optional[float] = ..., session_class: _Optional[_Union[SessionClass, str]] = ..., features: _Optional[_Iterable[float]] = ..., tools: _Optional[bool] = ..., request: _Optional[_Union[RequestFeatures, _Mapping]] = ...) -> None: ...

class RequestFeatures(_message.Message):
    __slots__ = ("tools", "turns", "tool_calls", "tool_results", "reasoning", "temperature", "max_tokens")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tools: int
    turns: int
    tool_calls: int
    tool_results: int
    reasoning: bool
    temperature: float
    max_tokens: int
    def __init__(self, tools: _Optional[int] = ..., turns: _Optional[int] = ..., tool_calls: _Optional[int] = ..., tool_results: _Optional[int] = ..., reasoning: _Optional[bool] = ..., temperature: _Optional[float] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("backend", "events")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    def __init__(self, backend: _Optional[str] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("events_applied", "blocks_forgotten")
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    events_applied: int
    blocks_forgotten: int
    def __init__(self, events_applied: _Optional[int] = ..., blocks_forgotten: _Optional[int] = ...) -> None: ...

class RankVictimsRequest(_message.Message):
    __slots__ = ("backend", "candidate_hashes", "n", "timestamp")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_HASHES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    backend: str
    candidate_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    n: int
    timestamp: float
    def __init__(self, backend: _Optional[str] = ..., candidate_hashes: _Optional[_Iterable[bytes]] = ..., n: _Optional[int] = ..., timestamp: _Optional[float] = ...) -> None: ...

class RankVictimsResponse(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
