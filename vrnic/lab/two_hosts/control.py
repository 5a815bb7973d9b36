"""Host a drives host b: a JSON-lines control server on b, and its client.

One request per line, one answer per line: {"op": ..., ...} -> {"ok": true, ...} or {"ok": false, "error"}.
Ops: ping; agent.start {config}, agent.stop, agent.kill {signal}, agent.status; spawn {argv, env, stdin} -> id;
write {id, text} to its stdin; readline {id, timeout} -> line; wait {id, timeout} -> rc, stdout, stderr (or
running); signal {id, signal}; run {argv, env, timeout};
done {rc} ends the server, which then exits with rc (b's exit code mirrors the suite's result). The lab link
is private to the two guests; nothing here is meant for any other network.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vrnic.errors import LabError
from vrnic.lab.two_hosts.agent import AgentConfig, AgentProcess

CONTROL_PORT = 18600
FIRST_CONTACT_S = 600.0  # host a boots, smokes, starts PostgreSQL and its own agent first
IDLE_S = 900.0  # no request for this long: a is gone


@dataclass
class _Child:
    process: subprocess.Popen[str]
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)
    read: int = 0  # stdout lines already handed out by readline
    more: threading.Condition = field(default_factory=threading.Condition)

    def collect(self, stream: Any, sink: list[str]) -> None:
        for line in stream:
            with self.more:
                sink.append(line)
                self.more.notify_all()
        with self.more:
            self.more.notify_all()


class HostControl:
    """What b's control server does: its agent and the guest programs it runs for a."""

    def __init__(self) -> None:
        self.agent: AgentProcess | None = None
        self.children: dict[int, _Child] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.finished = threading.Event()
        self.rc = 1
        self.last_request = time.monotonic()
        self.contacted = False

    # --- ops -------------------------------------------------------------------------------------
    def op_ping(self) -> dict[str, Any]:
        return {"host": os.environ.get("VRNIC_LAB_ROLE", "?"), "pid": os.getpid()}

    def op_agent_start(self, config: Mapping[str, Any], timeout: float = 180.0) -> dict[str, Any]:
        with self._lock:
            if self.agent is None or not self.agent.running():
                self.agent = AgentProcess(AgentConfig.from_dict(config))
            agent = self.agent
        seconds = agent.start(timeout)
        return {"pid": agent.pid, "seconds": seconds}

    def op_agent_kill(self, signal: int = signal.SIGKILL) -> dict[str, Any]:
        return {"rc": None if self.agent is None else self.agent.kill(signal)}

    def op_agent_stop(self) -> dict[str, Any]:
        return {"rc": None if self.agent is None else self.agent.stop()}

    def op_agent_status(self) -> dict[str, Any]:
        agent = self.agent
        return {"running": agent is not None and agent.running(), "pid": None if agent is None else agent.pid,
                "log_tail": "" if agent is None else agent.log_tail()}

    def op_spawn(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 stdin: bool = False) -> dict[str, Any]:
        """Start a program; stdin=True keeps a pipe to it open for op write (line-driven guest programs)."""
        process = subprocess.Popen(list(argv), env={**os.environ, **(env or {})},
                                   stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        child = _Child(process)
        for stream, sink in ((process.stdout, child.stdout), (process.stderr, child.stderr)):
            reader = threading.Thread(target=child.collect, args=(stream, sink), daemon=True)
            reader.start()
            child.readers.append(reader)
        with self._lock:
            child_id = next(self._ids)
            self.children[child_id] = child
        return {"id": child_id, "pid": process.pid}

    def op_wait(self, id: int, timeout: float = 60.0) -> dict[str, Any]:
        child = self.children.get(id)
        if child is None:
            raise LabError(f"no child {id}")
        try:
            rc = child.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return {"running": True, "stdout": "".join(child.stdout), "stderr": "".join(child.stderr)}
        for reader in child.readers:
            reader.join(10)
        with self._lock:
            self.children.pop(id, None)
        return {"running": False, "rc": rc, "stdout": "".join(child.stdout), "stderr": "".join(child.stderr)}

    def op_write(self, id: int, text: str) -> dict[str, Any]:
        child = self._child(id)
        assert child.process.stdin is not None
        child.process.stdin.write(text)
        child.process.stdin.flush()
        return {}

    def op_readline(self, id: int, timeout: float = 60.0) -> dict[str, Any]:
        """The child's next stdout line; line None if it ended (or nothing came within timeout: timed_out)."""
        child = self._child(id)
        deadline = time.monotonic() + timeout
        with child.more:
            while child.read >= len(child.stdout):
                ended = child.process.poll() is not None and not any(r.is_alive() for r in child.readers[:1])
                left = deadline - time.monotonic()
                if ended or left <= 0:
                    return {"line": None, "timed_out": not ended, "stderr": "".join(child.stderr)[-3000:]}
                child.more.wait(min(left, 0.5))
            child.read += 1
            return {"line": child.stdout[child.read - 1]}

    def _child(self, id: int) -> _Child:
        child = self.children.get(id)
        if child is None:
            raise LabError(f"no child {id}")
        return child

    def op_signal(self, id: int, signal: int = signal.SIGTERM) -> dict[str, Any]:
        child = self.children.get(id)
        if child is None:
            raise LabError(f"no child {id}")
        if child.process.poll() is None:
            os.killpg(child.process.pid, signal)
        return {}

    def op_run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float = 120.0) -> dict[str, Any]:
        child_id = self.op_spawn(argv, env)["id"]
        result = self.op_wait(child_id, timeout)
        if result["running"]:
            self.op_signal(child_id, signal.SIGKILL)
            result = self.op_wait(child_id, 10)
            result["timed_out"] = True
        return result

    def op_done(self, rc: int = 0) -> dict[str, Any]:
        self.rc = rc
        self.finished.set()
        return {}

    # --- plumbing --------------------------------------------------------------------------------
    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        self.last_request = time.monotonic()
        self.contacted = True
        op = str(request.get("op", ""))
        method: Callable[..., dict[str, Any]] | None = getattr(self, "op_" + op.replace(".", "_"), None)
        if method is None:
            return {"ok": False, "error": f"unknown op {op!r}"}
        args = {k: v for k, v in request.items() if k != "op"}
        try:
            return {"ok": True, **method(**args)}
        except Exception as exc:  # every failure goes back to a, which raises it there
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.last_request = time.monotonic()

    def close(self) -> None:
        for child in list(self.children.values()):
            if child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        if self.agent is not None:
            self.agent.stop()


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        for line in self.rfile:
            answer = self.server.control.handle(json.loads(line))
            self.wfile.write((json.dumps(answer) + "\n").encode())
            self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], control: HostControl) -> None:
        self.control = control
        super().__init__(addr, _Handler)


def serve(addr: str, port: int = CONTROL_PORT, first_contact_s: float = FIRST_CONTACT_S,
          idle_s: float = IDLE_S) -> int:
    """Serve a until it says done (returns its rc) or goes quiet (returns 1); b's agent and children end."""
    control = HostControl()
    server = _Server((addr, port), control)
    thread = threading.Thread(target=server.serve_forever, name="control", daemon=True)
    thread.start()
    print(f"b: control server on {addr}:{port}, waiting for host a", flush=True)
    started = time.monotonic()
    try:
        while not control.finished.wait(1.0):
            quiet = time.monotonic() - (control.last_request if control.contacted else started)
            if quiet > (idle_s if control.contacted else first_contact_s):
                print(f"b: host a silent for {quiet:.0f} s; giving up", flush=True)
                return 1
        return control.rc
    finally:
        server.shutdown()
        server.server_close()
        control.close()


class ControlClient:
    """a's side: one connection, one request at a time (a lock makes it safe to share between threads)."""

    def __init__(self, addr: str, port: int = CONTROL_PORT, timeout: float = 600.0) -> None:
        self.addr, self.port = addr, port
        self.sock = socket.create_connection((addr, port), timeout=timeout)
        self.stream = self.sock.makefile("rw")
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, addr: str, port: int = CONTROL_PORT, wait_s: float = 300.0) -> ControlClient:
        """Retry until b's server listens (b boots and smokes at its own pace)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                client = cls(addr, port)
                client.call("ping")
                return client
            except OSError:
                if time.monotonic() > deadline:
                    raise LabError(f"host b's control server at {addr}:{port} did not answer "
                                   f"within {wait_s:.0f} s") from None
                time.sleep(0.5)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            self.stream.write(json.dumps({"op": op, **args}) + "\n")
            self.stream.flush()
            line = self.stream.readline()
        if not line:
            raise LabError(f"host b's control server closed the connection during {op}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.pop("ok"):
            raise LabError(f"host b: {op} failed: {answer['error']}")
        return answer

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


class RemoteAgent:
    """b's agent, seen from a: the AgentProcess interface over the control connection."""

    def __init__(self, control: ControlClient, config: AgentConfig) -> None:
        self.control, self.config = control, config

    def start(self, timeout: float = 180.0) -> float:
        return float(self.control.call("agent.start", config=self.config.to_dict(), timeout=timeout)["seconds"])

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        rc = self.control.call("agent.kill", signal=int(sig))["rc"]
        return None if rc is None else int(rc)

    def stop(self) -> int | None:
        rc = self.control.call("agent.stop")["rc"]
        return None if rc is None else int(rc)

    def running(self) -> bool:
        return bool(self.control.call("agent.status")["running"])

    def log_tail(self) -> str:
        return str(self.control.call("agent.status")["log_tail"])
