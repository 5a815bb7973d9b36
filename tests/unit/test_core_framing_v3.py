"""Protocol version 3: the MessagePack frame body (vrnic.core.framing), what it refuses and what it leaves to the
verbs' argument schemas."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.wire_messages import messages
from vrnic.core.framing import (
    HEADER,
    INT_MAX,
    MAGIC,
    MAX_BODY,
    MAX_DEPTH,
    MSGPACK_VERSION,
    FrameDecoder,
    ProtocolError,
    encode,
    encode_ok,
    encode_request,
)


def frame3(body: bytes) -> bytes:
    return HEADER.pack(MAGIC, MSGPACK_VERSION, 0, len(body)) + body


def decode3(body: bytes) -> dict[str, Any]:
    [(version, message)] = FrameDecoder().feed_frames(frame3(body))
    assert version == MSGPACK_VERSION
    return message


@settings(deadline=None)
@given(st.lists(messages, min_size=1, max_size=5))
def test_messages_round_trip_in_version_3(batch: list[dict[str, Any]]) -> None:
    decoder = FrameDecoder()
    assert decoder.feed_frames(b"".join(encode(m, MSGPACK_VERSION) for m in batch)) == [
        (MSGPACK_VERSION, m) for m in batch]
    assert decoder.version == MSGPACK_VERSION


@given(st.integers(0, INT_MAX), st.text(max_size=64), messages)
def test_the_request_and_reply_shortcuts_frame_what_encode_frames(request_id: int, op: str,
                                                                  args: dict[str, Any]) -> None:
    assert encode_request(request_id, op, args, MSGPACK_VERSION) == encode(
        {"id": request_id, "op": op, "args": args}, MSGPACK_VERSION)
    assert encode_ok(request_id, args, MSGPACK_VERSION) == encode(
        {"id": request_id, "ok": True, "result": args}, MSGPACK_VERSION)


def test_a_version_3_frame_is_smaller_than_version_1s() -> None:
    message = {"id": 1 << 40, "op": "connect", "args": {"qp": 1 << 40, "remote_gid": "fe80::1", "remote_qpn": 17}}
    assert len(encode(message, MSGPACK_VERSION)) < len(encode(message, 1))


@pytest.mark.parametrize(("body", "says"), [
    (b"", "truncated"),
    (b"\x82\xa1a\x01", "truncated"),  # a map of two entries that holds one
    (b"\xa3ab", "truncated"),
    (b"\xc1", "not a version 3 message"),  # the one byte MessagePack never uses
    (msgpack.packb({"a": 1}) + b"\x00", "1 trailing bytes"),
    (msgpack.packb({}) + msgpack.packb({}), "1 trailing bytes"),
    (msgpack.packb([1, 2]), "must be a map, not list"),
    (msgpack.packb(7), "must be a map, not int"),
    (msgpack.packb("text"), "must be a map, not str"),
    (msgpack.packb(None), "must be a map, not NoneType"),
    (b"\x81\xa1a\xa1\xff", "not UTF-8"),
    (b"\x81\xa1a\xa3\xed\xa0\x80", "not UTF-8"),  # a lone surrogate, as UTF-8 bytes
    (b"\x81\xa1\xff\x01", "not UTF-8"),  # ... in a key
    (b"\x81\x01\x01", "not a version 3 message"),  # an int key
    (b"\x81\xc0\x01", "not a version 3 message"),  # a nil key
    (msgpack.packb({"a": msgpack.ExtType(5, b"x")}), "extension type (5)"),
    (b"\x81\xa1a\xc7\x00\x05", "extension type (5)"),  # one of no bytes
    (b"\x81\xa1a" + b"\x91" * 1100 + b"\x00", "not a version 3 message"),  # past msgpack's 1024 levels
])
def test_the_decoder_refuses_what_is_not_a_version_3_message(body: bytes, says: str) -> None:
    with pytest.raises(ProtocolError, match=says.replace("(", r"\(").replace(")", r"\)")):
        decode3(body)


def test_a_refused_body_ends_the_stream_after_the_good_frames_before_it() -> None:
    decoder = FrameDecoder()
    good = encode({"id": 1}, MSGPACK_VERSION)
    assert decoder.feed(good) == [{"id": 1}]
    with pytest.raises(ProtocolError):
        decoder.feed(good + frame3(b"\xc1"))


def test_what_version_2_has_no_word_for_decodes_and_is_left_to_the_verbs_schema() -> None:
    """Each is refused by the argument schema of any verb it reaches (test_backend_channel: the session goes on)."""
    assert decode3(msgpack.packb({"b": b"\x00\x01", "e": b""})) == {"b": b"\x00\x01", "e": b""}
    assert decode3(msgpack.packb({"u": (1 << 64) - 1})) == {"u": (1 << 64) - 1}
    assert math.isnan(decode3(msgpack.packb({"f": math.nan}))["f"])
    assert decode3(b"\x82\xa1a\x01\xa1a\x02") == {"a": 2}  # a repeated key: its last value, as in version 1
    assert decode3(msgpack.packb({"d": [[[[[[1]]]]]] * 2})) == {"d": [[[[[[1]]]]]] * 2}
    # msgpack reads its own Timestamp extension (-1) whatever ext_hook says: a value no schema takes either
    assert decode3(msgpack.packb({"t": msgpack.Timestamp(1, 0)})) == {"t": msgpack.Timestamp(1, 0)}


def test_sizes_are_bounded_by_the_body_cap() -> None:
    big = {"s": "x" * (MAX_BODY - 16)}
    assert FrameDecoder().feed(encode(big, MSGPACK_VERSION)) == [big]
    with pytest.raises(ProtocolError, match=f"exceeds the {MAX_BODY}-byte cap"):
        encode({"s": "x" * MAX_BODY}, MSGPACK_VERSION)
    with pytest.raises(ProtocolError, match=f"exceeds the {MAX_BODY}-byte cap"):
        FrameDecoder().feed(HEADER.pack(MAGIC, MSGPACK_VERSION, 0, MAX_BODY + 1))


def nested_list(depth: int) -> Any:
    inner: Any = [1]
    for _ in range(depth - 1):
        inner = [inner]
    return inner


class Flavour(str):
    pass


@pytest.mark.parametrize(("args", "says"), [
    ({"n": 1 << 64}, "cannot encode"),
    ({"n": -(1 << 63) - 1}, "cannot encode"),
    ({"s": {1, 2}}, "cannot encode"),
    ({"o": object()}, "cannot encode"),
    ({"s": "\udc80"}, "not valid Unicode"),
    ({"d": {1: "x"}}, "dict keys must be str, not int"),
    ({"d": [{"ok": 1}, {b"k": 1}]}, "dict keys must be str, not bytes"),
    ({"e": [msgpack.ExtType(1, b"x")]}, "ExtType"),
    ({"t": msgpack.Timestamp(1, 0)}, "Timestamp"),
    ({"deep": nested_list(MAX_DEPTH)}, f"deeper than {MAX_DEPTH} levels"),
])
def test_a_request_the_decoder_would_refuse_is_refused_before_it_is_sent(args: dict[str, Any], says: str) -> None:
    """So that the mistake is the caller's own error, and its channel (which a refused frame ends) lives on."""
    with pytest.raises(ProtocolError, match=says):
        encode_request(1, "op", args, MSGPACK_VERSION)


def test_subclasses_go_as_their_base_type_and_tuples_as_lists() -> None:
    import enum

    class Color(enum.IntEnum):
        RED = 3

    sent = encode_request(2, "op", {"c": Color.RED, "f": Flavour("x"), "t": (1, (2, 3))}, MSGPACK_VERSION)
    assert FrameDecoder().feed(sent) == [{"id": 2, "op": "op", "args": {"c": 3, "f": "x", "t": [1, [2, 3]]}}]


@settings(deadline=None, max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
                    | st.text(max_size=20) | st.binary(max_size=20),
                    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6) | st.binary(
                        max_size=4) | st.integers(-(1 << 63), (1 << 64) - 1), inner, max_size=6),
                    max_leaves=20))
def test_any_msgpack_body_decodes_to_a_map_or_is_a_protocol_error(value: Any) -> None:
    try:
        message = decode3(msgpack.packb(value))
    except ProtocolError:
        return
    assert type(message) is dict


def test_threads_encoding_at_once_each_get_their_own_frames() -> None:
    """Each thread packs with a Packer of its own: vrnicd answers every guest from that guest's thread."""
    failures: list[str] = []

    def encode_many(n: int) -> None:
        decoder = FrameDecoder()
        for i in range(2000):
            message = {"id": i, "ok": True, "result": {"thread": n, "pad": "x" * (n * 37 % 300)}}
            if decoder.feed(encode_ok(i, message["result"], MSGPACK_VERSION)) != [message]:  # type: ignore[arg-type]
                failures.append(f"thread {n}, frame {i}")
                return

    threads = [threading.Thread(target=encode_many, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_without_msgpack_an_end_speaks_versions_1_and_2_and_refuses_3() -> None:
    """A VM's frontend has the standard library only: it sends version 2, and a version 3 frame is refused by
    name (msgpack made unimportable in a fresh interpreter)."""
    script = (
        "import sys\n"
        "sys.modules['msgpack'] = None\n"
        "from vrnic.core import framing\n"
        "from vrnic.frontend.channel import wire_version\n"
        "assert framing.VERSIONS == (1, 2), framing.VERSIONS\n"
        "assert wire_version() == 2\n"
        "frame = framing.HEADER.pack(framing.MAGIC, 3, 0, 1) + b'\\x80'\n"
        "for attempt in (lambda: framing.encode({}, 3), lambda: framing.FrameDecoder().feed(frame)):\n"
        "    try:\n"
        "        attempt()\n"
        "    except framing.ProtocolError as exc:\n"
        "        print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"}, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["unsupported protocol version 3 (this end speaks 1 and 2)"] * 2
