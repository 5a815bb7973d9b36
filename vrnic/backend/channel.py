"""The guest channel: a Unix-domain socket guests attach through, hardened against idle and hostile clients.

Connections that have not attached yet cost no thread: one selector thread
accepts them, reads their first request, and drops them at the attach deadline.
The first request must be `attach` with the attach token and two or three file
descriptors (SCM_RIGHTS): the guest's sealed memfd arena, its doorbell eventfd
and optionally a completion-notify eventfd. Only an attached guest gets a thread
of its own, and there is at most one guest per vRNIC, under a total cap. A
thread whose guest left waits a while for the next guest (a few at most).
When opening the session does no device I/O (the opener says so), the selector
thread opens it and answers the attach itself, and only then hands the guest to
its thread: the attach waits for no thread to wake.

Pending connections are capped per uid and in total. When a cap is reached the
oldest pending connection of that uid (or, for the total cap, the oldest of
all) is dropped, never the newcomer: idle connections cannot starve a guest
that is about to attach, because a real guest sends its attach at once.

A framing error ends the connection (the stream cannot be trusted after it); a
bad request only fails that request. Each request is answered in its frame's
protocol version (1, JSON; 2, binary), so old and new guests are both served. Errors that are not VrnicErrors reach the
guest as "internal error (ref ...)" with the details in the log under that ref.
When the connection ends for any reason (detach, crash, kill -9) the session is
closed.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import queue
import secrets
import selectors
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vrnic.backend.attachment import AttachedSession, OpensQuickly, PeerCred, SessionOpener
from vrnic.core import verb_args
from vrnic.core.framing import encode_ok, fds_of, peer_cred
from vrnic.core.proto import FrameDecoder, ParsedRequest, ProtocolError, encode, parse_request, reply_error, reply_ok
from vrnic.errors import Conflict, InvalidArgument, VrnicError

log = logging.getLogger(__name__)

RECV_BYTES = 65536
MAX_FDS = 3
_TOKEN_MAX = verb_args.Attach.model_fields["token"].metadata[0].max_length
_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)
EVICTION_LOG_INTERVAL_S = 10.0
# Guest threads that wait for the next guest once theirs left, and for how long: starting a thread put 0.9 ms on
# every attach's path in the lab (issue 14). One waits from the start and always stays.
KEPT_THREADS = 4
KEPT_THREAD_IDLE_S = 60.0


@dataclass(frozen=True)
class ChannelLimits:
    attach_deadline_s: float = 5.0  # a connection that has not attached by then is closed
    max_pending_per_uid: int = 32  # connections not attached yet, per local uid
    max_pending_total: int = 256
    max_sessions: int = 1024  # attached guests (each has one thread)
    socket_mode: int = 0o660
    socket_uid: int | None = None  # None: vrnicd's own
    socket_gid: int | None = None


def group_id(group: str | None) -> int | None:
    """The socket's group from a setting: a name or a number; None leaves vrnicd's own."""
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgument(f"no group {group!r} for the guest channel's socket") from None


def internal_error(exc: BaseException, what: str) -> VrnicError:
    """A generic error for the guest; the details go to the log under the same reference."""
    ref = secrets.token_hex(4)
    log.error("%s failed (ref %s)", what, ref, exc_info=exc)
    return VrnicError(f"internal error (ref {ref})")


class _Worker:
    """A guest thread (not started yet), and what hands it its next guest (None: end)."""

    def __init__(self, work: Callable[[_Worker, _Guest | None], None], guest: _Guest | None) -> None:
        self.next: queue.SimpleQueue[_Guest | None] = queue.SimpleQueue()
        # One receive buffer for every guest the thread serves: zeroing 64 KiB was 0.07 ms of an attach under TCG.
        # Only the bytes a recv just wrote are read, so nothing of one guest's requests reaches the next.
        self.buffer = memoryview(bytearray(RECV_BYTES))
        self.thread = threading.Thread(target=work, args=(self, guest), name="vrnic-guest", daemon=True)


@dataclass(eq=False)
class _Pending:
    conn: socket.socket
    cred: PeerCred
    deadline: float
    decoder: FrameDecoder = field(default_factory=FrameDecoder)


@dataclass(eq=False)
class _Guest:
    """An attach the selector hands to a guest thread: its session already open and answered, or (None) the
    request and descriptors for the thread to open it."""

    conn: socket.socket
    pending: _Pending
    version: int
    request: ParsedRequest
    args: verb_args.Attach
    fds: list[int]
    backlog: list[tuple[int, dict[str, Any]]]
    session: AttachedSession | None = None


class ChannelServer:
    def __init__(self, path: Path, open_session: SessionOpener, limits: ChannelLimits | None = None,
                 opens_quickly: OpensQuickly | None = None) -> None:
        self.path = path
        self.open_session = open_session
        self.opens_quickly = opens_quickly
        self.limits = limits or ChannelLimits()
        self.sock = _bind(path, self.limits)
        self.sock.setblocking(False)
        self.sock.listen(128)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # oldest first
        self._sessions: dict[socket.socket, threading.Thread | None] = {}  # None: opening in the selector
        self._idle: list[_Worker] = []  # guest threads waiting for a guest, the latest to wait last
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._last_eviction_log = -EVICTION_LOG_INTERVAL_S
        # The selector thread's receive buffer, kept: socket.recv_fds made 64 KiB anew for each attach (issue 14)
        self._selector_buffer = memoryview(bytearray(RECV_BYTES))
        self._thread = threading.Thread(target=self._loop, name="vrnic-channel", daemon=True)

    def start(self) -> None:
        self._selector.register(self.sock, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        self._new_worker(None)

    def stop(self) -> None:
        """Close every connection, end every session, join every thread. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            sessions = dict(self._sessions)
        for conn in sessions:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in sessions.values():
            if thread is not None:
                thread.join(timeout=10)
        with self._lock:
            idle, self._idle = self._idle, []
            workers = list(self._workers)
        for worker in idle:
            worker.next.put(None)
        for worker in workers:
            if worker.thread is not threading.current_thread():
                worker.thread.join(timeout=10)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.path.unlink(missing_ok=True)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def waiting_threads(self) -> int:
        """Guest threads waiting for a guest (a thread whose guest just left joins them a moment after)."""
        with self._lock:
            return len(self._idle)

    # ----- the selector thread: connections not attached yet ----------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                first = next(iter(self._pending.values()), None)  # the oldest has the nearest deadline
                timeout = None if first is None else max(0.0, first.deadline - now)
                for key, _ in self._selector.select(timeout):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 64)
                    else:
                        self._read_pending(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()
            self.sock.close()

    def _accept(self) -> None:
        """One connection per call: the selector reports the socket again while more wait (level-triggered), and
        accepting until EAGAIN raised and caught an exception on every attach (issue 14)."""
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and friends: keep serving those already here
            log.warning("guest channel: accept failed: %s", exc)
            return
        cred = PeerCred(*peer_cred(conn))
        self._make_room(cred.uid)
        conn.setblocking(False)
        self._pending[conn] = _Pending(conn, cred, time.monotonic() + self.limits.attach_deadline_s)
        self._selector.register(conn, selectors.EVENT_READ, "guest")
        # The guest connects before it builds its attach: when that is already here, it is read now rather than
        # after another turn of the selector (a failed read costs less than the turn; issue 14).
        self._read_pending(conn)

    def _make_room(self, uid: int) -> None:
        """Drop the oldest pending connections until the newcomer fits under both caps.

        At the total cap the victim is the oldest connection of the uid holding the most, so one user's
        flood only ever costs that user.
        """
        by_uid: dict[int, list[socket.socket]] = {}
        for conn, pending in self._pending.items():  # oldest first
            by_uid.setdefault(pending.cred.uid, []).append(conn)
        dropped = 0
        mine = by_uid.setdefault(uid, [])
        while len(mine) >= self.limits.max_pending_per_uid:
            self._drop(mine.pop(0))
            dropped += 1
        while len(self._pending) >= self.limits.max_pending_total:
            # the newcomer counts for its uid: on a tie, the user about to add one more pays
            heaviest = max(by_uid, key=lambda u: len(by_uid[u]) + (u == uid))
            self._drop(by_uid[heaviest].pop(0))
            dropped += 1
        now = time.monotonic()
        if dropped and now - self._last_eviction_log > EVICTION_LOG_INTERVAL_S:  # a flood logs once in a while
            self._last_eviction_log = now
            log.warning("guest channel: connections waiting to attach are at their cap (uid %d); "
                        "dropping the oldest idle ones", uid)

    def _expire(self, now: float) -> None:
        for conn, pending in list(self._pending.items()):
            if pending.deadline > now:
                break  # ordered by arrival, so by deadline
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _read_pending(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:
            return
        try:
            size, ancillary, _flags, _addr = conn.recvmsg_into([self._selector_buffer], _FDS_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        fds = fds_of(ancillary)
        data = self._selector_buffer[:size]  # the decoder copies what it keeps
        if not data:
            _close_fds(fds)
            self._drop(conn)
            return
        try:
            frames = pending.decoder.feed_frames(data)
        except ProtocolError as exc:
            _close_fds(fds)
            _send(conn, pending.decoder.version, reply_error(0, exc))
            self._drop(conn)
            return
        for index, (version, message) in enumerate(frames):
            request_id = message.get("id", 0) if isinstance(message.get("id"), int) else 0
            try:
                request = parse_request(message)
                args = _attach_args(request)
                if len(fds) not in (2, 3):
                    raise InvalidArgument("attach needs two file descriptors: the arena memfd and the doorbell "
                                          "eventfd (and optionally a completion-notify eventfd)")
            except VrnicError as exc:
                _send(conn, version, reply_error(request_id, exc))
                continue
            # Attached from here on: the connection leaves the selector for a thread of its own.
            self._pending.pop(conn, None)
            self._start_session(conn, pending, version, request, args, fds, frames[index + 1:])
            return
        _close_fds(fds)  # descriptors that came with something other than an attach

    def _start_session(self, conn: socket.socket, pending: _Pending, version: int, request: ParsedRequest,
                       args: verb_args.Attach, fds: list[int], backlog: list[tuple[int, dict[str, Any]]]) -> None:
        """The session of a guest that asked to attach, opened here or on a thread of its own. conn leaves the
        selector before any thread may read it, and after the reply when the session opens here: the selector
        looks at no socket before this returns, and the reply waits for nothing it need not (issue 14)."""
        with self._lock:
            room = len(self._sessions) < self.limits.max_sessions
            if room:
                self._sessions[conn] = None  # the place is the guest's while its session opens
        if not room:
            self._selector.unregister(conn)
            _close_fds(fds)
            _send(conn, version, reply_error(request.id, Conflict(
                f"vrnicd serves {self.limits.max_sessions} guests at most", current_state="busy")))
            conn.close()
            return
        guest = _Guest(conn, pending, version, request, args, fds, backlog)
        # Opened and answered here, the attach waits for no thread to wake: 2.75 -> 2.11 ms in the lab, eight rounds
        # in turns (issue 14). Only when the opener does no device I/O, which could stall other accepts.
        opened_here = self.opens_quickly is not None and self.opens_quickly(args)
        if opened_here:
            guest.session = self._open_here(guest)
        self._selector.unregister(conn)
        if opened_here and guest.session is None:
            with self._lock:
                self._sessions.pop(conn, None)
            conn.close()
            return
        waiting = worker = None
        with self._lock:
            if self._idle:
                waiting = self._idle.pop()
                self._sessions[conn] = waiting.thread
            else:
                worker = _Worker(self._work, guest)
                self._workers.add(worker)
                self._sessions[conn] = worker.thread
        if waiting is not None:
            waiting.next.put(guest)
        else:
            assert worker is not None
            worker.thread.start()

    def _open_here(self, guest: _Guest) -> AttachedSession | None:
        """The guest's session, opened and its attach answered by the selector thread; None if it was refused
        (the guest has the error) or could not take the answer at once (the session is closed again)."""
        session = self._opened(guest)
        if session is None:
            return None
        # The socket is still non-blocking: a guest whose earlier answers fill its buffer never read them, and it
        # must not hold the selector, so an answer that cannot go out at once ends it.
        if not _send_now(guest.conn, _attach_answer(guest, session), session.attach_fds()):
            session.close()
            return None
        return session

    def _opened(self, guest: _Guest) -> AttachedSession | None:
        """The guest's session, or None: it was refused, and the guest has the error."""
        try:
            return self.open_session(guest.args, guest.fds, guest.pending.cred, _disconnect(guest.conn))
        except VrnicError as exc:
            _send(guest.conn, guest.version, reply_error(guest.request.id, exc))
        except Exception as exc:  # the opener closed the fds; the guest learns nothing internal
            _send(guest.conn, guest.version, reply_error(guest.request.id, internal_error(exc, "attach")))
        return None

    def _new_worker(self, guest: _Guest | None) -> None:
        worker = _Worker(self._work, guest)
        with self._lock:
            self._workers.add(worker)
        worker.thread.start()

    def _work(self, worker: _Worker, guest: _Guest | None) -> None:
        """Serve guests one after another: this one, then each the selector hands over while this thread waits."""
        try:
            while True:
                waiting = False
                if guest is not None:
                    waiting = self._serve(worker, guest)
                guest = self._wait_for_guest(worker, waiting)
                if guest is None:
                    return
        finally:
            with self._lock:
                self._workers.discard(worker)

    def _leave(self, worker: _Worker, conn: socket.socket) -> bool:
        """The guest on conn is gone: it stops counting as a session, and this thread joins those waiting for the
        next guest unless enough wait already (True if it joined)."""
        with self._lock:
            self._sessions.pop(conn, None)
            if self._stopping.is_set() or len(self._idle) >= KEPT_THREADS:
                return False
            self._idle.append(worker)
            return True

    def _wait_for_guest(self, worker: _Worker, waiting: bool) -> _Guest | None:
        """The next guest the selector hands this thread, or None: the thread ends (stopping, enough threads
        waiting already, or a long wait while another waits too). waiting: the thread joined those waiting when its
        guest detached (_leave), before the reply, so that the guest's next attach finds it."""
        if not waiting:
            with self._lock:
                if self._stopping.is_set() or len(self._idle) >= KEPT_THREADS:
                    return None
                self._idle.append(worker)
        while True:
            try:
                return worker.next.get(timeout=KEPT_THREAD_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if worker not in self._idle:
                        break  # picked as the wait ran out: the guest is on its way
                    if len(self._idle) > 1:
                        self._idle.remove(worker)
                        return None
        return worker.next.get()

    # ----- one thread per attached guest ------------------------------------------------------
    def _serve(self, worker: _Worker, guest: _Guest) -> bool:
        """One guest, until it leaves; True if this thread already waits for the next (it detached)."""
        conn, pending, session = guest.conn, guest.pending, guest.session
        joined: bool | None = None  # set by a detach, which leaves before its reply: whether the thread now waits

        def leave() -> None:
            nonlocal joined
            joined = self._leave(worker, conn)

        try:
            conn.setblocking(True)
            if session is None:  # not opened by the selector: opened here, where blocking holds no one else
                session = self._opened(guest)
                if session is None:
                    return False
                with contextlib.suppress(OSError):
                    _send_frame(conn, _attach_answer(guest, session), session.attach_fds())
            # Logged once the guest has its answer: a log line to a console is milliseconds under TCG (issue 14)
            log.info("vRNIC %s attached by pid %d uid %d", session.vrnic_id, pending.cred.pid, pending.cred.uid)
            if self._serve_messages(conn, session, guest.backlog, leave):
                return bool(joined)
            buffer = worker.buffer
            while not self._stopping.is_set():
                try:
                    size, ancillary, _flags, _addr = conn.recvmsg_into([buffer], _FDS_SPACE)
                except OSError:
                    return False
                _close_fds(fds_of(ancillary))  # an attached guest has nothing more to hand over
                if not size:
                    return False
                data = buffer[:size]
                try:
                    frames = pending.decoder.feed_frames(data)
                except ProtocolError as exc:
                    _send(conn, pending.decoder.version, reply_error(0, exc))
                    return False
                if self._serve_messages(conn, session, frames, leave):
                    return bool(joined)
            return False
        finally:
            if session is not None:
                session.close()
            conn.close()
            if joined is None:
                with self._lock:
                    self._sessions.pop(conn, None)

    @staticmethod
    def _serve_messages(conn: socket.socket, session: AttachedSession, frames: list[tuple[int, dict[str, Any]]],
                        leave: Callable[[], None]) -> bool:
        """Answer each request, in its version; True when the guest detached (leave runs before that reply)."""
        for version, message in frames:
            request_id = message.get("id", 0) if isinstance(message.get("id"), int) else 0
            try:
                request = parse_request(message)
                if request.op == "attach":
                    raise Conflict("already attached", current_state="attached")
                if request.op == "detach":  # tear down before replying, so a re-attach finds it (and a thread) free
                    session.close()
                    leave()
                    _send(conn, version, reply_ok(request.id))
                    return True
                _send_ok(conn, version, request.id, session.handle(request.op, request.args))
                session.after_reply()
            except VrnicError as exc:
                _send(conn, version, reply_error(request_id, exc))
            except Exception as exc:  # a daemon bug fails one request, not the daemon
                _send(conn, version, reply_error(request_id, internal_error(exc, f"request {message.get('op')!r}")))
        return False


def _attach_args(request: ParsedRequest) -> verb_args.Attach:
    if request.op != "attach":
        raise InvalidArgument("the first request must be attach")
    args = request.args
    token, busy_poll = args.get("token"), args.get("busy_poll", False)
    # What the schema accepts in its usual form, taken as it is: the schema's validation was 0.11 ms of a 3.9 ms
    # attach under the lab's TCG (issue 14). Anything else goes to the schema, which accepts it or says why not.
    if (type(token) is str and len(token) <= _TOKEN_MAX and type(busy_poll) is bool
            and len(args) == 1 + ("busy_poll" in args)):
        return verb_args.Attach.model_construct(token=token, busy_poll=busy_poll)
    try:
        return verb_args.Attach.model_validate(request.args)
    except ValidationError:
        raise InvalidArgument("attach takes a token (a string) and busy_poll (a boolean)") from None


def _bind(path: Path, limits: ChannelLimits) -> socket.socket:
    """Bind in a private directory, set owner and mode, then move into place: never reachable looser."""
    path.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=".vrnicd-", dir=path.parent))  # mode 0700
    staged = private / "sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(staged))
        if limits.socket_uid is not None or limits.socket_gid is not None:
            os.chown(staged, -1 if limits.socket_uid is None else limits.socket_uid,
                     -1 if limits.socket_gid is None else limits.socket_gid)
        os.chmod(staged, limits.socket_mode)
        os.replace(staged, path)
    except BaseException:
        sock.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            staged.unlink()
        private.rmdir()
    return sock


def _disconnect(conn: socket.socket) -> Callable[[], None]:
    """Ends the guest's connection at once (the session's engine calls it when the data path fails)."""

    def disconnect() -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    return disconnect


def _send_now(conn: socket.socket, data: bytes, fds: list[int]) -> bool:
    """data (fds on its first byte) on a non-blocking socket; False if any of it would have to wait (what went
    out is a partial frame: the caller ends the connection)."""
    try:
        _send_frame(conn, data, fds)
    except OSError:  # BlockingIOError above all
        return False
    return True


def _attach_answer(guest: _Guest, session: AttachedSession) -> bytes:
    """The frame that answers the guest's attach, in its request's version."""
    return encode_ok(guest.request.id, session.attach_result(), guest.version)


def _send_frame(conn: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    """An encoded frame on a blocking socket; SCM_RIGHTS rides on its first byte, the rest follows as a stream."""
    if fds:
        data = data[socket.send_fds(conn, [data], fds):]
    if data:
        conn.sendall(data)


def _send(conn: socket.socket, version: int, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """A reply, in the version of the request it answers."""
    with contextlib.suppress(OSError):
        _send_frame(conn, encode(message, version), fds)


def _send_ok(conn: socket.socket, version: int, request_id: int, result: dict[str, Any]) -> None:
    """_send of reply_ok(request_id, result), encoded without the reply dict (every verb's answer)."""
    with contextlib.suppress(OSError):
        conn.sendall(encode_ok(request_id, result or {}, version))


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
