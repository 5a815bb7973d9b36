"""libvirtd on a lab host as a migration endpoint, with vrnic's hook installed, driven line by line.

    python -m vrnic.lab.two_hosts.libvirt_target    # reads JSON commands on stdin, answers one JSON line each

Commands: start_host {host, api_url, token, listen_address, host_uuid} -> kvm, timings (libvirtd listening on
TCP, the hook calling this host's `vrnic daemon` with the operator token); virsh {args} -> rc, stdout, stderr
(local qemu:///system); control {socket, verb, args} -> the VM program's reply on its control port (a unix
socket of this host); stop_host -> problems. Host a uses the class directly, host b through its control server
(tests/two_hosts/test_virsh_migrate.py).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from vrnic.config import PROJECT_DIR, lab_output_dir
from vrnic.errors import LabError, VrnicError
from vrnic.lab.two_hosts.guest import serve_lines
from vrnic.lab.vm_guest import ControlPort
from vrnic.lab.vm_host import URI, VmHost, VmHostConfig
from vrnic.vm.hook import hook_wrapper_script

LOG_DIR = lab_output_dir("two-hosts")
STATE_DIR = Path("/run/vrnic-virsh")


def hook_log(host: str) -> Path:
    return LOG_DIR / f"hook-{host}.jsonl"


class LibvirtTarget:
    def __init__(self) -> None:
        self.host: VmHost | None = None
        self.ports: dict[str, ControlPort] = {}

    def do_start_host(self, host: str, api_url: str, token: str, listen_address: str,
                      host_uuid: str) -> dict[str, Any]:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        token_file = STATE_DIR / "operator-token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        config = VmHostConfig(require_kvm=False, listen_address=listen_address, host_uuid=host_uuid)
        hook_log(host).unlink(missing_ok=True)
        hook = hook_wrapper_script(Path(sys.executable), PROJECT_DIR, api_url, token_file, config.memory_backing_dir,
                                   hook_log(host))
        self.host = VmHost(replace(config, hooks={"qemu": hook})).start()
        return {"kvm": self.host.kvm, "timings": self.host.timings}

    def do_virsh(self, args: list[str], timeout: float = 120.0) -> dict[str, Any]:
        try:
            done = subprocess.run(["virsh", "-c", URI, *args], capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            return {"rc": 124, "stdout": "", "stderr": f"virsh {' '.join(args)} ran out of {timeout} s"}
        return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}

    def do_control(self, socket: str, verb: str, args: dict[str, Any] | None = None,
                   timeout: float = 60.0) -> dict[str, Any]:
        port = self.ports.get(socket)
        if port is None:
            port = self.ports[socket] = ControlPort(Path(socket), timeout=timeout)
        return port.call(verb, **(args or {}))

    def do_stop_host(self) -> dict[str, Any]:
        for port in self.ports.values():
            port.close()
        self.ports.clear()
        problems = self.host.stop() if self.host is not None else []
        self.host = None
        return {"problems": problems}


def main() -> int:
    target = LibvirtTarget()
    try:
        return serve_lines(target, sys.stdin, sys.stdout, errors=(VrnicError, LabError, OSError))
    finally:
        target.do_stop_host()


if __name__ == "__main__":
    sys.exit(main())
