"""A host that serves VMs with vRNICs, set up inside the lab the way an operator sets one up.

    libvirtd (VmHost), `vrnic db upgrade` beside it -> `vrnic daemon`, and beside it `vrnic hook install` ->
    libvirtd restarted (it reads hooks at startup) -> tenants and vRNICs through the REST API -> `vrnic vm attach`
    -> `virsh start`

Used by `make demo-vm` (vrnic.lab.vm_demo), tests/kernel/test_vm_hook_flow.py and the VM benchmarks.
Inside the lab only: it mounts over /etc/libvirt and /var/lib/libvirt (VmHost).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from vrnic.errors import LabError
from vrnic.lab.health import health
from vrnic.lab.vm_guest import BOOT_STEPS, MARK, ControlPort, peer_domain
from vrnic.lab.vm_host import (
    URI,
    VmHost,
    VmHostConfig,
    boot_and_wait,
    define_domain,
    domain_report,
)
from vrnic.vm.domain_xml import DomainType

PROJECT = Path(__file__).resolve().parents[2]


def boot_until_ready(name: str, start: Callable[[], None], connect: Callable[[], ControlPort], console: Path,
                     report: Callable[[], str], ready_timeout: float = 240, undo: Callable[[], object] = lambda: None,
                     say: Callable[[str], None] = print) -> tuple[ControlPort, dict[str, Any]]:
    """start() a defined domain, then the VM program's `ready` on connect()'s port: (the port, the message).
    A guest that died unborn is booted once more (boot_and_wait)."""

    def ready() -> tuple[ControlPort, dict[str, Any]]:
        control = connect()
        try:
            return control, control.ready(ready_timeout)
        except BaseException:
            control.close()
            raise

    return boot_and_wait(name, start, ready, console, report, MARK, undo=undo, say=say, progress=BOOT_STEPS)


class VmLab:
    def __init__(self, workdir: Path, say: Callable[[str], None] = lambda _: None, port: int = 8470) -> None:
        self.workdir = workdir
        self.say = say
        self.url = f"http://127.0.0.1:{port}"
        self.token = secrets.token_urlsafe(24)
        self.state = workdir / "state"
        self.hook_log = workdir / "hook.log"
        self.host = VmHost(VmHostConfig())
        self.daemon: subprocess.Popen[bytes] | None = None
        self.timings: dict[str, float] = {}
        self.env = {**os.environ, "VRNIC_STATE_DIR": str(self.state), "VRNIC_OPERATOR_TOKEN": self.token,
                    "VRNIC_LISTEN_PORT": str(port), "VRNIC_SRIOV_DRIVER": "", "VRNIC_API_URL": self.url,
                    "VRNIC_API_TOKEN": self.token, "PYTHONPATH": str(PROJECT),
                    "VRNIC_PARAVIRTUAL_DRIVER_OPTIONS": json.dumps({"socket_path": str(workdir / "vrnicd.sock")})}

    # ----- setup -------------------------------------------------------------------------------
    def start(self) -> VmLab:
        """The steps that wait on nothing of each other's run side by side: under TCG each is a process busy on one
        of the lab's two vCPUs (`vrnic db upgrade` while libvirtd starts; the hook and libvirtd's restart while
        the daemon starts), which took this setup from 107 s to about 70."""
        upgrade: subprocess.Popen[str] | None = None
        try:
            self.state.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            upgrade = self._cli("db", "upgrade")
            self.host.start()
            self.timings["libvirtd_s"] = time.monotonic() - t0
            self.say(f"libvirtd up ({self.timings['libvirtd_s']:.1f} s), domain types: "
                     f"{', '.join(sorted(self.host.domain_types))}")
            self._finish(upgrade, "db", "upgrade")
            self.timings["db_upgrade_done_s"] = time.monotonic() - t0
            with (self.workdir / "daemon.log").open("ab") as log:  # the daemon holds its own copy of the fd
                self.daemon = subprocess.Popen([sys.executable, "-m", "vrnic.cli.main", "daemon"], env=self.env,
                                               stdout=log, stderr=subprocess.STDOUT)
            token_file = self.state / "hook-token"  # what the hook reads: libvirtd gives it no environment
            token_file.write_text(self.token)
            token_file.chmod(0o600)
            out = self.vrnic("hook", "install", "--api-url", self.url, "--memory-backing-dir",
                             str(self.host.config.memory_backing_dir), "--log", str(self.hook_log),
                             "--token-file", str(token_file))
            self.say(out.strip())
            self.timings["libvirtd_restart_s"] = self.host.restart_libvirtd()
            self._wait_api()
            self.timings["serving_s"] = time.monotonic() - t0
            self.say(f"vrnic daemon serving {self.url} (log {self.workdir / 'daemon.log'})")
        except BaseException:
            if upgrade is not None and upgrade.poll() is None:
                upgrade.kill()
                upgrade.wait()
            self.stop()
            raise
        return self

    def _wait_api(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.daemon is not None
            if self.daemon.poll() is not None:
                raise LabError(f"vrnic daemon exited ({self.daemon.returncode}); "
                               f"{(self.workdir / 'daemon.log').read_text()[-2000:]}")
            if health(self.url) is not None:
                return
            if time.monotonic() > deadline:
                raise LabError(f"vrnic daemon did not answer within {timeout:.0f} s")
            time.sleep(0.2)

    # ----- tools -------------------------------------------------------------------------------
    def vrnic(self, *args: str, check: bool = True, token: str | None = None) -> str:
        """Run the vrnic CLI as an operator (or with a tenant's token); its stdout, or LabError."""
        return self._finish(self._cli(*args, token=token), *args, check=check)

    def _cli(self, *args: str, token: str | None = None) -> subprocess.Popen[str]:
        """The vrnic CLI started (see vrnic(); _finish() waits for it)."""
        env = self.env if token is None else {**self.env, "VRNIC_API_TOKEN": token}
        return subprocess.Popen([sys.executable, "-m", "vrnic.cli.main", *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    @staticmethod
    def _finish(process: subprocess.Popen[str], *args: str, check: bool = True, timeout: float = 120) -> str:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise LabError(f"vrnic {' '.join(args)} did not finish within {timeout:.0f} s") from None
        if check and process.returncode != 0:
            raise LabError(f"vrnic {' '.join(args)} failed ({process.returncode}): {(stderr or stdout).strip()}")
        return stdout if check else stdout + stderr

    def virsh(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`virsh ARGS` (its result, whatever its exit code); LabError, with the domain's report, if it has not
        finished within `timeout` s."""
        try:
            return subprocess.run(["virsh", "-c", URI, *args], capture_output=True, text=True, check=False,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            domain = args[1] if len(args) > 1 else None
            raise LabError(f"`virsh {' '.join(args)}` did not finish within {timeout:.0f} s"
                           + (f"\n{self.report(domain)}" if domain else "")) from None

    def report(self, domain: str) -> str:
        """libvirt's state of a domain define_vm() made, its QEMU log, console and the lab kernel's last lines."""
        return domain_report(domain, self.workdir / domain / "console.log")

    def start_vm(self, name: str, files: Path, ready_timeout: float = 240) -> tuple[ControlPort, dict[str, Any]]:
        """`virsh start NAME`, then the VM program's `ready` on its control port: (the port, the message).

        A failed `virsh start` (a hook's refusal: that is the feature's answer) is LabError, never retried;
        the rest is boot_until_ready's."""

        def start() -> None:
            started = self.virsh("start", name)
            if started.returncode != 0:
                raise LabError(f"virsh start {name} failed: {(started.stderr or started.stdout).strip()}")

        control, ready = boot_until_ready(name, start, lambda: self.control(files), files / "console.log",
                                          lambda: self.report(name), ready_timeout, say=self.say)
        control.report = lambda: self.report(name)  # a silent VM program's error carries them too, from here on
        return control, ready

    def api(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=60,
                            headers={"Authorization": f"Bearer {token or self.token}"})

    def tenant(self, name: str) -> str:
        """A tenant's API token."""
        with self.api() as operator:
            response = operator.post("/tenants", json={"name": name})
            response.raise_for_status()
            return str(response.json()["token"])

    def allocate(self, tenant_token: str, device: str | None = None) -> dict[str, Any]:
        with self.api(tenant_token) as tenant:
            response = tenant.post("/vrnics", json={"device": device} if device else {})
            if response.status_code != 201:
                raise LabError(f"allocate failed: {response.status_code} {response.text}")
            vrnic: dict[str, Any] = response.json()
            return vrnic

    def define_vm(self, name: str, memory_mib: int = 384) -> Path:
        """A domain with no vRNIC yet (`vrnic vm attach` adds one); its files live in workdir/<name>."""
        files = self.workdir / name
        files.mkdir(parents=True, exist_ok=True)
        domain_type = DomainType.KVM if "kvm" in self.host.domain_types else DomainType.QEMU
        if domain_type is DomainType.QEMU:
            self.say("no /dev/kvm here: the VM runs under TCG (much slower)")
        spec = peer_domain(name, files, PROJECT, None, domain_type, memory_mib)
        define_domain(spec.to_xml())
        return files

    def control(self, files: Path) -> ControlPort:
        return ControlPort(files / "ctl.sock")

    def hook_events(self, domain: str) -> list[dict[str, Any]]:
        if not self.hook_log.exists():
            return []
        events = [json.loads(line) for line in self.hook_log.read_text().splitlines() if line.strip()]
        return [e for e in events if e.get("domain") == domain]

    # ----- teardown ----------------------------------------------------------------------------
    def stop(self) -> list[str]:
        problems = self.host.stop()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                problems.append("vrnic daemon ignored SIGTERM; killed")
                self.daemon.kill()
                self.daemon.wait()
        self.daemon = None
        return problems

    def __enter__(self) -> VmLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

