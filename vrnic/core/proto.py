"""The frontend <-> vrnicd wire protocol: versioned, length-prefixed, schema-checked, size-capped frames.

Frames are vrnic.core.framing (standard library only, for guests; msgpack where it imports): a JSON body
(version 1), a binary one (version 2) or a MessagePack one (version 3), each frame read by its own version. Requests are
{"id", "op", "args"}; replies are {"id", "ok", "result"} or {"id", "ok": false,
"error": {"code", "message", ...}}. Nothing in here does I/O, so the same
protocol rides a Unix socket (container guests) and a VM's virtio-serial port.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from vrnic.core.framing import (
    BINARY_VERSION,
    HEADER,
    JSON_VERSION,
    MAGIC,
    MAX_BODY,
    MSGPACK_VERSION,
    VERSION,
    VERSIONS,
    FrameDecoder,
    ProtocolError,
    encode,
)
from vrnic.errors import VrnicError

__all__ = ["BINARY_VERSION", "HEADER", "JSON_VERSION", "MAGIC", "MAX_BODY", "MSGPACK_VERSION", "VERSION", "VERSIONS",
           "FrameDecoder", "ParsedRequest", "ProtocolError", "Request", "encode", "parse_request", "reply_error",
           "reply_ok"]


class Request(BaseModel):
    """The request envelope's rules; parse_request applies them on the hot path (property-tested equal).

    strict: an id must be a JSON integer (not "5", 5.0 or true), so a reply always echoes what was sent."""
    model_config = ConfigDict(extra="forbid", strict=True)

    id: int = Field(ge=0, lt=1 << 63)
    op: str = Field(max_length=64)
    args: dict[str, Any] = {}


_REQUEST_FIELDS = frozenset(Request.model_fields)
_MAX_ID = 1 << 63
_MAX_OP = Request.model_fields["op"].metadata[0].max_length


class ParsedRequest(NamedTuple):
    """A request that passed Request's checks; a plain tuple, as building a model instance per frame cost a
    tenth of an empty request's dispatch (issue 14)."""

    id: int
    op: str
    args: dict[str, Any]


def parse_request(message: dict[str, Any]) -> ParsedRequest:
    """Request's checks, written out: this runs for every frame, and a pydantic validation of the envelope cost
    more than some verbs (issue 14). The fields' arguments are still checked by their schemas (verb_args)."""
    request_id, op, args = message.get("id"), message.get("op"), message.get("args", {})
    if message.keys() - _REQUEST_FIELDS:
        problem = "extra fields are not permitted"
    elif type(request_id) is not int or not 0 <= request_id < _MAX_ID:  # not bool, float or str (strict)
        problem = f"id must be an integer in [0, 2**63), not {request_id!r}"[:120]
    elif type(op) is not str or len(op) > _MAX_OP:
        problem = f"op must be a string of at most {_MAX_OP} characters"
    elif type(args) is not dict:
        problem = "args must be an object"
    else:
        return ParsedRequest(request_id, op, args)
    raise ProtocolError(f"malformed request: {problem}")


def reply_ok(request_id: int, result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": request_id, "ok": True, "result": result or {}}


def reply_error(request_id: int, error: VrnicError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": error.to_dict()}
