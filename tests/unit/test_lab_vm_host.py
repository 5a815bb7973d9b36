"""The pure parts of the lab's VM host: qemu.conf settings, daemon argv, RAM file paths, capabilities; and the
bounds on its waits (bounded, wait_until, _run) and the one retry of a nested boot that died unborn."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from vrnic.errors import LabError
from vrnic.lab.vm_host import (
    TIMED_OUT,
    NestedBootFailed,
    NestedBootRetried,
    VmHost,
    VmHostConfig,
    _run,
    bounded,
    capabilities_domain_types,
    early_stop,
    libvirtd_argv,
    libvirtd_conf_settings,
    qemu_conf_settings,
    qemu_threads,
    ram_dir,
    ram_file,
    read_from,
    retry_boot_once,
    thread_stat,
    virtlogd_argv,
    wait_until,
)

CAPS = """<capabilities>
  <host><cpu><arch>x86_64</arch></cpu></host>
  <guest><os_type>hvm</os_type>
    <arch name='i686'><domain type='qemu'/><domain type='kvm'/></arch></guest>
  <guest><os_type>hvm</os_type>
    <arch name='x86_64'><wordsize>64</wordsize><domain type='qemu'/><domain type='kvm'/></arch></guest>
</capabilities>"""


def test_qemu_conf_settings() -> None:
    text = qemu_conf_settings(VmHostConfig(memory_backing_dir=Path("/dev/shm/ram")))
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [
        'user = "root"',
        'group = "root"',
        "dynamic_ownership = 0",
        'security_driver = "none"',
        'stdio_handler = "file"',
        "cgroup_controllers = [ ]",
        'memory_backing_dir = "/dev/shm/ram"',
    ]
    assert text.endswith("\n")


def test_memory_backing_dir_is_quoted() -> None:
    text = qemu_conf_settings(VmHostConfig(memory_backing_dir=Path('/odd "dir"')))
    assert 'memory_backing_dir = "/odd \\"dir\\""' in text


def test_ram_file_layout_of_libvirt_9() -> None:
    config = VmHostConfig(memory_backing_dir=Path("/var/lib/libvirt/qemu/ram"))
    assert ram_dir(config) == Path("/var/lib/libvirt/qemu/ram/libvirt/qemu")
    assert ram_file(config, 1, "vm1") == Path("/var/lib/libvirt/qemu/ram/libvirt/qemu/1-vm1/pc.ram")
    # the short name keeps 20 characters of the domain name
    assert ram_file(config, 12, "a-very-long-domain-name-indeed").parent.name == "12-a-very-long-domain-n"


def test_daemon_argv_write_pid_files_under_the_state_dir() -> None:
    config = VmHostConfig(state_dir=Path("/run/x"))
    assert virtlogd_argv(config) == ["virtlogd", "-d", "--pid-file", "/run/x/virtlogd.pid"]
    assert libvirtd_argv(config) == ["libvirtd", "-d", "--pid-file", "/run/x/libvirtd.pid"]


def test_a_migration_endpoint_listens_on_tcp_with_its_own_host_uuid() -> None:
    plain = VmHostConfig()
    assert libvirtd_conf_settings(plain).splitlines() == ["# appended by vrnic.lab.vm_host"]
    assert "migration_host" not in qemu_conf_settings(plain)
    config = VmHostConfig(state_dir=Path("/run/x"), listen_address="10.77.0.2", host_uuid="6a1c0f3e-0a0a-4a0a-8a0a-b")
    assert libvirtd_argv(config) == ["libvirtd", "-d", "--listen", "--pid-file", "/run/x/libvirtd.pid"]
    assert libvirtd_conf_settings(config).splitlines()[1:] == [
        "listen_tls = 0", "listen_tcp = 1", 'auth_tcp = "none"', 'listen_addr = "10.77.0.2"',
        'host_uuid = "6a1c0f3e-0a0a-4a0a-8a0a-b"']
    lines = qemu_conf_settings(config).splitlines()
    assert 'migration_address = "10.77.0.2"' in lines and 'migration_host = "10.77.0.2"' in lines


def test_capabilities_domain_types() -> None:
    assert capabilities_domain_types(CAPS) == frozenset({"qemu", "kvm"})
    assert capabilities_domain_types(CAPS.replace("<domain type='kvm'/>", "")) == frozenset({"qemu"})
    assert capabilities_domain_types("<capabilities/>") == frozenset()


def test_refuses_to_run_outside_the_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRNIC_LAB", raising=False)
    with pytest.raises(LabError, match="inside the lab"):
        VmHost().start()


# --- bounds on waits, and the one retry ---------------------------------------------------------------

def test_early_stop_is_a_domain_gone_before_the_guest_spoke() -> None:
    assert early_stop(False, "", "vm: init at") == "the domain stopped before the guest printed 'vm: init at'; " \
                                                   "its console is empty"
    reason = early_stop(False, "[ 0.5] some warning\n", "vm: init at")
    assert reason is not None and "console holds 19 bytes, last: '[ 0.5] some warning'" in reason
    # still running: a slow boot, not a dead one; the guest spoke: whatever follows is the feature's
    assert early_stop(True, "", "vm: init at") is None
    assert early_stop(False, "vm: init at 0.8 s\nvm: insmod igbvf failed\n", "vm: init at") is None


def test_a_guest_gone_after_its_boot_steps_alone_is_transient_too() -> None:
    steps = ("init at", "root mounted at")
    silent = "vm: init at 21.81 s\n[ 22.1] random: crng init done\nvm: root mounted at 25.74 s\n"
    reason = early_stop(False, silent, "vm:", steps)
    assert reason is not None and "after its boot steps alone" in reason and "root mounted at 25.74 s" in reason
    assert early_stop(False, silent, "vm:") is None  # no steps named: the guest spoke
    assert early_stop(True, silent, "vm:", steps) is None  # still running
    # its scripts said why: the feature's business, never retried
    for said in ("vm: boot failed: mount hostroot\n", "vm: program exited (1)\n", "vm: power button\n"):
        assert early_stop(False, silent + said, "vm:", steps) is None
    assert "console is empty" in (early_stop(False, "", "vm:", steps) or "")


def test_read_from_an_offset_of_an_appended_log(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    assert read_from(log) == ""
    log.write_bytes(b"first boot\n")
    offset = log.stat().st_size
    with log.open("ab") as f:
        f.write(b"second boot \xff\n")
    assert read_from(log, offset) == "second boot \ufffd\n"
    assert read_from(log).startswith("first boot")


def _stat(tid: int, name: str, state: str, utime: int, stime: int) -> str:
    return f"{tid} ({name}) {state} 1 {tid} {tid} 0 -1 4194560 10 0 0 0 {utime} {stime} 0 0 20 0 4 0 99"


def test_thread_stat_reads_name_state_and_cpu_ticks() -> None:
    assert thread_stat(_stat(812, "CPU 0/KVM", "R", 1200, 34)) == ("CPU 0/KVM", "R", 1234)
    assert thread_stat(_stat(9, "a) (b", "S", 0, 5)) == ("a) (b", "S", 5)  # a name with parentheses


def test_qemu_threads_names_each_qemu_thread_with_its_cpu_over_the_sample(tmp_path: Path) -> None:
    for pid, comm, threads in ((812, "qemu-system-x86", {812: ("qemu-system-x86", "S", "do_sys_poll"),
                                                         815: ("CPU 0/KVM", "R", "0")}),
                               (900, "python3", {900: ("python3", "S", "ep_poll")})):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
        for tid, (name, state, wchan) in threads.items():
            task = tmp_path / str(pid) / "task" / str(tid)
            task.mkdir(parents=True)
            (task / "stat").write_text(_stat(tid, name, state, 100, 20))
            (task / "wchan").write_text(wchan)  # a running thread's is "0"
    (tmp_path / "self").mkdir()
    assert qemu_threads(0, tmp_path) == ["812/812 qemu-system-x86 S do_sys_poll +0", "812/815 CPU 0/KVM R - +0"]


def test_bounded_returns_raises_or_gives_up_naming_the_wait() -> None:
    assert bounded(lambda: 42, 5, "answer") == 42

    def fails() -> None:
        raise ValueError("libvirt said no")

    with pytest.raises(ValueError, match="libvirt said no"):
        bounded(fails, 5, "a call that fails")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(LabError, match=r"(?s)virDomainCreate of x did not return within 0 s\n--- the report"):
        bounded(release.wait, 0.2, "virDomainCreate of x", lambda: "--- the report")
    assert time.monotonic() - started < 2
    release.set()


def test_a_failing_report_does_not_hide_the_timeout() -> None:
    def broken() -> str:
        raise OSError("no virsh")

    with pytest.raises(LabError, match=r"(?s)waiting: not within 0 s.*no report: OSError"):
        wait_until(lambda: False, 0.1, "waiting", broken, step=0.02)
    assert wait_until(lambda: True, 1, "instant") < 1


def test_run_bounds_a_command(tmp_path: Path) -> None:
    result = _run(["sleep", "5"], check=False, timeout=0.2)
    assert result.returncode == TIMED_OUT and "within 0 s" in result.stderr
    with pytest.raises(LabError, match="`sleep 5` did not finish within 0 s"):
        _run(["sleep", "5"], timeout=0.2)


def test_retry_boot_once_retries_only_the_transient_failure_and_only_once() -> None:
    said: list[str] = []
    attempts = iter([NestedBootFailed("stopped before 'init at'; its console is empty"), "booted"])

    def boot() -> str:
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    with pytest.warns(NestedBootRetried, match="vm-1: nested boot failed the transient way"):
        assert retry_boot_once(boot, "vm-1", said.append) == "booted"
    assert len(said) == 1 and "its console is empty" in said[0]

    calls = []

    def always_dies() -> None:
        calls.append(1)
        raise NestedBootFailed("stopped again")

    with pytest.warns(NestedBootRetried), pytest.raises(NestedBootFailed, match="second boot failed too: stopped"):
        retry_boot_once(always_dies, "vm-2", said.append)
    assert len(calls) == 2


def test_retry_boot_once_never_retries_an_assertion_or_another_error() -> None:
    for error in (AssertionError("the VF is not on vfio-pci"), LabError("virsh start: hook refused")):
        calls: list[int] = []

        def boot(error: Exception = error, calls: list[int] = calls) -> None:
            calls.append(1)
            raise error

        with pytest.raises(type(error)):
            retry_boot_once(boot, "vm", lambda _: None)
        assert calls == [1]
