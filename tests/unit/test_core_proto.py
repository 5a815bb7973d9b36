"""The frontend <-> vrnicd framing and message checks (vrnic.core.proto)."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vrnic.core.proto import (
    HEADER,
    MAGIC,
    MAX_BODY,
    VERSION,
    FrameDecoder,
    ParsedRequest,
    ProtocolError,
    Request,
    encode,
    parse_request,
    reply_error,
    reply_ok,
)
from vrnic.errors import Conflict, InvalidArgument, QuotaExceeded


def raw_frame(body: bytes, magic: int = MAGIC, version: int = VERSION, length: int | None = None) -> bytes:
    return HEADER.pack(magic, version, 0, len(body) if length is None else length) + body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 53), 1 << 53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.dictionaries(st.text(max_size=10), json_values, max_size=5)


# ----- encode ----------------------------------------------------------------------------------

def test_encode_header_fields_and_compact_json_body() -> None:
    frame = encode({"id": 7, "op": "alloc_pd", "args": {}})
    magic, version, reserved, length = HEADER.unpack_from(frame)
    body = frame[HEADER.size:]
    assert (magic, version, reserved) == (0x5652, 1, 0)
    assert frame[:2] == b"VR"
    assert HEADER.size == 8
    assert length == len(body)
    assert body == b'{"id":7,"op":"alloc_pd","args":{}}'


def test_encode_refuses_a_body_over_the_cap() -> None:
    overhead = len(json.dumps({"p": ""}, separators=(",", ":")))
    assert len(encode({"p": "x" * (MAX_BODY - overhead)})) == HEADER.size + MAX_BODY
    with pytest.raises(ProtocolError, match="cap"):
        encode({"p": "x" * (MAX_BODY - overhead + 1)})


def test_protocol_error_is_an_invalid_argument_with_its_own_code() -> None:
    exc = ProtocolError("nope")
    assert isinstance(exc, InvalidArgument)
    assert exc.to_dict() == {"code": "protocol_error", "message": "nope"}


# ----- FrameDecoder ----------------------------------------------------------------------------

@settings(deadline=None)
@given(st.lists(messages, min_size=1, max_size=5))
def test_decoder_round_trips_several_frames_in_one_feed(batch: list[dict[str, object]]) -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"".join(encode(m) for m in batch)) == batch
    assert decoder.pending == 0


@settings(deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_decoder_reassembles_frames_split_at_any_points(batch: list[dict[str, object]], data: st.DataObject) -> None:
    stream = b"".join(encode(m) for m in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    decoder = FrameDecoder()
    out: list[dict[str, object]] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        out += decoder.feed(stream[start:cut])
        start = cut
    assert out == batch
    assert decoder.pending == 0


def test_decoder_feeding_one_byte_at_a_time() -> None:
    frame = encode({"id": 1, "op": "query_device"})
    decoder = FrameDecoder()
    for i, byte in enumerate(frame[:-1]):
        assert decoder.feed(bytes([byte])) == []
        assert decoder.pending == i + 1
    assert decoder.feed(frame[-1:]) == [{"id": 1, "op": "query_device"}]
    assert decoder.pending == 0


def test_decoder_keeps_a_partial_second_frame_pending() -> None:
    first, second = encode({"n": 1}), encode({"n": 2})
    decoder = FrameDecoder()
    assert decoder.feed(first + second[:5]) == [{"n": 1}]
    assert decoder.pending == 5
    assert decoder.feed(second[5:]) == [{"n": 2}]
    assert decoder.pending == 0


def test_decoder_partial_header_waits() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"VR\x01") == []
    assert decoder.pending == 3


def test_decoder_empty_feed_is_harmless() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"") == []
    assert decoder.pending == 0


def test_decoder_refuses_bad_magic_as_soon_as_the_header_is_complete() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="bad magic 0x4745"):
        decoder.feed(b"GET / HTTP/1.1\r\n")


@pytest.mark.parametrize("version", [0, 4, 255])
def test_decoder_refuses_an_unknown_version_naming_those_it_speaks(version: int) -> None:
    with pytest.raises(ProtocolError, match=rf"unsupported protocol version {version} \(this end speaks 1, 2 and 3\)"):
        FrameDecoder().feed(raw_frame(b"{}", version=version))


def test_decoder_refuses_an_oversized_length_before_the_body_arrives() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(raw_frame(b"", length=MAX_BODY + 1))


def test_decoder_accepts_a_frame_exactly_at_the_cap() -> None:
    body = json.dumps({"p": "x" * (MAX_BODY - 8)}, separators=(",", ":")).encode()
    assert len(body) == MAX_BODY
    assert FrameDecoder().feed(raw_frame(body)) == [{"p": "x" * (MAX_BODY - 8)}]


def test_decoder_refuses_a_huge_declared_length() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameDecoder().feed(struct.pack("!HBBI", MAGIC, VERSION, 0, 0xFFFF_FFFF))


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe\x00", b"", b'{"a": 1} trailing'])
def test_decoder_refuses_a_body_that_is_not_json(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="not JSON"):
        FrameDecoder().feed(raw_frame(body))


@pytest.mark.parametrize("body", [b"[]", b"[1, 2]", b"1", b'"text"', b"null", b"true"])
def test_decoder_refuses_a_body_that_is_not_an_object(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        FrameDecoder().feed(raw_frame(body))


@pytest.mark.parametrize("body", [b"[" * 30000 + b"]" * 30000, b'{"a":' * 10000 + b"1" + b"}" * 10000])
def test_decoder_refuses_hostile_nesting_as_a_protocol_error(body: bytes) -> None:
    assert len(body) <= MAX_BODY
    with pytest.raises(ProtocolError, match="nests too deeply"):
        FrameDecoder().feed(raw_frame(body))


def test_decoder_accepts_reasonable_nesting() -> None:
    message: dict[str, object] = {"leaf": 1}
    for _ in range(100):
        message = {"n": message}
    assert FrameDecoder().feed(encode(message)) == [message]


def test_decoder_error_after_a_good_frame_in_the_same_chunk() -> None:
    with pytest.raises(ProtocolError, match="bad magic"):
        FrameDecoder().feed(encode({"ok": 1}) + b"XXXXXXXXXX")


# ----- requests and replies --------------------------------------------------------------------

def test_parse_request_fills_default_args() -> None:
    request = parse_request({"id": 3, "op": "alloc_pd"})
    assert (request.id, request.op, request.args) == (3, "alloc_pd", {})


def test_parse_request_keeps_args() -> None:
    request = parse_request({"id": 0, "op": "reg_mr", "args": {"pd": 5, "addr": 0}})
    assert isinstance(request, ParsedRequest)
    assert request.args == {"pd": 5, "addr": 0}


def test_parse_request_id_bounds() -> None:
    assert parse_request({"id": (1 << 63) - 1, "op": "x"}).id == (1 << 63) - 1
    for bad in (-1, 1 << 63):
        with pytest.raises(ProtocolError, match="malformed request"):
            parse_request({"id": bad, "op": "x"})


@pytest.mark.parametrize("message", [
    {"op": "x"},  # no id
    {"id": 1},  # no op
    {"id": 1, "op": "x", "extra": True},  # unknown field
    {"id": 1, "op": "x" * 65},  # op too long
    {"id": 1, "op": 5},  # op not a string
    {"id": 1, "op": "x", "args": None},
    {"id": 1, "op": "x", "args": [1]},
    {"id": "1", "op": "x"},  # ids are JSON integers, not strings that look like one
    {"id": True, "op": "x"},
    {"id": 1.0, "op": "x"},
])
def test_parse_request_refuses_malformed_messages(message: dict[str, object]) -> None:
    with pytest.raises(ProtocolError, match="malformed request"):
        parse_request(message)


envelopes = st.fixed_dictionaries({}, optional={
    "id": st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-(1 << 64), 1 << 64) | st.floats(0, 9)
    | st.text(max_size=3),
    "op": st.none() | st.integers(0, 9) | st.text(max_size=66),
    "args": json_values,
    "extra": json_values,
})


@settings(deadline=None, max_examples=400)
@given(envelopes)
def test_parse_request_accepts_exactly_what_the_request_model_accepts(message: dict[str, object]) -> None:
    """The hand-written envelope check (the hot path) is the strict Request model, no looser and no stricter."""
    try:
        expected: Request | None = Request.model_validate(message)
    except ValidationError:
        expected = None
    if expected is None:
        with pytest.raises(ProtocolError, match="malformed request"):
            parse_request(message)
    else:
        got = parse_request(message)
        assert (got.id, got.op, got.args) == (expected.id, expected.op, expected.args)


def test_reply_ok_shapes() -> None:
    assert reply_ok(4) == {"id": 4, "ok": True, "result": {}}
    assert reply_ok(4, {"pd": 9}) == {"id": 4, "ok": True, "result": {"pd": 9}}


def test_reply_error_carries_the_error_fields_and_survives_the_wire() -> None:
    reply = reply_error(8, QuotaExceeded("max_qps", 2, 3))
    assert reply == {"id": 8, "ok": False, "error": {
        "code": "quota_exceeded", "message": "quota exceeded: max_qps (limit 2, would reach 3)",
        "limit": "max_qps", "maximum": 2, "requested": 3}}
    assert FrameDecoder().feed(encode(reply)) == [reply]
    conflict = reply_error(9, Conflict("already attached", current_state="attached"))
    assert conflict["error"]["current_state"] == "attached"
