"""The frontend channel: a Unix-domain socket guests attach through.

One thread per connection. The first message must be `attach` with the attach
token and two file descriptors (SCM_RIGHTS): the guest's sealed memfd arena and
its doorbell eventfd. A framing error ends the connection (the stream cannot be
trusted after it); a bad request only fails that request. When the connection
ends for any reason (detach, crash, kill -9) the session is destroyed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vrnic.backend.attachment import AttachedSession, PeerCred, SessionOpener
from vrnic.core import verb_args
from vrnic.core.proto import FrameDecoder, ProtocolError, encode, parse_request, reply_error, reply_ok
from vrnic.errors import Conflict, InvalidArgument, VrnicError

log = logging.getLogger(__name__)

RECV_BYTES = 65536
MAX_FDS = 3
_UCRED = struct.Struct("3i")


class ChannelServer:
    def __init__(self, path: Path, open_session: SessionOpener, mode: int = 0o666) -> None:
        self.path = path
        self.open_session = open_session
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, mode)  # guests authenticate with their token, not with file permissions
        self.sock.listen(64)
        self._stopping = False
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="vrnic-channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self._lock:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="vrnic-guest", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        cred = PeerCred(pid, uid, gid)
        decoder = FrameDecoder()
        session: AttachedSession | None = None
        try:
            while True:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(conn, RECV_BYTES, MAX_FDS)
                except OSError:
                    return
                if not data:
                    return
                try:
                    messages = decoder.feed(data)
                except ProtocolError as exc:
                    self._send(conn, reply_error(0, exc))
                    return
                for message in messages:
                    request_id = message.get("id", 0) if isinstance(message.get("id"), int) else 0
                    try:
                        request = parse_request(message)
                        if session is None:
                            owned, fds = fds, []  # _attach owns them now: it keeps or closes every one
                            session = self._attach(request.op, request.args, owned, cred, conn)
                            self._send(conn, reply_ok(request.id, session.attach_result()))
                            continue
                        if request.op == "attach":
                            raise Conflict("already attached", current_state="attached")
                        if request.op == "detach":  # tear down before replying, so a re-attach finds it free
                            session.close()
                            self._send(conn, reply_ok(request.id))
                            return
                        result = session.handle(request.op, request.args)
                        self._send(conn, reply_ok(request.id, result))
                    except VrnicError as exc:
                        self._send(conn, reply_error(request_id, exc))
                    except Exception as exc:  # a daemon bug must fail one request, not the daemon
                        log.exception("request %s failed", message.get("op"))
                        self._send(conn, reply_error(request_id, VrnicError(f"internal error: {exc}")))
                for fd in fds:  # descriptors nobody asked for
                    os.close(fd)
        finally:
            if session is not None:
                session.close()
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _attach(self, op: str, raw: dict[str, Any], fds: list[int], cred: PeerCred,
                conn: socket.socket) -> AttachedSession:
        try:
            if op != "attach":
                raise InvalidArgument("the first request must be attach")
            try:
                args = verb_args.Attach.model_validate(raw)
            except ValidationError:
                raise InvalidArgument("attach takes a token (string) and busy_poll (bool)") from None
            if len(fds) not in (2, 3):
                raise InvalidArgument("attach needs two file descriptors: the arena memfd and the doorbell eventfd"
                                      " (and optionally a completion-notify eventfd)")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

        def disconnect() -> None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

        session = self.open_session(args, fds, cred, disconnect)
        log.info("vRNIC %s attached by pid %d uid %d", session.vrnic_id, cred.pid, cred.uid)
        return session

    @staticmethod
    def _send(conn: socket.socket, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(encode(message))
