"""A real libvirtd on the host. There is no systemd here, so start the daemons by hand."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

URI = "qemu:///system"


def _start_daemons() -> None:
    for daemon, args in (("virtlogd", ["-d"]), ("libvirtd", ["-d", "--pid-file", "/run/vrnic-libvirtd.pid"])):
        if subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode != 0:
            subprocess.run([daemon, *args], check=True)


@pytest.fixture(scope="session")
def libvirt_conn() -> Iterator[Any]:
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed (make setup)")
    if shutil.which("libvirtd") is None:
        pytest.skip("libvirtd is not installed (make setup installs libvirt-daemon-system)")
    _start_daemons()
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
