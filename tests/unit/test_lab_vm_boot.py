"""boot_until_ready (vrnic.lab.vm_lab, over vm_host.boot_and_wait): which failures of a nested boot are booted
once more, and what is undone first. libvirt is replaced by plain callables and a console file; the real boots
are the lab's VM tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vrnic.errors import LabError
from vrnic.lab import vm_host, vm_lab
from vrnic.lab.vm_guest import MARK
from vrnic.lab.vm_host import NestedBootFailed, NestedBootRetried


class Port:
    def __init__(self, outcome: Exception | dict[str, Any]) -> None:
        self.outcome = outcome
        self.closed = False

    def ready(self, timeout: float) -> dict[str, Any]:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def close(self) -> None:
        self.closed = True


class Rig:
    """A domain whose boots print `consoles[i]` and whose program answers `outcomes[i]`."""

    def __init__(self, console: Path, consoles: list[str], outcomes: list[Exception | dict[str, Any]]) -> None:
        self.console, self.consoles, self.outcomes = console, consoles, outcomes
        self.starts = 0
        self.undone = 0
        self.ports: list[Port] = []
        self.said: list[str] = []

    def start(self) -> None:
        with self.console.open("a") as out:  # libvirt appends boot after boot
            out.write(self.consoles[self.starts])
        self.starts += 1

    def connect(self) -> Port:
        self.ports.append(Port(self.outcomes[self.starts - 1]))
        return self.ports[-1]

    def boot(self) -> tuple[Any, dict[str, Any]]:
        def undo() -> None:
            self.undone += 1

        return vm_lab.boot_until_ready("vm-1", self.start, self.connect, self.console,  # type: ignore[arg-type]
                                       lambda: "REPORT", ready_timeout=1, undo=undo, say=self.said.append)


@pytest.fixture(autouse=True)
def domain_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vm_host, "domain_running", lambda name: False)


def test_a_guest_that_died_unborn_is_undone_and_booted_once_more(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "console.log", ["", f"{MARK} init at 1.2 s\n"],
              [ConnectionError("the VM's control port closed"), {"event": "ready", "gid": "fe80::1"}])
    with pytest.warns(NestedBootRetried, match="VM vm-1: nested boot failed the transient way"):
        port, ready = rig.boot()
    assert ready == {"event": "ready", "gid": "fe80::1"}
    assert port is rig.ports[1] and rig.ports[0].closed and not rig.ports[1].closed
    assert (rig.starts, rig.undone) == (2, 1)
    assert "its console is empty" in rig.said[0] and "REPORT" in rig.said[0]


def test_a_second_death_unborn_fails_and_nothing_is_tried_a_third_time(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "console.log", ["", "[ 0.4] early line\n", "never"],
              [ConnectionError("closed"), ConnectionError("closed again"), {}])
    with pytest.warns(NestedBootRetried), pytest.raises(NestedBootFailed, match="second boot failed too"):
        rig.boot()
    assert (rig.starts, rig.undone) == (2, 2)


def test_a_guest_whose_init_ran_is_the_features_failure_and_never_retried(tmp_path: Path) -> None:
    # the guest's /init printed its mark, so what followed is the feature's business
    rig = Rig(tmp_path / "console.log", [f"{MARK} init at 0.9 s\n{MARK} program exited (1)\n"],
              [TimeoutError("no reply from the VM program within 1 s")])
    with pytest.raises(LabError, match="(?s)did not say ready: no reply.*REPORT") as raised:
        rig.boot()
    assert not isinstance(raised.value, NestedBootFailed)
    assert (rig.starts, rig.undone) == (1, 0) and rig.ports[0].closed


def test_what_start_raises_goes_straight_to_the_caller(tmp_path: Path) -> None:
    def refused() -> None:
        raise LabError("virsh start vm-1 failed: hook refused: unknown vRNIC")

    with pytest.raises(LabError, match="hook refused"):
        vm_lab.boot_until_ready("vm-1", refused, lambda: pytest.fail("no port without a start"),  # type: ignore[arg-type,return-value]
                                tmp_path / "console.log", lambda: "REPORT")


def test_a_silent_or_gone_vm_program_fails_with_the_domains_report(tmp_path: Path) -> None:
    """The control port's two failures after boot, on a real Unix socket: the program says nothing within the
    timeout, or its QEMU closes the port; either error carries report() (the domain's logs and QEMU threads)."""
    import socket
    import threading

    from vrnic.lab.vm_guest import ControlPort

    path = tmp_path / "ctl.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        port = ControlPort(path, timeout=0.2, report=lambda: "--- domain vm-1: running, CPU 0/KVM R - +0")
        program, _ = listener.accept()
        try:
            with pytest.raises(TimeoutError, match=r"within 0 s\n--- domain vm-1: running, CPU 0/KVM R - \+0"):
                port.call("ping", iterations=200)
            def hang_up_after_the_next_command() -> None:
                got = b""
                while got.count(b"\n") < 2:  # the one it never answered, and the next
                    got += program.recv(4096)
                program.close()

            hangs_up = threading.Thread(target=hang_up_after_the_next_command)
            hangs_up.start()
            with pytest.raises(ConnectionError, match=r"closed \(its QEMU is gone\?\)\n--- domain vm-1"):
                port.call("ping", iterations=200)
            hangs_up.join()
            with pytest.raises(ConnectionError, match=r"closed \(its QEMU is gone\?\): Broken pipe\n--- domain"):
                port.call("ping", iterations=200)  # the next command meets the closed port
        finally:
            port.close()
            program.close()
