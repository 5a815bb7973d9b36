"""The guest's end of the frontend channel: framed request/reply over a byte stream.

A container guest reaches vrnicd over a Unix socket (and hands it descriptors);
a VM's guest over its virtio-serial port (vrnicd sits at the host end; no
descriptors cross it). Standard library only: a VM has none of the host's packages.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vrnic.core.framing import (
    BINARY_VERSION,
    MSGPACK_VERSION,
    VERSIONS,
    FrameDecoder,
    encode_request,
    fds_of,
    peer_cred,
)
from vrnic.errors import ChannelLost, InvalidArgument, NotFound, VrnicError, error_from_dict

VIRTIO_PORTS = Path("/sys/class/virtio-ports")
DEFAULT_PORT = "org.vrnic.0"
# Replies are small; a larger one takes a few reads. 64 KiB took 0.07 ms to zero under TCG, on every attach.
RECV_BYTES = 16384
# The protocol version a guest sends in: 3 (MessagePack) where msgpack imports, else 2 (binary), unless this says
# otherwise (2 or 1 for a vrnicd older than version 3 or 2). vrnicd answers each request in the version it came in.
WIRE_VERSION_ENV = "VRNIC_WIRE_VERSION"
DEFAULT_WIRE_VERSION = MSGPACK_VERSION if MSGPACK_VERSION in VERSIONS else BINARY_VERSION
_FDS_SPACE = socket.CMSG_SPACE(4 * 4)  # room for four descriptors
# A reply takes 0.3-2 ms under the lab's TCG (tens of microseconds on hardware), and a guest asleep in recv pays
# its CPU's wake-up on top: about 0.1 ms a round trip in the lab. So a container guest polls its socket for up to
# this long before it sleeps, as MPI libraries and eRPC poll before they block. The caller waits for the reply
# either way; the poll spends that wait on its own CPU. 0 turns it off.
POLL_ENV = "VRNIC_REPLY_POLL_US"
DEFAULT_POLL_US = 1000
MAX_POLL_US = 100_000
# A channel's first reply (the attach's) polls this many times as long: vrnicd opens a session for it, 1.5-2 ms in
# the lab against 0.3-0.5 for a verb, and an attach that outwaited the poll paid the wake-up too (issue 14).
FIRST_REPLY_POLL_FACTOR = 4
# Unless the setting says how long: a request whose op took longer than the poll the last time polls for
# REPLY_POLL_MARGIN times as long as it took, if that is no more than LONGEST_POLL_S, so a pool refill (5-11 ms under
# the lab's TCG) does not sleep through most of its wait and pay the wake-up (0.15-0.4 ms a refill in the lab, issue
# 14). An op that took longer than that sleeps after the usual poll: the poll would burn the CPU and still sleep.
REPLY_POLL_MARGIN = 2
LONGEST_POLL_S = 0.016
# What a guest does when vrnicd goes away (restart, upgrade, OOM kill): its objects died with that vrnicd.
_REATTACH = ("; every object of this attachment is gone (vrnicd restarted or stopped): attach again with the "
             "same token and rebuild them")


def wire_version(version: int | None = None, setting: str | None = None) -> int:
    """The version a channel sends in: the one given, else $VRNIC_WIRE_VERSION's (or setting's), else the newest
    this end speaks (3 with msgpack, 2 without)."""
    if version is not None:
        if version not in VERSIONS:
            raise InvalidArgument(f"the protocol version is {_spoken()}, not {version!r}")
        return version
    if setting is None:
        setting = _wire_setting()
    if not setting:
        return DEFAULT_WIRE_VERSION
    if setting not in map(str, VERSIONS):
        raise InvalidArgument(f"{WIRE_VERSION_ENV} is {_spoken()}, not {setting[:20]!r}")
    return int(setting)


def poll_budget(poll_seconds: float, last_seconds: float | None) -> float:
    """How long a request polls for its reply: poll_seconds, or REPLY_POLL_MARGIN times what its op took the last
    time (last_seconds) where that is longer and no more than LONGEST_POLL_S."""
    if last_seconds is None:
        return poll_seconds
    stretched = last_seconds * REPLY_POLL_MARGIN
    return stretched if poll_seconds < stretched <= LONGEST_POLL_S else poll_seconds


def _spoken() -> str:
    return ", ".join(map(str, VERSIONS[:-1])) + f" or {VERSIONS[-1]}"


def _wire_setting() -> str:
    return os.environ.get(WIRE_VERSION_ENV, "").strip()


def _refuses_version(reply: dict[str, Any], version: int) -> bool:
    """Whether reply is a vrnicd's refusal of the version a request came in (one from before that version)."""
    error = reply.get("error")
    return (not reply.get("ok") and isinstance(error, dict) and error.get("code") == "protocol_error"
            and str(error.get("message", "")).startswith(f"unsupported protocol version {version} ")
            and any(v < version for v in VERSIONS))


def reply_poll_seconds(setting: str | None = None, cpus: int | None = None) -> float:
    """How long a guest polls for a reply before it sleeps: $VRNIC_REPLY_POLL_US (or setting) microseconds,
    DEFAULT_POLL_US if unset. 0 with one CPU to run on: the poll would only hold off vrnicd's reply."""
    if setting is None:
        setting = os.environ.get(POLL_ENV, "")
    setting = setting.strip()
    if not setting:
        micros = DEFAULT_POLL_US
    elif setting.isdigit() and int(setting) <= MAX_POLL_US:
        micros = int(setting)
    else:
        raise InvalidArgument(f"{POLL_ENV} is a number of microseconds from 0 to {MAX_POLL_US}, not {setting[:20]!r}")
    if cpus is None:
        cpus = _cpus()
    return micros / 1e6 if cpus > 1 else 0.0


@functools.cache
def _cpus() -> int:
    """The CPUs this process may run on, read once: with the settings, read at every attach, it took 0.13 ms of a
    3.9 ms attach under the lab's TCG (issue 14); a process moved to one CPU later only polls where it need not."""
    return len(os.sched_getaffinity(0))


class Channel(ABC):
    def __init__(self, version: int | None = None) -> None:
        setting = _wire_setting() if version is None else ""  # the environment read once, at every attach
        self.version = wire_version(version, setting)
        # Chosen by default (neither given nor set): a vrnicd that refuses it at the first request is older, and
        # the request goes again in the next older version, so a guest library can be upgraded before vrnicd is.
        self._may_step_down = version is None and not setting
        self._decoder = FrameDecoder()
        # A VM's port outlives the guest programs that open it: a reply meant for a program that died may
        # still arrive, so ids start somewhere new and replies to other ids are skipped.
        self._ids = itertools.count(random.getrandbits(40) or 1)
        self._lock = threading.Lock()
        self.received_fds: list[int] = []  # descriptors vrnicd sent (the direct engine's uverbs fd)
        self.reply_seconds: dict[str, float] = {}  # by op: how long its last request took, sent to answered
        self._awaited = ""  # the op of the request whose reply is awaited

    def take_fds(self) -> list[int]:
        fds, self.received_fds = self.received_fds, []
        return fds

    def call(self, op: str, fds: list[int] | None = None, **args: Any) -> dict[str, Any]:
        return self._call(op, fds, args, None)

    def call_meanwhile(self, op: str, meanwhile: Callable[[], None], args: dict[str, Any]) -> dict[str, Any]:
        """call(op, **args), with meanwhile run once the request is sent, before the wait for the reply: work of
        the caller's own that vrnicd's time on the request hides. It must not use the channel."""
        return self._call(op, None, args, meanwhile)

    def _call(self, op: str, fds: list[int] | None, args: dict[str, Any],
              meanwhile: Callable[[], None] | None) -> dict[str, Any]:
        request_id = next(self._ids)
        data = encode_request(request_id, op, args, self.version)
        with self._lock:
            try:
                started = time.perf_counter()
                self._send(data, fds)
                self._awaited = op
                if meanwhile is not None:
                    meanwhile()  # if it raises, the next call's _read_reply passes over this reply (its id)
                reply = self._read_reply(request_id)
                self.reply_seconds[op] = time.perf_counter() - started
                while self._may_step_down and _refuses_version(reply, self.version):
                    self.version = max(v for v in VERSIONS if v < self.version)
                    self._restart()
                    self._send(encode_request(request_id, op, args, self.version), fds)
                    reply = self._read_reply(request_id)
                self._may_step_down = False  # vrnicd read a request: the version stays for the channel's life
            except OSError as exc:
                raise ChannelLost(f"lost the channel to vrnicd: {exc.strerror or exc}{_REATTACH}") from exc
        if not reply.get("ok"):
            raise error_from_dict(reply.get("error") or {})
        result: dict[str, Any] = reply.get("result") or {}
        return result

    def notify(self, op: str) -> None:
        """A one-way message vrnicd does not answer (the VM's doorbell)."""
        data = encode_request(0, op, {}, self.version)
        with self._lock:
            try:
                self._send(data, None)
            except OSError as exc:
                raise ChannelLost(f"lost the channel to vrnicd: {exc.strerror or exc}{_REATTACH}") from exc

    def _read_reply(self, request_id: int) -> dict[str, Any]:
        while True:
            chunk = self._recv()
            if not chunk:
                raise ChannelLost(f"vrnicd closed the channel{_REATTACH}")
            for _version, message in self._decoder.feed_frames(chunk):  # vrnicd answers in ours, or 1 if unread
                if message.get("id") in (request_id, 0):  # 0: vrnicd could not read the request at all
                    return message

    def _restart(self) -> None:
        """After vrnicd refused the version of the first request: a stream it will read from the start (it
        closes a Unix socket after a framing error; a VM's port it reads on)."""
        self._decoder = FrameDecoder()

    @abstractmethod
    def _send(self, data: bytes, fds: list[int] | None) -> None: ...

    @abstractmethod
    def _recv(self) -> bytes | memoryview: ...

    @abstractmethod
    def close(self) -> None: ...


class UnixChannel(Channel):
    """A container guest's connection to vrnicd's socket."""

    def __init__(self, path: str, version: int | None = None) -> None:
        setting = os.environ.get(POLL_ENV, "")  # read once: an unset name costs a KeyError inside
        poll = reply_poll_seconds(setting)  # a bad setting fails before anything is opened
        self.stretch_poll = not setting.strip()  # a poll the setting names is kept as named
        super().__init__(version)
        self.path = path
        self._buffer = memoryview(bytearray(RECV_BYTES))
        self.sock = self._connect()
        # Not against a vrnicd in this process (tests, tools): the poll would hold the GIL its reply needs.
        self.poll_seconds = 0.0 if peer_cred(self.sock)[0] == os.getpid() else poll
        self._first_reply = True

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise VrnicError(f"cannot reach vrnicd at {self.path}: {exc.strerror}") from exc
        return sock

    def _restart(self) -> None:
        super()._restart()
        self.sock.close()
        self.sock = self._connect()

    def _send(self, data: bytes, fds: list[int] | None) -> None:
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)

    def _recv(self) -> memoryview:
        # Into one buffer kept for the connection: recv_fds would allocate 64 KiB per reply. Not copied out:
        # the decoder copies what it keeps.
        buffers = [self._buffer]
        polled = self._poll(buffers) if self.poll_seconds else None
        size, ancillary, _flags, _addr = polled or self.sock.recvmsg_into(buffers, _FDS_SPACE)
        self._first_reply = False
        self.received_fds += fds_of(ancillary)
        return self._buffer[:size]

    def _poll(self, buffers: list[memoryview]) -> tuple[int, list[tuple[int, int, bytes]], int, Any] | None:
        """What arrives within poll_seconds, or None (then the caller sleeps in recvmsg)."""
        if self._first_reply:
            budget = self.poll_seconds * FIRST_REPLY_POLL_FACTOR
        elif self.stretch_poll:
            budget = poll_budget(self.poll_seconds, self.reply_seconds.get(self._awaited))
        else:
            budget = self.poll_seconds
        deadline = time.perf_counter() + budget
        while True:
            try:
                return self.sock.recvmsg_into(buffers, _FDS_SPACE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= deadline:
                    return None
                # Where the scheduler put vrnicd's thread on this CPU, it runs now rather than after the poll
                # (lab, both on one vCPU: connect_qp_pair 2.7 ms not polling, 3.8 polling, 2.9 yielding).
                os.sched_yield()

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        self.sock.close()


def find_port(name: str = DEFAULT_PORT, sysfs: Path = VIRTIO_PORTS, dev: Path = Path("/dev")) -> Path:
    """The character device of the virtio-serial port called name (no udev needed)."""
    for entry in sorted(sysfs.glob("*")):
        try:
            if (entry / "name").read_text().strip() == name:
                return dev / entry.name
        except OSError:
            continue
    raise NotFound(f"no virtio-serial port {name!r} in this VM (is a vRNIC attached to it?)")


class PortChannel(Channel):
    """A VM guest's virtio-serial port; vrnicd holds the host end. One opener at a time (EBUSY otherwise)."""

    def __init__(self, name: str = DEFAULT_PORT, version: int | None = None) -> None:
        super().__init__(version)
        path = find_port(name)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise VrnicError(f"cannot open the vRNIC port {path}: {exc.strerror}") from exc
        self._buffer = memoryview(bytearray(RECV_BYTES))

    def _send(self, data: bytes, fds: list[int] | None) -> None:
        if fds:
            raise VrnicError("a VM's channel carries no file descriptors")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def _recv(self) -> memoryview:
        return self._buffer[:os.readv(self.fd, [self._buffer])]  # one buffer, as UnixChannel's

    def close(self) -> None:
        os.close(self.fd)
