"""The pure parts of the lab's VM host: qemu.conf settings, daemon argv, RAM file paths, capabilities."""

from __future__ import annotations

from pathlib import Path

import pytest

from vrnic.errors import LabError
from vrnic.lab.vm_host import (
    VmHost,
    VmHostConfig,
    capabilities_domain_types,
    libvirtd_argv,
    qemu_conf_settings,
    ram_dir,
    ram_file,
    virtlogd_argv,
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


def test_capabilities_domain_types() -> None:
    assert capabilities_domain_types(CAPS) == frozenset({"qemu", "kvm"})
    assert capabilities_domain_types(CAPS.replace("<domain type='kvm'/>", "")) == frozenset({"qemu"})
    assert capabilities_domain_types("<capabilities/>") == frozenset()


def test_refuses_to_run_outside_the_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRNIC_LAB", raising=False)
    with pytest.raises(LabError, match="inside the lab"):
        VmHost().start()
