"""The guest's end of the frontend channel: request/reply over a Unix socket."""

from __future__ import annotations

import itertools
import socket
import threading
from typing import Any

from vrnic.core.proto import FrameDecoder, encode
from vrnic.errors import VrnicError, error_from_dict


class Channel:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise VrnicError(f"cannot reach vrnicd at {path}: {exc.strerror}") from exc
        self._decoder = FrameDecoder()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(self, op: str, fds: list[int] | None = None, **args: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        data = encode({"id": request_id, "op": op, "args": args})
        with self._lock:
            try:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.sendall(data)
                reply = self._read_reply()
            except OSError as exc:
                raise VrnicError(f"lost the channel to vrnicd: {exc.strerror or exc}") from exc
        if not reply.get("ok"):
            raise error_from_dict(reply.get("error") or {})
        result: dict[str, Any] = reply.get("result") or {}
        return result

    def _read_reply(self) -> dict[str, Any]:
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise VrnicError("vrnicd closed the channel")
            messages = self._decoder.feed(chunk)
            if messages:
                return messages[0]

    def close(self) -> None:
        self.sock.close()
