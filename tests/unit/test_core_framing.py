"""Protocol version 2: the binary frame body, and frames of every version on one stream (vrnic.core.framing)."""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import pty
import struct
import threading
import tty
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.wire_messages import messages
from vrnic.core import framing
from vrnic.core.framing import (
    BINARY_VERSION,
    HEADER,
    INT_MAX,
    INT_MIN,
    JSON_VERSION,
    MAGIC,
    MAX_BODY,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_STRING,
    MSGPACK_VERSION,
    FrameDecoder,
    ProtocolError,
    decode_body,
    encode,
    encode_body,
    encode_ok,
    encode_request,
)
from vrnic.errors import InvalidArgument
from vrnic.frontend import channel as channel_module
from vrnic.frontend.channel import WIRE_VERSION_ENV, PortChannel, wire_version


def frame2(body: bytes) -> bytes:
    return HEADER.pack(MAGIC, BINARY_VERSION, 0, len(body)) + body


def nested(depth: int, container: type = dict) -> Any:
    """A message whose innermost container is `depth` deep, the message itself counted."""
    inner: Any = {} if container is dict else []
    for _ in range(depth - 2):
        inner = {"n": inner} if container is dict else [inner]
    return {"n": inner}




def roundtrip(message: dict[str, Any]) -> dict[str, Any]:
    frame = encode(message, BINARY_VERSION)
    got = FrameDecoder().feed_frames(frame)
    assert len(got) == 1 and got[0][0] == BINARY_VERSION
    assert decode_body(encode_body(message)) == got[0][1]
    return got[0][1]


# ----- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, True, False,
    0, 1, 127, 128, 255, 4096, -1, -32, -33, -128, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1,
    1 << 40, INT_MAX, INT_MIN,
    0.0, -0.0, 1.5, -2.25, 1e308, 5e-324, 0.1,
    "", "a", "x" * 31, "x" * 32, "é" * 15, "é" * 16, "日本語", "\U0001f600", "\x00nul", "y" * MAX_STRING,
    [], [1], list(range(15)), list(range(16)), [None, True, "s", [[]], {"k": -7}],
    {}, {"a": 1}, {f"k{i}": i for i in range(15)}, {f"k{i}": i for i in range(16)}, {"": {"": ""}},
])
def test_every_type_round_trips(value: object) -> None:
    message = {"v": value}
    got = roundtrip(message)
    assert got == message
    assert type(got["v"]) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, got["v"]) == math.copysign(1, value)  # -0.0 stays negative


def test_requests_and_replies_round_trip_smaller_than_json() -> None:
    for message in ({"id": 0x3A5F129C44, "op": "null_rpc", "args": {}},
                    {"id": 9, "op": "reg_mr", "args": {"pd": 0x51D377AB0C2E9F01, "addr": 0x7F3A1C200000,
                                                       "length": 65536, "access": 1}},
                    {"id": 9, "ok": False, "error": {"code": "not_found", "message": "no such qp"}}):
        assert roundtrip(message) == message
        assert len(encode(message, BINARY_VERSION)) < len(encode(message, JSON_VERSION))


def test_the_header_names_version_2_and_the_body_length() -> None:
    frame = encode({"id": 7, "op": "alloc_pd", "args": {}}, BINARY_VERSION)
    magic, version, reserved, length = HEADER.unpack_from(frame)
    assert (magic, version, reserved, length) == (MAGIC, 2, 0, len(frame) - HEADER.size)
    # a dict of 3; "id" 7; "op" "alloc_pd"; "args" an empty dict
    assert frame[HEADER.size:] == b"\xb3\x82id\x07\x82op\x88alloc_pd\x84args\xb0"


def test_the_wire_form_of_each_tag() -> None:
    def body(value: object) -> bytes:
        return encode_body({"v": value})[3:]  # after b"\xb1\x81v"

    assert body(None) == b"\xc0" and body(False) == b"\xc1" and body(True) == b"\xc2"
    assert body(5) == b"\x05" and body(-1) == b"\xff" and body(-32) == b"\xe0"
    assert body(-33) == b"\xc3" + struct.pack("!i", -33) and body(128) == b"\xc3" + struct.pack("!i", 128)
    assert body(1 << 31) == b"\xc4" + struct.pack("!q", 1 << 31)
    assert body(1.5) == b"\xc5" + struct.pack("!d", 1.5)
    assert body("ab") == b"\x82ab" and body("x" * 32) == b"\xc6" + struct.pack("!I", 32) + b"x" * 32
    assert body([1]) == b"\xa1\x01" and body(list(range(16)))[:5] == b"\xc7" + struct.pack("!I", 16)
    assert body({}) == b"\xb0" and body({f"{i:02}": 0 for i in range(16)})[:5] == b"\xc8" + struct.pack("!I", 16)


def test_subclasses_and_tuples_go_as_json_sends_them() -> None:
    class Flag(enum.IntFlag):
        A = 1
        B = 2

    class Name(enum.StrEnum):
        X = "x-value"

    class Real(float):
        pass

    message = {"flags": Flag.A | Flag.B, "name": Name.X, "pair": (1, (2, "3")), "real": Real(0.5),
               Name.X: 1}
    expected = json.loads(json.dumps(message))
    got = roundtrip(message)
    assert got == expected == {"flags": 3, "name": "x-value", "pair": [1, [2, "3"]], "real": 0.5, "x-value": 1}
    assert type(got["flags"]) is int and type(got["name"]) is str


def test_nesting_up_to_the_cap_round_trips() -> None:
    for container in (dict, list):
        message = nested(MAX_DEPTH, container)
        assert roundtrip(message) == message


def test_a_body_exactly_at_the_cap_and_one_byte_over() -> None:
    # a dict of 1 (1 byte), key "p" (2), a list of 2 (1), two long strs (5 bytes of head each)
    last = MAX_BODY - 14 - MAX_STRING
    message = {"p": ["x" * MAX_STRING, "y" * last]}
    assert len(encode_body(message)) == MAX_BODY
    assert roundtrip(message) == message
    with pytest.raises(ProtocolError, match=f"message of {MAX_BODY + 1} bytes exceeds the {MAX_BODY}-byte cap"):
        encode({"p": ["x" * MAX_STRING, "y" * (last + 1)]}, BINARY_VERSION)


@settings(deadline=None, max_examples=200)
@given(messages)
def test_decode_of_encode_is_the_message(message: dict[str, Any]) -> None:
    assert roundtrip(message) == message
    # the same message in version 1 means the same thing
    assert FrameDecoder().feed(encode(message, JSON_VERSION)) == [message]


# ----- what the encoder refuses (before the peer has to) -----------------------------------------

def _cyclic() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize(("message", "match"), [
    ({"v": 1 << 63}, "outside int64"),
    ({"v": INT_MIN - 1}, "outside int64"),
    ({"v": 10 ** 5000}, "outside int64"),  # no str() of it: that would hit Python's int-to-str limit
    ({1: "x"}, "dict keys must be str, not int"),
    ({"v": {None: 1}}, "dict keys must be str, not NoneType"),
    ({"v": {(1, 2): 1}}, "dict keys must be str, not tuple"),
    ({"v": b"raw"}, "cannot encode a bytes"),
    ({"v": {1, 2}}, "cannot encode a set"),
    ({"v": object()}, "cannot encode a object"),
    ({"v": math.nan}, "not finite"),
    ({"v": -math.inf}, "not finite"),
    ({"v": "\ud800"}, "not valid Unicode"),
    ({"\udfff": 1}, "not valid Unicode"),
    ({"v": "x" * (MAX_STRING + 1)}, f"exceeds the {MAX_STRING}-byte cap"),
    ({"v": [0] * (MAX_ITEMS + 1)}, f"exceeds the {MAX_ITEMS}-item cap"),
    ({"v": {str(i): 0 for i in range(MAX_ITEMS + 1)}}, f"exceeds the {MAX_ITEMS}-entry cap"),
    (nested(MAX_DEPTH + 1), f"deeper than {MAX_DEPTH}"),
    (nested(MAX_DEPTH + 1, list), f"deeper than {MAX_DEPTH}"),
    (_cyclic(), f"deeper than {MAX_DEPTH}"),
    ({"p": ["x" * MAX_STRING] * 2}, f"exceeds the {MAX_BODY}-byte cap"),
    (["not", "a", "dict"], "a message is a dict, not a list"),
])
def test_the_encoder_refuses(message: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        encode(message, BINARY_VERSION)


def test_encode_refuses_an_unknown_version() -> None:
    with pytest.raises(ProtocolError, match=r"unsupported protocol version 4 \(this end speaks 1, 2 and 3\)"):
        encode({}, 4)


def test_the_key_cache_stays_bounded() -> None:
    for i in range(framing._KEY_CACHE_SIZE + 50):
        encode({f"invented-{i}": 0}, BINARY_VERSION)
    assert len(framing._KEY_CACHE) <= framing._KEY_CACHE_SIZE
    assert roundtrip({"invented-late-key": 1}) == {"invented-late-key": 1}


# ----- what the decoder refuses --------------------------------------------------------------------

def refused(body: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_body(body)
    with pytest.raises(ProtocolError, match=match):
        FrameDecoder().feed(frame2(body))


@pytest.mark.parametrize("tag", range(0xC9, 0xE0))
def test_unknown_tags(tag: int) -> None:
    refused(bytes([0xB1, 0x81, ord("v"), tag]), f"unknown tag 0x{tag:02x} at byte 3")


def test_unknown_tag_in_a_list() -> None:
    refused(b"\xb1\x81v\xa2\x01\xd0", "unknown tag 0xd0 at byte 5")


@pytest.mark.parametrize("extra", [b"\x00", b"\xb0", b"junk" * 10])
def test_trailing_bytes(extra: bytes) -> None:
    refused(encode_body({"id": 1}) + extra, f"{len(extra)} trailing bytes after the message")


def test_truncation_at_every_cut() -> None:
    message = {"id": 1 << 40, "op": "modify_qp", "args": {"qp": -(1 << 40), "state": "rtr", "gid": "g" * 40,
                                                          "x": [1.5, None, True, {"k": -5}], "n": 300}}
    body = encode_body(message)
    for cut in range(len(body)):
        refused(body[:cut], "frame body is truncated")


@pytest.mark.parametrize(("body", "what"), [
    (b"\xb1\x86id", "a dict key"),  # a key of 6 bytes, 2 there
    (b"\xb1\x81v\x85abc", "a str"),
    (b"\xb1\x81v\xc6\x00\x00\x00\x09abc", "a str of 9 bytes"),
    (b"\xb1\xc6\x00\x00\x00\x05ab", "a str of 5 bytes"),  # a long-form key
])
def test_truncation_names_what_ran_past_the_end(body: bytes, what: str) -> None:
    refused(body, f"truncated: {what} runs past its end")


def test_duplicate_keys() -> None:
    refused(b"\xb2\x81a\x01\x81a\x02", "a dict repeats the key 'a'")
    refused(b"\xb1\x81v\xb3\x81x\x01\x81y\xa0\x81y\xc0", "a dict repeats the key 'y'")  # nested, other values
    long_key = b"\xc6" + struct.pack("!I", 40) + b"k" * 40
    refused(b"\xb2" + long_key + b"\x01" + long_key + b"\x02", "a dict repeats the key 'kkkk")


@pytest.mark.parametrize(("key", "kind"), [
    (b"\x01", "an int"), (b"\xff", "an int"), (b"\xc4" + bytes(8), "an int"), (b"\xc0", "None"),
    (b"\xc2", "a bool"), (b"\xc5" + bytes(8), "a float"), (b"\xa0", "a list"), (b"\xb0", "a dict"),
    (b"\xd5", "unknown tag 0xd5"),
])
def test_non_str_keys(key: bytes, kind: str) -> None:
    refused(b"\xb1" + key + b"\x01", f"a dict key must be a str, not {kind}")


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"a\xe2\x82"])
def test_invalid_utf8(bad: bytes) -> None:
    refused(b"\xb1\x81v" + bytes([0x80 | len(bad)]) + bad, "not UTF-8")  # a value
    refused(b"\xb1" + bytes([0x80 | len(bad)]) + bad + b"\x00", "not UTF-8")  # a key
    refused(b"\xb1\x81v\xc6" + struct.pack("!I", len(bad)) + bad, "not UTF-8")  # long form


@pytest.mark.parametrize("container", [dict, list])
def test_over_deep_nesting(container: type) -> None:
    body = encode_body(nested(MAX_DEPTH, container))
    assert decode_body(body) == nested(MAX_DEPTH, container)
    refused(b"\xb1\x81w" + body, f"nests deeper than {MAX_DEPTH} levels")  # one more, which encode() refuses


def test_hostile_nesting_costs_nothing_and_is_a_protocol_error() -> None:
    body = b"\xb1\x81n" + b"\xa1" * (MAX_BODY - 4) + b"\xc0"  # 65k nested lists: stopped at the cap
    refused(body[:MAX_BODY], f"nests deeper than {MAX_DEPTH} levels")


@pytest.mark.parametrize(("body", "match"), [
    (b"\xb1\x81v\xc6" + struct.pack("!I", MAX_STRING + 1), f"a str of {MAX_STRING + 1} bytes exceeds"),
    (b"\xb1\xc6" + struct.pack("!I", 0xFFFF_FFFF), "a str of 4294967295 bytes exceeds"),
    (b"\xb1\x81v\xc7" + struct.pack("!I", MAX_ITEMS + 1), f"a list of {MAX_ITEMS + 1} items exceeds"),
    (b"\xb1\x81v\xc8" + struct.pack("!I", 0xFFFF_FFFF), "a dict of 4294967295 entries exceeds"),
    (b"\xc8" + struct.pack("!I", MAX_ITEMS + 1), f"a dict of {MAX_ITEMS + 1} entries exceeds"),
])
def test_oversize_lengths_are_refused_before_reading_on(body: bytes, match: str) -> None:
    refused(body, match)


def test_a_declared_count_beyond_the_body_is_truncation() -> None:
    refused(b"\xb1\x81v\xc7" + struct.pack("!I", MAX_ITEMS) + b"\x00" * 10, "truncated")


@pytest.mark.parametrize(("body", "kind"), [
    (b"\x01", "an int"), (b"\xc0", "None"), (b"\xc1", "a bool"), (b"\x82ab", "a str"), (b"\xa0", "a list"),
    (b"\xc7\x00\x00\x00\x00", "a list"), (b"\xc5" + bytes(8), "a float"), (b"\xdf", "unknown tag 0xdf"),
])
def test_the_top_level_must_be_a_dict(body: bytes, kind: str) -> None:
    refused(body, f"frame body must be a dict, not {kind}")


def test_an_empty_body_is_truncated() -> None:
    refused(b"", "truncated")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats(value: float) -> None:
    refused(b"\xb1\x81v\xc5" + struct.pack("!d", value), "not finite")


def test_decode_body_takes_any_bytes_like() -> None:
    body = encode_body({"k": ["v", 1]})
    assert decode_body(memoryview(body)) == decode_body(bytearray(body)) == {"k": ["v", 1]}


def test_a_long_form_top_level_dict() -> None:
    assert decode_body(b"\xc8" + struct.pack("!I", 1) + b"\x81a\x05") == {"a": 5}


@settings(deadline=None, max_examples=1500)
@given(st.binary(max_size=200))
def test_random_bodies_only_ever_raise_protocol_error(body: bytes) -> None:
    for candidate in (body, b"\xb4" + body, b"\xb1\x81v" + body):
        try:
            message = decode_body(candidate)
        except ProtocolError:
            continue
        assert isinstance(message, dict)
        assert decode_body(encode_body(message)) == message  # what decodes, encodes back


@settings(deadline=None, max_examples=300)
@given(messages, st.data())
def test_corrupted_encodings_only_ever_raise_protocol_error(message: dict[str, Any], data: st.DataObject) -> None:
    body = bytearray(encode_body(message))
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        decode_body(bytes(body))


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=300))
def test_random_streams_only_ever_raise_protocol_error(stream: bytes) -> None:
    for prefix in (b"", HEADER.pack(MAGIC, BINARY_VERSION, 0, len(stream)),
                   HEADER.pack(MAGIC, MSGPACK_VERSION, 0, len(stream))):
        with contextlib.suppress(ProtocolError):
            FrameDecoder().feed(prefix + stream)


# ----- both versions on one stream ------------------------------------------------------------------

def test_frames_of_every_version_interleaved_on_one_stream() -> None:
    batch = [({"id": i, "op": "null_rpc", "args": {"i": i}}, (JSON_VERSION, BINARY_VERSION, MSGPACK_VERSION)[i % 3])
             for i in range(12)]
    stream = b"".join(encode(message, version) for message, version in batch)
    decoder = FrameDecoder()
    assert decoder.feed_frames(stream) == [(version, message) for message, version in batch]
    assert decoder.version == batch[-1][1]
    # and split anywhere, a byte at a time
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed_frames(stream[i:i + 1])
    assert got == [(version, message) for message, version in batch]
    assert decoder.pending == 0


@settings(deadline=None)
@given(st.lists(st.tuples(messages, st.sampled_from([JSON_VERSION, BINARY_VERSION, MSGPACK_VERSION])), min_size=1,
                max_size=5),
       st.data())
def test_mixed_streams_split_at_any_points(batch: list[tuple[dict[str, Any], int]], data: st.DataObject) -> None:
    stream = b"".join(encode(message, version) for message, version in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    decoder = FrameDecoder()
    got: list[tuple[int, dict[str, Any]]] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        got += decoder.feed_frames(memoryview(stream)[start:cut])  # vrnicd feeds views of its receive buffer
        start = cut
    assert got == [(version, message) for message, version in batch]
    assert decoder.pending == 0


def test_a_view_of_a_reused_buffer_is_not_kept() -> None:
    """vrnicd feeds a view of one receive buffer it then overwrites: a partial frame must be copied."""
    frame = encode({"id": 5, "op": "x", "args": {}}, BINARY_VERSION)
    buffer = bytearray(64)
    decoder = FrameDecoder()
    buffer[:10] = frame[:10]
    assert decoder.feed(memoryview(buffer)[:10]) == []
    buffer[:] = b"\xee" * 64
    buffer[:len(frame) - 10] = frame[10:]
    assert decoder.feed(memoryview(buffer)[:len(frame) - 10]) == [{"id": 5, "op": "x", "args": {}}]


def test_the_decoder_version_follows_the_last_frame_header() -> None:
    decoder = FrameDecoder()
    assert decoder.version == JSON_VERSION  # before the peer spoke: the version every peer reads
    decoder.feed(encode({}, BINARY_VERSION))
    assert decoder.version == BINARY_VERSION
    with pytest.raises(ProtocolError):
        decoder.feed(frame2(b"\xb1\x01\x01"))  # a bad body in a version 2 frame: the error goes back in 2
    assert decoder.version == BINARY_VERSION
    decoder = FrameDecoder()
    decoder.feed(encode({}, BINARY_VERSION))
    with pytest.raises(ProtocolError, match="unsupported protocol version 9"):
        decoder.feed(HEADER.pack(MAGIC, 9, 0, 0))
    assert decoder.version == BINARY_VERSION


def test_a_trickled_frame_is_not_copied_per_byte() -> None:
    frame = encode({"p": "x" * 30000}, BINARY_VERSION)
    decoder = FrameDecoder()
    for i in range(len(frame) - 1):
        assert decoder.feed(frame[i:i + 1]) == []
    assert decoder.pending == len(frame) - 1
    assert decoder.feed(frame[-1:]) == [{"p": "x" * 30000}]


def test_a_bad_header_is_refused_as_soon_as_it_is_whole_also_when_buffered() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"VR") == []
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(struct.pack("!BBI", BINARY_VERSION, 0, MAX_BODY + 1))


# ----- the frontend's choice ------------------------------------------------------------------------

def test_the_frontend_sends_version_3_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WIRE_VERSION_ENV, raising=False)
    assert wire_version() == MSGPACK_VERSION  # msgpack imports here (without it: 2, test_core_framing_v3)
    assert wire_version(1) == JSON_VERSION
    monkeypatch.setenv(WIRE_VERSION_ENV, "1")
    assert wire_version() == JSON_VERSION
    assert wire_version(2) == BINARY_VERSION  # the argument wins
    monkeypatch.setenv(WIRE_VERSION_ENV, " 2 ")
    assert wire_version() == BINARY_VERSION
    monkeypatch.setenv(WIRE_VERSION_ENV, "3")
    assert wire_version() == MSGPACK_VERSION
    for bad in ("4", "json", "0x2"):
        monkeypatch.setenv(WIRE_VERSION_ENV, bad)
        with pytest.raises(InvalidArgument, match=f"{WIRE_VERSION_ENV} is 1, 2 or 3"):
            wire_version()
    with pytest.raises(InvalidArgument, match="protocol version is 1, 2 or 3, not 7"):
        wire_version(7)
    # A setting already read (a channel reads the environment once) stands for the environment's
    assert wire_version(None, "2") == BINARY_VERSION and wire_version(None, "") == MSGPACK_VERSION
    with pytest.raises(InvalidArgument, match=f"{WIRE_VERSION_ENV} is 1, 2 or 3, not '9'"):
        wire_version(None, "9")


def test_a_vm_port_channel_steps_down_once_for_an_older_vrnicd(monkeypatch: pytest.MonkeyPatch) -> None:
    """vrnicd's VM link answers a frame it cannot read with an error (id 0, version 1) and reads on with a new
    decoder (backend.vm_link): the first call goes again in version 2, and every later one stays in it."""
    monkeypatch.delenv(WIRE_VERSION_ENV, raising=False)
    controller, device = pty.openpty()
    tty.setraw(device)
    monkeypatch.setattr(channel_module, "find_port", lambda name: Path(os.ttyname(device)))
    seen: list[int] = []

    def old_vrnicd() -> None:
        buffered = b""
        while len(seen) < 3:
            buffered += os.read(controller, 4096)
            while len(buffered) >= HEADER.size:
                _magic, version, _reserved, length = HEADER.unpack_from(buffered)
                if len(buffered) < HEADER.size + length:
                    break
                frame, buffered = buffered[:HEADER.size + length], buffered[HEADER.size + length:]
                seen.append(version)
                if version == MSGPACK_VERSION:
                    refusal = {"code": "protocol_error", "message": "unsupported protocol version 3 (this end "
                                                                    "speaks 1 and 2)"}
                    os.write(controller, encode({"id": 0, "ok": False, "error": refusal}, JSON_VERSION))
                else:
                    [request] = FrameDecoder().feed(frame)
                    os.write(controller, encode({"id": request["id"], "ok": True, "result": request["args"]},
                                                version))

    server = threading.Thread(target=old_vrnicd, daemon=True)
    server.start()
    channel = PortChannel()
    try:
        assert channel.version == MSGPACK_VERSION
        assert channel.call("echo", n=1) == {"n": 1}
        assert channel.version == BINARY_VERSION
        assert channel.call("echo", n=2) == {"n": 2}
    finally:
        channel.close()
    server.join(5)
    assert seen == [MSGPACK_VERSION, BINARY_VERSION, BINARY_VERSION]
    os.close(controller)
    os.close(device)


def test_only_a_refusal_of_the_requests_own_version_steps_down() -> None:
    refusal = {"ok": False, "error": {"code": "protocol_error",
                                      "message": "unsupported protocol version 3 (this end speaks 1 and 2)"}}
    assert channel_module._refuses_version(refusal, 3)
    assert not channel_module._refuses_version(refusal, 2)  # not what it said
    assert not channel_module._refuses_version({"ok": False, "error": {"code": "protocol_error",
                                                                       "message": "bad magic 0x4745"}}, 3)
    assert not channel_module._refuses_version({"ok": True, "result": {}}, 3)
    assert not channel_module._refuses_version({"ok": False, "error": {"code": "protocol_error",
                                                                       "message": "unsupported protocol version 1 "
                                                                                  "(this end speaks 2)"}}, 1)


@pytest.mark.parametrize("version", [JSON_VERSION, BINARY_VERSION, MSGPACK_VERSION])
def test_a_vm_port_channel_calls_in_its_version(monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    """PortChannel over a raw pty (a character device, as a virtio-serial port is), vrnicd played by a thread."""
    controller, device = pty.openpty()
    tty.setraw(device)
    monkeypatch.setattr(channel_module, "find_port", lambda name: Path(os.ttyname(device)))
    seen: list[tuple[int, dict[str, Any]]] = []

    def vrnicd() -> None:
        decoder = FrameDecoder()
        while len(seen) < 3:
            for frame_version, request in decoder.feed_frames(os.read(controller, 4096)):
                seen.append((frame_version, request))
                if request["op"] != "doorbell":
                    os.write(controller, encode({"id": request["id"], "ok": True, "result": request["args"]},
                                                frame_version))

    server = threading.Thread(target=vrnicd, daemon=True)
    server.start()
    channel = PortChannel(version=version)
    try:
        assert channel.call("echo", n=1 << 40, s="é") == {"n": 1 << 40, "s": "é"}
        channel.notify("doorbell")
        assert channel.call("echo", big="x" * 3000) == {"big": "x" * 3000}
    finally:
        channel.close()
    server.join(5)
    assert [(v, request["op"]) for v, request in seen] == [(version, "echo"), (version, "doorbell"),
                                                           (version, "echo")]
    os.close(controller)
    os.close(device)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, INT_MAX) | st.integers(INT_MIN, -1), messages)
def test_a_reply_encoded_without_its_dict_is_the_same_bytes(request_id: int, result: dict[str, Any]) -> None:
    """vrnicd answers every request through encode_ok; a guest must read exactly what encode() would send."""
    for version in (BINARY_VERSION, JSON_VERSION):
        assert encode_ok(request_id, result, version) == encode({"id": request_id, "ok": True, "result": result},
                                                                version)


def test_a_reply_encoded_without_its_dict_refuses_what_encode_refuses() -> None:
    for result, match in (({"x": "a" * (MAX_BODY + 1)}, "exceeds"), ({"x": "\ud800"}, "not valid Unicode"),
                          (nested(MAX_DEPTH), "nests deeper")):
        with pytest.raises(ProtocolError, match=match):
            encode({"id": 1, "ok": True, "result": result}, BINARY_VERSION)
        with pytest.raises(ProtocolError, match=match):
            encode_ok(1, result, BINARY_VERSION)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, INT_MAX), st.text(max_size=70), messages)
def test_a_request_encoded_without_its_dict_is_the_same_bytes(request_id: int, op: str, args: dict[str, Any]) -> None:
    """Every call a guest makes goes through encode_request; vrnicd must read exactly what encode() would send."""
    for version in (BINARY_VERSION, JSON_VERSION):
        assert encode_request(request_id, op, args, version) == encode(
            {"id": request_id, "op": op, "args": args}, version)


def test_a_request_encoded_without_its_dict_refuses_what_encode_refuses() -> None:
    for op, args, match in (("x", {"x": "a" * (MAX_BODY + 1)}, "exceeds"), ("\ud800", {}, "not valid Unicode"),
                            ("x", {"x": "\ud800"}, "not valid Unicode"), ("x", nested(MAX_DEPTH), "nests deeper")):
        with pytest.raises(ProtocolError, match=match):
            encode({"id": 1, "op": op, "args": args}, BINARY_VERSION)
        with pytest.raises(ProtocolError, match=match):
            encode_request(1, op, args, BINARY_VERSION)
