"""Framing for the frontend <-> vrnicd protocol: versioned, length-prefixed, size-capped frames.

Standard library only: a VM's frontend imports this, and a VM lacks the host's packages (pydantic).
A frame is an 8-byte header (magic, version, reserved, body length) followed by a body
that encodes one message (a dict with str keys) as its version says:

- version 1: a UTF-8 JSON object;
- version 2: the tagged binary encoding below, smaller and strict by construction;
- version 3: a MessagePack map, coded by msgpack's C extension (see "version 3" below). Spoken where msgpack
  imports: vrnicd always, a guest that has it; a VM's standard-library frontend speaks 1 and 2.

A decoder reads each frame by its own version, so a peer may speak any it knows (vrnicd
answers in the version it was asked in). No I/O here, so the same frames ride a Unix
socket or a VM's virtio-serial port.

The binary encoding: one tag byte per value, then its payload (big-endian, as the header).

    0x00-0x7f  the integer 0..127             0xc3  int32 (4 bytes)
    0x80-0x9f  a str of 0..31 UTF-8 bytes     0xc4  int64 (8 bytes)
    0xa0-0xaf  a list of 0..15 items          0xc5  float64, finite (8 bytes)
    0xb0-0xbf  a dict of 0..15 entries        0xc6  str: u32 byte length, UTF-8 bytes
    0xc0       None                           0xc7  list: u32 item count, items
    0xc1       False                          0xc8  dict: u32 entry count, (str key, value) pairs
    0xc2       True                           0xe0-0xff  the integer -32..-1
    0xc9-0xdf  unassigned: refused

It carries what version 1 carries (None, bool, int, float, str, list, dict), so a
message means the same in both; and no bytes, which JSON cannot carry and no verb needs.
"""

from __future__ import annotations

import array
import json
import operator
import socket
import struct
import threading
from collections.abc import Iterable
from math import isfinite
from typing import Any

from vrnic.errors import InvalidArgument

try:  # not in a VM's frontend, which has the standard library only: there it speaks versions 1 and 2
    import msgpack
except ImportError:
    msgpack = None

MAGIC = 0x5652  # "VR"
JSON_VERSION = 1
BINARY_VERSION = 2
MSGPACK_VERSION = 3
VERSIONS = (JSON_VERSION, BINARY_VERSION) + ((MSGPACK_VERSION,) if msgpack is not None else ())
VERSION = JSON_VERSION  # encode()'s default, as every vrnicd speaks it; the frontend picks its own (frontend.channel)
HEADER = struct.Struct("!HBBI")
MAX_BODY = 64 * 1024
MAX_BATCH = 128  # objects one batched request may name: its reply stays well under MAX_BODY
# Caps of the binary encoding, beyond the body's. A decoder checks a declared size against them before it
# reads on, and an encoder refuses what the peer would refuse, so the error is the sender's own.
MAX_DEPTH = 32  # containers nested in one another, the message itself included (messages use 3 or 4)
MAX_STRING = 32 * 1024  # UTF-8 bytes of one str
MAX_ITEMS = 8192  # items of one list or entries of one dict
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1

_SPOKEN = ", ".join(map(str, VERSIONS[:-1])) + f" and {VERSIONS[-1]}"


class ProtocolError(InvalidArgument):
    """The peer sent something that is not a valid frame or message."""

    code = "protocol_error"


# ----- version 2: the binary body ----------------------------------------------------------------

_FIXSTR, _FIXLIST, _FIXDICT, _NONE, _FALSE, _TRUE = 0x80, 0xA0, 0xB0, 0xC0, 0xC1, 0xC2
_INT32, _INT64, _FLOAT, _STR, _LIST, _DICT, _NEGFIX = 0xC3, 0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xE0
_HEAD_INT32 = struct.Struct("!Bi")  # tag and payload in one pack: one bytes object per value
_HEAD_INT64 = struct.Struct("!Bq")
_HEAD_FLOAT = struct.Struct("!Bd")
_HEAD_SIZE = struct.Struct("!BI")
_I32 = struct.Struct("!i")
_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")
_SIZE = struct.Struct("!I")
_HEADER_ROOM = bytes(HEADER.size)  # a binary frame is built in one buffer, its header packed in last
_TAG_NAMES = {_NONE: "None", _FALSE: "a bool", _TRUE: "a bool", _INT32: "an int", _INT64: "an int",
              _FLOAT: "a float", _STR: "a str", _LIST: "a list", _DICT: "a dict"}
# Keys are few and repeat in every message ("id", "op", "args", "ok", "result"): their encodings are kept.
# Bounded, so a program that invents keys cannot grow it without end.
_KEY_CACHE: dict[str, bytes] = {}
_KEY_CACHE_SIZE = 1024


def _cannot_encode(value: Any) -> ProtocolError:
    return ProtocolError(f"cannot encode a {type(value).__name__}: messages carry None, bool, int, float, str, list "
                         f"and dict")


def _tag_name(tag: int) -> str:
    if tag < _FIXSTR or tag >= _NEGFIX:
        return "an int"
    if tag < _FIXLIST:
        return "a str"
    if tag < _FIXDICT:
        return "a list"
    if tag < _NONE:
        return "a dict"
    return _TAG_NAMES.get(tag, f"unknown tag 0x{tag:02x}")


def _put_str(out: bytearray, value: str) -> None:
    data = value.encode()  # strict: a lone surrogate raises UnicodeEncodeError (encode_body turns it into ours)
    _put_head(out, len(data), _FIXSTR, 32, _STR, MAX_STRING, "str", "bytes", "byte")
    out += data


def _put_int(out: bytearray, value: int) -> None:
    if 0 <= value < 0x80:
        out.append(value)
    elif -32 <= value < 0:
        out.append(value & 0xFF)
    elif -0x8000_0000 <= value < 0x8000_0000:
        out += _HEAD_INT32.pack(_INT32, value)
    elif INT_MIN <= value <= INT_MAX:
        out += _HEAD_INT64.pack(_INT64, value)
    else:
        raise ProtocolError(f"an integer of {value.bit_length()} bits is outside int64")  # no str(): it may be huge


def _key(key: object) -> bytes:
    """A dict key's encoding, kept for next time."""
    if type(key) is not str:
        if not isinstance(key, str):
            raise ProtocolError(f"dict keys must be str, not {type(key).__name__}")
        key = str.__str__(key)  # a str subclass (StrEnum) goes as its text, as JSON sends it
    out = bytearray()
    _put_str(out, key)
    data = bytes(out)
    if len(data) <= 32 and len(_KEY_CACHE) < _KEY_CACHE_SIZE:  # short keys only: the cache stays small
        _KEY_CACHE[key] = data
    return data


def _put_head(out: bytearray, size: int, fixed: int, fixed_below: int, tag: int, cap: int,
              noun: str, units: str, unit: str) -> None:
    """A str's, list's or dict's tag and size: the short form below fixed_below, the long one up to cap."""
    if size < fixed_below:
        out.append(fixed | size)
    elif size <= cap:
        out += _HEAD_SIZE.pack(tag, size)
    else:
        raise ProtocolError(f"a {noun} of {size} {units} exceeds the {cap}-{unit} cap")


def _check_depth(depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"the message nests deeper than {MAX_DEPTH} levels")


def _put_dict(out: bytearray, value: dict[Any, Any], depth: int) -> None:
    _check_depth(depth)
    _put_head(out, len(value), _FIXDICT, 16, _DICT, MAX_ITEMS, "dict", "entries", "entry")
    cache = _KEY_CACHE
    for key, item in value.items():
        data = cache.get(key)
        out += _key(key) if data is None else data
        kind = type(item)  # the common leaves inline: a call per value is most of the cost
        if kind is int:
            if 0 <= item < 0x80:
                out.append(item)
            elif 0 < item <= INT_MAX:  # handles and ids: 63 and 40 bits
                out += _HEAD_INT64.pack(_INT64, item) if item >= 0x8000_0000 else _HEAD_INT32.pack(_INT32, item)
            else:
                _put_int(out, item)
        elif kind is str:
            data = item.encode()
            if len(data) < 32:
                out.append(_FIXSTR | len(data))
                out += data
            else:
                _put_str(out, item)
        elif kind is dict:  # "args", "result", "error": a call saved
            _put_dict(out, item, depth + 1)
        elif kind is bool:
            out.append(_TRUE if item else _FALSE)
        else:
            _put(out, item, depth)


def _put_list(out: bytearray, value: list[Any] | tuple[Any, ...], depth: int) -> None:
    _check_depth(depth)
    _put_head(out, len(value), _FIXLIST, 16, _LIST, MAX_ITEMS, "list", "items", "item")
    for item in value:
        if type(item) is int and 0 <= item < 0x80:
            out.append(item)
        else:
            _put(out, item, depth)


def _put(out: bytearray, value: Any, depth: int) -> None:
    kind = type(value)
    if kind is int:
        _put_int(out, value)
    elif kind is str:
        _put_str(out, value)
    elif kind is dict:
        _put_dict(out, value, depth + 1)
    elif value is None:
        out.append(_NONE)
    elif kind is bool:
        out.append(_TRUE if value else _FALSE)
    elif kind is list or kind is tuple:  # a tuple goes as a list, as JSON sends it
        _put_list(out, value, depth + 1)
    elif kind is float:
        if not isfinite(value):  # JSON has no NaN or infinity either, and NaN != NaN breaks equality
            raise ProtocolError(f"float {value} is not finite")
        out += _HEAD_FLOAT.pack(_FLOAT, value)
    # Subclasses (IntFlag, StrEnum, ...) go as their base type's value, as JSON sends them.
    elif isinstance(value, int):  # bool cannot be subclassed
        _put_int(out, int.__int__(value))
    elif isinstance(value, str):
        _put_str(out, str.__str__(value))
    elif isinstance(value, float):
        _put(out, float.__float__(value), depth)
    elif isinstance(value, dict):
        _put_dict(out, value, depth + 1)
    elif isinstance(value, list | tuple):
        _put_list(out, value, depth + 1)
    else:
        raise _cannot_encode(value)


def _encode_into(out: bytearray, message: dict[str, Any], depth: int = 1) -> None:
    """A dict at depth (1: the message itself; 2: an envelope's args or result), encoding errors as ours."""
    if type(message) is not dict and not isinstance(message, dict):
        raise ProtocolError(f"a message is a dict, not a {type(message).__name__}")
    try:
        _put_dict(out, message, depth)
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"a str is not valid Unicode text ({exc.reason})") from None
    except RecursionError:  # a cyclic list or dict: caught by the depth cap first, kept as a backstop
        raise ProtocolError(f"the message nests deeper than {MAX_DEPTH} levels") from None


def encode_body(message: dict[str, Any]) -> bytes:
    """A message as a version 2 body (no header)."""
    out = bytearray()
    _encode_into(out, message)
    return bytes(out)


def _truncated(what: str) -> ProtocolError:
    return ProtocolError(f"frame body is truncated: {what} runs past its end")


def _get_str(body: bytes, pos: int, size: int) -> tuple[str, int]:
    if size > MAX_STRING:
        raise ProtocolError(f"a str of {size} bytes exceeds the {MAX_STRING}-byte cap")
    stop = pos + size
    if stop > len(body):
        raise _truncated(f"a str of {size} bytes")
    return body[pos:stop].decode(), stop  # strict UTF-8: UnicodeDecodeError is caught in decode_body


def _get_dict(body: bytes, pos: int, size: int, depth: int) -> tuple[dict[str, Any], int]:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"frame body nests deeper than {MAX_DEPTH} levels")
    if size > MAX_ITEMS:
        raise ProtocolError(f"a dict of {size} entries exceeds the {MAX_ITEMS}-entry cap")
    start, end = pos, len(body)
    message: dict[str, Any] = {}
    for _ in range(size):
        tag = body[pos]  # past the end: IndexError, which decode_body reports as truncation
        if _FIXSTR <= tag < _FIXLIST:
            stop = pos + tag - _FIXSTR + 1
            if stop > end:
                raise _truncated("a dict key")
            key = body[pos + 1:stop].decode()
            pos = stop
        elif tag == _STR:
            key, pos = _get_str(body, pos + 5, _SIZE.unpack_from(body, pos + 1)[0])
        else:
            raise ProtocolError(f"a dict key must be a str, not {_tag_name(tag)}")
        tag = body[pos]  # the common leaves inline, as in _put_dict
        if tag < _FIXSTR:
            message[key] = tag
            pos += 1
        elif tag < _FIXLIST:
            stop = pos + tag - _FIXSTR + 1
            if stop > end:
                raise _truncated("a str")
            message[key] = body[pos + 1:stop].decode()
            pos = stop
        elif tag == _INT64:
            message[key] = _I64.unpack_from(body, pos + 1)[0]
            pos += 9
        elif tag == _INT32:
            message[key] = _I32.unpack_from(body, pos + 1)[0]
            pos += 5
        elif _FIXDICT <= tag < _NONE:  # "args", "result", "error": a call saved
            message[key], pos = _get_dict(body, pos + 1, tag - _FIXDICT, depth + 1)
        elif tag == _TRUE:  # every reply's "ok"
            message[key] = True
            pos += 1
        else:
            message[key], pos = _get(body, pos, depth)
    if len(message) != size:  # cheaper than a lookup per key; the error path finds which
        raise ProtocolError(f"a dict repeats the key {_repeated(body, start, size, depth)!r}"[:120])
    return message, pos


def _repeated(body: bytes, pos: int, size: int, depth: int) -> str:
    """The first key a dict read whole repeats (its entries decoded once already)."""
    seen = set()
    for _ in range(size):
        key, pos = _get(body, pos, depth)
        if key in seen:
            return str(key)
        seen.add(key)
        pos = _get(body, pos, depth)[1]
    return ""


def _get_list(body: bytes, pos: int, size: int, depth: int) -> tuple[list[Any], int]:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"frame body nests deeper than {MAX_DEPTH} levels")
    if size > MAX_ITEMS:
        raise ProtocolError(f"a list of {size} items exceeds the {MAX_ITEMS}-item cap")
    items: list[Any] = []
    append = items.append
    for _ in range(size):
        tag = body[pos]
        if tag < _FIXSTR:
            append(tag)
            pos += 1
        else:
            item, pos = _get(body, pos, depth)
            append(item)
    return items, pos


def _get(body: bytes, pos: int, depth: int) -> tuple[Any, int]:
    tag = body[pos]
    pos += 1
    if tag < _FIXSTR:
        return tag, pos
    if tag < _FIXLIST:
        return _get_str(body, pos, tag - _FIXSTR)
    if tag < _FIXDICT:
        return _get_list(body, pos, tag - _FIXLIST, depth + 1)
    if tag < _NONE:
        return _get_dict(body, pos, tag - _FIXDICT, depth + 1)
    if tag >= _NEGFIX:
        return tag - 0x100, pos
    if tag == _NONE:
        return None, pos
    if tag == _FALSE:
        return False, pos
    if tag == _TRUE:
        return True, pos
    if tag == _INT32:
        return _I32.unpack_from(body, pos)[0], pos + 4
    if tag == _INT64:
        return _I64.unpack_from(body, pos)[0], pos + 8
    if tag == _FLOAT:
        value = _F64.unpack_from(body, pos)[0]
        if not isfinite(value):
            raise ProtocolError(f"float {value} is not finite")
        return value, pos + 8
    if tag == _STR:
        return _get_str(body, pos + 4, _SIZE.unpack_from(body, pos)[0])
    if tag == _LIST:
        return _get_list(body, pos + 4, _SIZE.unpack_from(body, pos)[0], depth + 1)
    if tag == _DICT:
        return _get_dict(body, pos + 4, _SIZE.unpack_from(body, pos)[0], depth + 1)
    raise ProtocolError(f"unknown tag 0x{tag:02x} at byte {pos - 1} of the frame body")


def decode_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A version 2 body (no header) as its message. Anything but a well-formed dict raises ProtocolError."""
    if type(body) is not bytes:  # a view or bytearray: the reads below want bytes (slices that decode)
        body = bytes(body)
    try:
        tag = body[0]
        if _FIXDICT <= tag < _NONE:
            message, pos = _get_dict(body, 1, tag - _FIXDICT, 1)
        elif tag == _DICT:
            message, pos = _get_dict(body, 5, _SIZE.unpack_from(body, 1)[0], 1)
        else:
            raise ProtocolError(f"frame body must be a dict, not {_tag_name(tag)}")
    except (IndexError, struct.error):  # a read past the end (a size read past it is checked where it is used)
        raise ProtocolError("frame body is truncated") from None
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"a str in the frame body is not UTF-8 ({exc.reason})") from None
    if pos != len(body):
        raise ProtocolError(f"{len(body) - pos} trailing bytes after the message in the frame body")
    return message


# ----- version 3: MessagePack ----------------------------------------------------------------------
# The body is one MessagePack map, read and written by msgpack's C code: under the lab's TCG a null_rpc's framing
# in version 2's Python was about a third of its round trip (issue 14). The decoder refuses, as a ProtocolError:
# what is not MessagePack, trailing bytes, a body that is not a map, a str that is not UTF-8, a map key that is not
# a str (or bytes), an extension type (but msgpack's own Timestamp, which it reads itself), nesting past msgpack's
# 1024 levels, and any size past the body's cap (64 KiB bounds every str, bin, list and map in it). A value
# version 2 has no word for (bytes, an int in [2**63, 2**64), a float that is not finite, a Timestamp) or a map
# that repeats a key (its last value counts, as in version 1) decodes, and meets the verb's argument schema,
# which refuses any value of a type or range it does not name (vrnic.core.verb_args: strict pydantic models).
# The encoder refuses what msgpack cannot pack (an int past 64 bits, a type outside the message types, nesting
# past 511 levels) and, in a request's arguments, what the decoder would refuse (a map keyed by other than str,
# an extension type) or version 2 would (nesting past MAX_DEPTH), so the error is the sender's own and the
# channel lives on.

_packers = threading.local()  # a Packer per thread: its buffer is its own while it packs


def _pack(message: dict[str, Any]) -> bytes:
    """A message as a version 3 frame, header and body in one bytes."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer()
    try:
        body: bytes = packer.pack(message)  # resets its buffer when it raises
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"a str is not valid Unicode text ({exc.reason})") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode the message in version 3: {exc}") from None
    if len(body) > MAX_BODY:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_BODY}-byte cap")
    return HEADER.pack(MAGIC, MSGPACK_VERSION, 0, len(body)) + body


_V3_PLAIN = frozenset((int, str, bool, type(None), float, bytes))  # what a v3 decoder reads whatever its value


def _check_v3_args(args: dict[str, Any]) -> None:
    """Before a request goes out: what msgpack would pack but a v3 decoder refuses, in args (str keys, from
    **kwargs). Scalars cost one set lookup; only lists and dicts are walked."""
    for value in args.values():
        if type(value) not in _V3_PLAIN:
            _check_v3_value(value, 2)


def _check_v3_value(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:  # version 2's cap: no verb nests a tenth as deep
        raise ProtocolError(f"the message nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, msgpack.ExtType | msgpack.Timestamp):  # ExtType is a tuple: looked at first
        raise _cannot_encode(value)
    items: Iterable[Any]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ProtocolError(f"dict keys must be str, not {type(key).__name__}")
        items = value.values()
    elif isinstance(value, list | tuple):
        items = value
    else:
        return
    for item in items:
        if type(item) not in _V3_PLAIN:
            _check_v3_value(item, depth + 1)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"an extension type ({code}) in the frame body: messages carry none")


def _decode_msgpack(body: bytes) -> dict[str, Any]:
    """A version 3 body, decoded whole by msgpack's unpackb (bodies arrive whole: the header gives their length).
    Not a streaming Unpacker kept per stream: each allocates a 1 MiB buffer, and under the lab's TCG making one
    cost 0.2 ms of every attach, on each side (issue 14); unpackb needs no buffer and decodes as fast."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext)
    except msgpack.ExtraData as exc:  # _refuse_ext's ProtocolError passes through as it is
        raise ProtocolError(f"{len(exc.extra)} trailing bytes after the message in the frame body") from None
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"a str in the frame body is not UTF-8 ({exc.reason})") from None
    except (ValueError, TypeError) as exc:  # truncated, malformed, too deep, or a key that is not a str
        if str(exc).endswith("incomplete input"):
            raise ProtocolError("frame body is truncated") from None
        raise ProtocolError(f"frame body is not a version 3 message: {exc}"[:200]) from None
    if type(message) is not dict:
        raise ProtocolError(f"frame body must be a map, not {type(message).__name__}")
    return message


# ----- frames --------------------------------------------------------------------------------------

_json_encode = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps(separators=...) builds one per call


def _unsupported(version: int) -> ProtocolError:
    return ProtocolError(f"unsupported protocol version {version} (this end speaks {_SPOKEN})")


def encode(message: dict[str, Any], version: int = VERSION) -> bytes:
    """One frame: header and body in one buffer, for one write."""
    if version == BINARY_VERSION:
        out = bytearray(_HEADER_ROOM)
        _encode_into(out, message)
        return _framed(out)
    if version == MSGPACK_VERSION and msgpack is not None:
        if type(message) is not dict and not isinstance(message, dict):
            raise ProtocolError(f"a message is a dict, not a {type(message).__name__}")
        return _pack(message)
    if version != JSON_VERSION:
        raise _unsupported(version)
    body = _json_encode(message).encode()
    if len(body) > MAX_BODY:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_BODY}-byte cap")
    return HEADER.pack(MAGIC, JSON_VERSION, 0, len(body)) + body


# A successful reply, {"id": ..., "ok": True, "result": ...}, and a request, {"id": ..., "op": ..., "args": ...},
# around the parts that vary (see encode_ok and encode_request)
_OK_HEAD = _REQUEST_HEAD = bytes([_FIXDICT | 3]) + _key("id")
_OK_MIDDLE = _key("ok") + bytes([_TRUE]) + _key("result")
_OP_KEY, _ARGS_KEY = _key("op"), _key("args")


def encode_ok(request_id: int, result: dict[str, Any], version: int = VERSION) -> bytes:
    """encode({"id": request_id, "ok": True, "result": result}, version), the same bytes, without the reply dict
    and a level of the encoder's loop: every answer vrnicd sends is one (issue 14)."""
    if version == MSGPACK_VERSION and msgpack is not None:
        return _pack({"id": request_id, "ok": True, "result": result})  # vrnicd's own data: packed unchecked
    if version != BINARY_VERSION or type(request_id) is not int or type(result) is not dict:
        return encode({"id": request_id, "ok": True, "result": result}, version)
    out = bytearray(_HEADER_ROOM)
    out += _OK_HEAD
    _put_int(out, request_id)
    out += _OK_MIDDLE
    _encode_into(out, result, 2)
    return _framed(out)


def _framed(out: bytearray) -> bytes:
    """A version 2 frame from its buffer (header room first, body after), the header packed in."""
    size = len(out) - HEADER.size
    if size > MAX_BODY:
        raise ProtocolError(f"message of {size} bytes exceeds the {MAX_BODY}-byte cap")
    HEADER.pack_into(out, 0, MAGIC, BINARY_VERSION, 0, size)
    return bytes(out)


def encode_request(request_id: int, op: str, args: dict[str, Any], version: int = VERSION) -> bytes:
    """encode({"id": request_id, "op": op, "args": args}, version), the same bytes, as encode_ok builds a reply:
    every call a guest makes is one. An op that is not ASCII (none is) goes the general way, which turns a
    lone surrogate into our error."""
    if version == MSGPACK_VERSION and msgpack is not None and type(args) is dict:
        _check_v3_args(args)
        return _pack({"id": request_id, "op": op, "args": args})
    if version != BINARY_VERSION or type(request_id) is not int or type(op) is not str or type(args) is not dict \
            or not op.isascii():
        return encode({"id": request_id, "op": op, "args": args}, version)
    out = bytearray(_HEADER_ROOM)
    out += _REQUEST_HEAD
    _put_int(out, request_id)
    out += _OP_KEY
    _put_str(out, op)
    out += _ARGS_KEY
    _encode_into(out, args, 2)
    return _framed(out)


def _decode_json(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode())  # strict UTF-8, and json.loads(str) skips guessing an encoding
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame body is not JSON: {exc}") from exc
    except RecursionError:  # e.g. 30000 nested '[': fits the cap, but must not escape as a crash
        raise ProtocolError("frame body nests too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame body must be a JSON object")
    return message


def fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an SCM_RIGHTS message carried (what socket.recv_fds returns, from recvmsg_into)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", data[:len(data) - len(data) % 4])
    return fds


_UCRED = struct.Struct("3i")


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel saw it connect
    (SO_PEERCRED)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(pid), int(uid), int(gid)


def _header(chunk: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    """A frame header's version and body length, refused as soon as it is whole (before the body arrives)."""
    magic, version, _reserved, length = HEADER.unpack_from(chunk, pos)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:04x}")
    if version not in VERSIONS:
        raise _unsupported(version)
    if length > MAX_BODY:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_BODY}-byte cap")
    return version, length


_unpack_header, _HEADER_SIZE = HEADER.unpack_from, HEADER.size  # the per-frame loop's, bound once
_second = operator.itemgetter(1)


class FrameDecoder:
    """Incremental decoder: feed bytes, take whole messages. Errors are final for the stream.

    Each frame is read by its own header's version. `version` is the last one read (1 before any): what a
    reply to a frame refused goes back in.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.version = JSON_VERSION

    def feed(self, data: bytes | bytearray | memoryview) -> list[dict[str, Any]]:
        return list(map(_second, self.feed_frames(data)))

    def feed_frames(self, data: bytes | bytearray | memoryview) -> list[tuple[int, dict[str, Any]]]:
        """The whole frames so far, each as (its version, its message)."""
        buffered = self._buffer
        if buffered:
            buffered += data
            if not self._whole_frame(buffered):  # a trickle is not copied again per byte
                return []
            chunk: bytes | bytearray | memoryview = bytes(buffered)
            buffered.clear()
        else:
            chunk = data  # the usual case, whole frames: read where they are, nothing goes through the buffer
        frames = []
        pos, end = 0, len(chunk)
        while end - pos >= _HEADER_SIZE:
            magic, version, _reserved, length = _unpack_header(chunk, pos)
            if magic != MAGIC or version not in VERSIONS or length > MAX_BODY:
                _header(chunk, pos)  # raises, naming what is wrong
            start = pos + _HEADER_SIZE
            if end - start < length:
                break
            pos = start + length
            self.version = version
            body = chunk[start:pos]
            if type(body) is not bytes:  # bytes index fastest; and a view's memory may be reused after this call
                body = bytes(body)
            if version == BINARY_VERSION:
                frames.append((version, decode_body(body)))
            elif version == MSGPACK_VERSION:
                frames.append((version, _decode_msgpack(body)))
            else:
                frames.append((version, _decode_json(body)))
        if pos < end:
            buffered += chunk[pos:]
        return frames

    @staticmethod
    def _whole_frame(buffered: bytearray) -> bool:
        return len(buffered) >= _HEADER_SIZE and len(buffered) - _HEADER_SIZE >= _header(buffered, 0)[1]

    @property
    def pending(self) -> int:
        return len(self._buffer)
