"""A real libvirtd on the host. There is no systemd here, so the fixture starts the daemons by hand.

Daemons this fixture started are stopped again at the end of the session (and their
pid files removed); a libvirtd that was already running is used and left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

URI = "qemu:///system"
PID_DIR = Path("/run/vrnic-tests")


def _running(daemon: str) -> bool:
    return subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode == 0


def _stop(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with_reaped = os.waitpid(pid, os.WNOHANG) if _is_child(pid) else (0, 0)
        if with_reaped[0] == pid:
            break
        time.sleep(0.05)
    pid_file.unlink(missing_ok=True)


def _is_child(pid: int) -> bool:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


@pytest.fixture(scope="session")
def libvirt_conn() -> Iterator[Any]:
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed (make setup)")
    if shutil.which("libvirtd") is None:
        pytest.skip("libvirtd is not installed (make setup installs libvirt-daemon-system)")
    PID_DIR.mkdir(parents=True, exist_ok=True)
    started: list[Path] = []
    for daemon in ("virtlogd", "libvirtd"):
        if not _running(daemon):
            pid_file = PID_DIR / f"{daemon}.pid"
            subprocess.run([daemon, "-d", "--pid-file", str(pid_file)], check=True)
            started.append(pid_file)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                conn = libvirt.open(URI)
                break
            except libvirt.libvirtError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield conn
        conn.close()
    finally:
        for pid_file in reversed(started):  # libvirtd first, then virtlogd
            _stop(pid_file)
