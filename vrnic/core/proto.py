"""The frontend <-> vrnicd wire protocol: versioned, length-prefixed, schema-checked, size-capped frames.

Frames are vrnic.core.framing (standard library only, for guests). Requests are
{"id", "op", "args"}; replies are {"id", "ok", "result"} or {"id", "ok": false,
"error": {"code", "message", ...}}. Nothing in here does I/O, so the same
protocol rides a Unix socket (container guests) and a VM's virtio-serial port.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vrnic.core.framing import HEADER, MAGIC, MAX_BODY, VERSION, FrameDecoder, ProtocolError, encode
from vrnic.errors import VrnicError

__all__ = ["HEADER", "MAGIC", "MAX_BODY", "VERSION", "FrameDecoder", "ProtocolError", "Request", "encode",
           "parse_request", "reply_error", "reply_ok"]


class Request(BaseModel):
    # strict: an id must be a JSON integer (not "5", 5.0 or true), so a reply always echoes what was sent
    model_config = ConfigDict(extra="forbid", strict=True)

    id: int = Field(ge=0, lt=1 << 63)
    op: str = Field(max_length=64)
    args: dict[str, Any] = {}


def parse_request(message: dict[str, Any]) -> Request:
    try:
        return Request.model_validate(message)
    except ValidationError as exc:
        raise ProtocolError(f"malformed request: {exc.errors()[0]['msg']}") from exc


def reply_ok(request_id: int, result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": request_id, "ok": True, "result": result or {}}


def reply_error(request_id: int, error: VrnicError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": error.to_dict()}
