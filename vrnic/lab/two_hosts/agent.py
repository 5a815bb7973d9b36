"""`vrnic daemon` as a host agent process of the rig: start with its settings, wait until it serves, stop or
kill -9 it. The same class runs on host a (in the tests' process) and on host b (under the control server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vrnic.errors import LabError
from vrnic.lab.health import health

AGENT_PORT = 8470


@dataclass(frozen=True)
class AgentConfig:
    host_name: str
    listen_host: str
    database_url: str
    operator_token: str
    state_dir: Path
    log_file: Path
    port: int = AGENT_PORT
    env: Mapping[str, str] = field(default_factory=dict)  # more VRNIC_* settings (heartbeat, agent token...)

    def to_dict(self) -> dict[str, Any]:
        return {"host_name": self.host_name, "listen_host": self.listen_host, "database_url": self.database_url,
                "operator_token": self.operator_token, "state_dir": str(self.state_dir),
                "log_file": str(self.log_file), "port": self.port, "env": dict(self.env)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentConfig:
        return cls(host_name=d["host_name"], listen_host=d["listen_host"], database_url=d["database_url"],
                   operator_token=d["operator_token"], state_dir=Path(d["state_dir"]), log_file=Path(d["log_file"]),
                   port=int(d["port"]), env=dict(d.get("env", {})))

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def environment(self) -> dict[str, str]:
        return {
            "VRNIC_HOST_NAME": self.host_name, "VRNIC_LISTEN_HOST": self.listen_host,
            "VRNIC_LISTEN_PORT": str(self.port), "VRNIC_DATABASE_URL": self.database_url,
            "VRNIC_OPERATOR_TOKEN": self.operator_token, "VRNIC_STATE_DIR": str(self.state_dir),
            "VRNIC_SRIOV_DRIVER": "",  # the lab's virtio NIC has no VFs
            "VRNIC_PARAVIRTUAL_DRIVER_OPTIONS": json.dumps({"socket_path": str(self.state_dir / "vrnicd.sock")}),
            **self.env,
        }


class AgentProcess:
    """One `vrnic daemon` child process; its output goes to config.log_file (appended across restarts)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 180.0) -> float:
        """Start it and wait until /health answers; returns the seconds that took."""
        if self.running():
            raise LabError(f"agent {self.config.host_name} already runs (pid {self.pid})")
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self.config.log_file.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.config.log_file.open("ab") as log:
            log.write(f"---- starting vrnic daemon on {self.config.host_name} at {time.ctime()}\n".encode())
            log.flush()
            self.process = subprocess.Popen([sys.executable, "-m", "vrnic.cli.main", "daemon"],
                                            env={**os.environ, **self.config.environment()},
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        while health(self.config.url) is None:
            if self.process.poll() is not None:
                raise LabError(f"vrnic daemon on {self.config.host_name} exited with {self.process.returncode} "
                               f"while starting:\n{self.log_tail()}")
            if time.monotonic() - started > timeout:
                self.kill()
                raise LabError(f"vrnic daemon on {self.config.host_name} did not serve within {timeout:.0f} s:\n"
                               f"{self.log_tail()}")
            time.sleep(0.2)
        return time.monotonic() - started

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int | None:
        """Send sig and wait for the exit; returns the exit status (None if it was not running)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM: the daemon tears its backend down, then exits."""
        return self.kill(signal.SIGTERM, timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.config.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
