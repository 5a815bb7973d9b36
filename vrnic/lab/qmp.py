"""A small QMP client (QEMU's JSON monitor protocol) over a Unix socket, standard library only.

    qmp = QmpClient(Path("qmp.sock"), timeout=10)
    qmp.execute("query-status")            # {"status": "running", "running": True, ...}
    qmp.hmp("xp /16xb 0x200000")            # human monitor output as text

Parsing (split_lines, parse_message, encode_command, result_of) is pure; QmpClient is the socket edge.
Thread safety: one command at a time. A lock covers "send a command, read until its reply", so threads
may share one client (a test runs migrate() in a thread and calls execute("migrate_cancel") from
another); a command waits for the one in flight, which for QMP's query commands is milliseconds.
Events read meanwhile are appended to `events` under the same lock.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from vrnic.errors import LabError


def encode_command(command: str, arguments: dict[str, Any] | None, request_id: int) -> bytes:
    message: dict[str, Any] = {"execute": command, "id": request_id}
    if arguments:
        message["arguments"] = arguments
    return (json.dumps(message) + "\n").encode()


def split_lines(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines (QMP sends one JSON object per CRLF-terminated line) and the unfinished rest."""
    *lines, rest = buffer.split(b"\n")
    return [line.strip() for line in lines if line.strip()], rest


def parse_message(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise LabError(f"QMP sent something that is not JSON: {line[:200]!r}") from exc
    if not isinstance(message, dict):
        raise LabError(f"QMP sent a JSON {type(message).__name__}, not an object: {line[:200]!r}")
    return message


def kind(message: dict[str, Any]) -> str:
    """greeting, event, return or error (QMP's four kinds of server message)."""
    for key in ("QMP", "event", "return", "error"):
        if key in message:
            return "greeting" if key == "QMP" else key
    raise LabError(f"unknown QMP message: {message}")


def result_of(command: str, message: dict[str, Any]) -> Any:
    """The "return" value of a reply, or LabError carrying QMP's error class and description."""
    if "error" in message:
        error = message["error"] or {}
        raise LabError(f"QMP {command}: {error.get('desc', error)} ({error.get('class', '?')})")
    return message["return"]


class QmpClient:
    def __init__(self, path: Path, timeout: float = 30.0, connect_timeout: float = 30.0) -> None:
        self.path = path
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        self._buffer = b""
        self._pending: list[dict[str, Any]] = []  # parsed messages not consumed yet
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_timeout
        while True:  # QEMU creates the socket a moment after it starts
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(str(path))
                break
            except OSError as exc:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise LabError(f"no QMP socket at {path}: {exc}") from exc
                time.sleep(0.05)
        try:
            greeting = self._next_message(time.monotonic() + timeout)
            if kind(greeting) != "greeting":
                raise LabError(f"QMP did not greet: {greeting}")
            self.greeting: dict[str, Any] = greeting["QMP"]
            self.execute("qmp_capabilities")
        except BaseException:
            self.sock.close()
            raise

    def _next_message(self, deadline: float) -> dict[str, Any]:
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LabError(f"QMP at {self.path} did not answer in time")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise LabError(f"QMP at {self.path} closed the connection")
            lines, self._buffer = split_lines(self._buffer + chunk)
            self._pending += [parse_message(line) for line in lines]
        return self._pending.pop(0)

    def execute(self, command: str, **arguments: Any) -> Any:
        with self._lock:
            request_id = next(self._ids)
            deadline = time.monotonic() + self.timeout
            try:
                self.sock.sendall(encode_command(command, arguments, request_id))
            except OSError as exc:
                raise LabError(f"QMP {command}: {exc}") from exc
            while True:
                message = self._next_message(deadline)
                if kind(message) == "event":
                    self.events.append(message)
                elif message.get("id") == request_id:
                    return result_of(command, message)

    def hmp(self, command_line: str) -> str:
        return str(self.execute("human-monitor-command", **{"command-line": command_line}))

    def wait_event(self, name: str, timeout: float | None = None) -> dict[str, Any]:
        """The first event called name that arrived (already, or within timeout); it is removed from events."""
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._lock:
            while True:
                for i, event in enumerate(self.events):
                    if event["event"] == name:
                        return self.events.pop(i)
                message = self._next_message(deadline)
                if kind(message) == "event":
                    self.events.append(message)

    def drain(self) -> list[dict[str, Any]]:
        """Every event received so far, reading what is left on the socket without waiting: after QEMU ended,
        its last events (SHUTDOWN with its reason, RESET, GUEST_PANICKED) say why."""
        with self._lock:
            try:
                self.sock.setblocking(False)
                while True:
                    chunk = self.sock.recv(65536)
                    if not chunk:
                        break
                    lines, self._buffer = split_lines(self._buffer + chunk)
                    self._pending += [parse_message(line) for line in lines]
            except (BlockingIOError, OSError):
                pass
            self.events += [m for m in self._pending if kind(m) == "event"]
            self._pending = [m for m in self._pending if kind(m) != "event"]
            return list(self.events)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> QmpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
