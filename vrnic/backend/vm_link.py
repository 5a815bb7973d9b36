"""A running VM's vRNIC channel: vrnicd at the host end of the VM's virtio-serial port.

QEMU listens on a Unix socket for the port (libvirt `<channel type='unix'>
<source mode='bind'>`); vrnicd connects when the libvirt hook binds the VM at
`started`. The guest speaks the same framed protocol as a container guest, with
two differences: nothing but bytes crosses a virtio-serial port, so there are no
descriptors (vrnicd maps the VM's RAM itself and makes the doorbell eventfd) and
the doorbell is a one-way `doorbell` message; and the port outlives the guest
programs that open it, so the link does too. A new `attach` closes the previous
program's session: the port admits one opener at a time, so that program is gone.
A framing error cannot end the link (it is the VM's only one): it ends the session
and the stream starts over.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vrnic.backend.attachment import VmAttachedSession, VmSessionOpener
from vrnic.backend.channel import internal_error
from vrnic.core import verb_args
from vrnic.core.proto import FrameDecoder, ProtocolError, encode, parse_request, reply_error, reply_ok
from vrnic.errors import Conflict, DeviceError, InvalidArgument, VrnicError

log = logging.getLogger(__name__)
RECV_BYTES = 65536
CONNECT_TIMEOUT_S = 5.0


def connect_channel(path: Path, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """Connect to QEMU's end of the channel; it may take QEMU a moment to listen after `started`."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise DeviceError(f"cannot connect to the VM channel {path}: {exc.strerror}", exc.errno or 0) from None
            time.sleep(0.05)


class VmLink:
    def __init__(self, domain: str, vrnic_id: str, sock: socket.socket, open_session: VmSessionOpener) -> None:
        self.domain = domain
        self.vrnic_id = vrnic_id
        self.sock = sock
        self.open_session = open_session
        self.session: VmAttachedSession | None = None
        self._decoder = FrameDecoder()
        self._lock = threading.Lock()  # session changes: the reader thread vs close() vs a failed engine
        self._send_lock = threading.Lock()
        self._closing = threading.Event()
        # A VM with a hand-over prepared: when libvirt's migration ends the source QEMU, the session (its rings in
        # the RAM vrnicd still maps, its kernel objects) must outlive the channel until the switchover moves it.
        self.keep_session_at_eof = False
        self.qemu_gone = False
        self._thread = threading.Thread(target=self._serve, name=f"vrnic-vm-{domain}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """End the session (every kernel object of it) and the link. Idempotent."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._end_session()
        self.sock.close()

    def _serve(self) -> None:
        buffer = memoryview(bytearray(RECV_BYTES))  # one for the link: recv() would allocate 64 KiB per request
        try:
            while not self._closing.is_set():
                try:
                    size = self.sock.recv_into(buffer)
                except OSError:
                    self.qemu_gone = True
                    return
                data = buffer[:size]  # the decoder copies what it keeps
                if not size:  # QEMU went away (the VM stopped or was destroyed)
                    log.info("VM %s: channel of vRNIC %s closed by QEMU", self.domain, self.vrnic_id)
                    self.qemu_gone = True
                    return
                try:
                    frames = self._decoder.feed_frames(data)
                except ProtocolError as exc:
                    version, self._decoder = self._decoder.version, FrameDecoder()
                    self._end_session()
                    self._send(version, reply_error(0, exc))
                    continue
                for version, message in frames:
                    self._handle(version, message)
        finally:
            if self.keep_session_at_eof and self.qemu_gone and not self._closing.is_set():
                log.info("VM %s: QEMU is gone; vRNIC %s's session waits for its hand-over", self.domain,
                         self.vrnic_id)
            else:
                self._end_session()

    def _handle(self, version: int, message: dict[str, Any]) -> None:
        """Answer one request, in its version."""
        request_id = message.get("id", 0) if isinstance(message.get("id"), int) else 0
        try:
            request = parse_request(message)
            if request.op == "doorbell":  # one-way: no reply, and cheap
                session = self.session
                if session is not None:
                    session.ring_doorbell()
                return
            if request.op == "attach":
                self._send(version, reply_ok(request.id, self._attach(request.args)))
                return
            session = self.session
            if session is None:
                raise Conflict("attach first", current_state="detached")
            if request.op == "detach":
                self._end_session()
                self._send(version, reply_ok(request.id))
                return
            self._send(version, reply_ok(request.id, session.handle(request.op, request.args)))
            session.after_reply()
        except VrnicError as exc:
            self._send(version, reply_error(request_id, exc))
        except Exception as exc:  # a daemon bug fails one request, not the VM's channel
            self._send(version, reply_error(request_id, internal_error(exc, f"VM {self.domain} request "
                                                                             f"{message.get('op')!r}")))

    def _attach(self, raw: dict[str, Any]) -> dict[str, Any]:
        try:
            args = verb_args.VmAttach.model_validate(raw)
        except ValidationError:
            raise InvalidArgument("attach over a VM channel takes only busy_poll (a boolean)") from None
        self._end_session()  # the previous opener of the port is gone
        with self._lock:
            if self._closing.is_set():
                raise Conflict("the VM is being unbound", current_state="detached")
            self.session = self.open_session(args, self.session_failed)
            result = self.session.attach_result()
        log.info("VM %s: guest attached vRNIC %s", self.domain, self.vrnic_id)
        return result

    def session_failed(self) -> None:
        """The session's Disconnect. Called from the engine's thread: close the session from another one
        (closing joins the engine)."""
        threading.Thread(target=self._end_session, name="vrnic-vm-close", daemon=True).start()

    def adopt(self, session: VmAttachedSession) -> None:
        """Serve a session that was built elsewhere (a migrated VM's, on its destination channel)."""
        with self._lock:
            if self._closing.is_set():
                raise Conflict("the VM is being unbound", current_state="detached")
            previous, self.session = self.session, session
        if previous is not None:
            previous.close()

    def give_up_session(self) -> VmAttachedSession | None:
        """Stop serving the session without closing it (it moves to the VM's destination)."""
        with self._lock:
            session, self.session = self.session, None
        return session

    def _end_session(self) -> None:
        with self._lock:
            session, self.session = self.session, None
        if session is not None:
            session.close()

    def _send(self, version: int, message: dict[str, Any]) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.sendall(encode(message, version))
