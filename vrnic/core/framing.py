"""Framing for the frontend <-> vrnicd protocol: versioned, length-prefixed, size-capped JSON frames.

Standard library only: a VM's frontend imports this, and a VM lacks the host's packages (pydantic).
A frame is an 8-byte header (magic, version, reserved, body length) followed by a
UTF-8 JSON object. No I/O here, so the same frames ride a Unix socket or a VM's
virtio-serial port.
"""

from __future__ import annotations

import array
import json
import socket
import struct
from typing import Any

from vrnic.errors import InvalidArgument

MAGIC = 0x5652  # "VR"
VERSION = 1
HEADER = struct.Struct("!HBBI")
MAX_BODY = 64 * 1024


class ProtocolError(InvalidArgument):
    """The peer sent something that is not a valid frame or message."""

    code = "protocol_error"


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_BODY}-byte cap")
    return HEADER.pack(MAGIC, VERSION, 0, len(body)) + body


def fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an SCM_RIGHTS message carried (what socket.recv_fds returns, from recvmsg_into)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", data[:len(data) - len(data) % 4])
    return fds


class FrameDecoder:
    """Incremental decoder: feed bytes, take whole messages. Errors are final for the stream."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | memoryview) -> list[dict[str, Any]]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            magic, version, _reserved, length = HEADER.unpack_from(self._buffer)
            if magic != MAGIC:
                raise ProtocolError(f"bad magic 0x{magic:04x}")
            if version != VERSION:
                raise ProtocolError(f"unsupported protocol version {version} (this daemon speaks {VERSION})")
            if length > MAX_BODY:
                raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_BODY}-byte cap")
            if len(self._buffer) < HEADER.size + length:
                break
            body = bytes(self._buffer[HEADER.size:HEADER.size + length])
            del self._buffer[:HEADER.size + length]
            try:
                message = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ProtocolError(f"frame body is not JSON: {exc}") from exc
            except RecursionError:  # e.g. 30000 nested '[': fits the cap, but must not escape as a crash
                raise ProtocolError("frame body nests too deeply") from None
            if not isinstance(message, dict):
                raise ProtocolError("frame body must be a JSON object")
            messages.append(message)
        return messages

    @property
    def pending(self) -> int:
        return len(self._buffer)
