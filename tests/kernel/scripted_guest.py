"""A guest program in a process of its own (so a test can move it into a cgroup, as a container runtime would),
driven by JSON lines over its stdin and stdout."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

IO_TIMEOUT = 60.0


class ScriptedGuest:
    def __init__(self, script: str, stderr: Path, timeout: float = IO_TIMEOUT) -> None:
        self.stderr_path, self.timeout = stderr, timeout
        self._stderr = stderr.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.pid = self.proc.pid

    def hear(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.kill()
            raise AssertionError(f"the guest said nothing (exit {self.proc.returncode}); stderr:\n"
                                 f"{self.stderr_path.read_text()}")
        message: dict[str, Any] = json.loads(line)
        return message

    def say(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        self.say(exit=True)
        assert self.proc.wait(self.timeout) == 0, self.stderr_path.read_text()
        self._stderr.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()
