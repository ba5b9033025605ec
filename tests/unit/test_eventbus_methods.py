"""The event bus server's explicit method table matches the proto's EventBus service.

The table is written out (not taken from the generated ``add_EventBusServicer_to_server``)
so that Stream can use ``bus.stream_data.decode_stream_request``; these tests make an RPC
added to ``bus.proto`` fail here until the table has it, with the right streaming kinds and
message types.
"""

from __future__ import annotations

import inspect
from typing import Any

import grpc

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.stream_data import decode_stream_request, encode_stream_data
from router.eventbus.server import SERVICE_NAME, method_handlers
from router.eventbus.service import EventBusServicer

DESCRIPTOR = pb.DESCRIPTOR.services_by_name["EventBus"]


class _Hub:
    """EventBusServicer only keeps its hub; building the table never touches it."""


def _table() -> dict[str, grpc.RpcMethodHandler]:
    return method_handlers(EventBusServicer(_Hub()))  # type: ignore[arg-type]


def _message(name: str) -> Any:
    return getattr(pb, name)


def test_the_table_has_exactly_the_services_methods() -> None:
    assert SERVICE_NAME == "continuum.bus.v1.EventBus" == DESCRIPTOR.full_name
    assert set(_table()) == {m.name for m in DESCRIPTOR.methods}


def test_each_method_has_the_streaming_kinds_of_the_proto() -> None:
    table = _table()
    for method in DESCRIPTOR.methods:
        handler = table[method.name]
        assert (handler.request_streaming, handler.response_streaming) == (
            method.client_streaming,
            method.server_streaming,
        ), method.name


def test_each_method_reads_and_writes_the_protos_message_types() -> None:
    table = _table()
    for method in DESCRIPTOR.methods:
        handler = table[method.name]
        request = _message(method.input_type.name)()
        response = _message(method.output_type.name)()
        assert isinstance(handler.request_deserializer(request.SerializeToString()), type(request))
        assert handler.response_serializer(response) == response.SerializeToString()


def test_stream_requests_are_read_by_the_copy_free_decoder() -> None:
    stream = _table()["Stream"]
    assert inspect.unwrap(stream.request_deserializer) is decode_stream_request
    assert stream.request_deserializer(encode_stream_data(b"data: x\n\n")) == b"data: x\n\n"
