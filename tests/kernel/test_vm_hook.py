"""The libvirt qemu hook (vrnic.vm.hook) installed before libvirtd starts, inside the lab.

Proves that the hook sees our <metadata> after libvirt's own round trip, that its `prepare` refusal
stops `virsh start` with the hook's message, and which ops a start/destroy cycle calls.

Run: vrnic lab run --topology single -e PYTHONPATH=$PWD -- python -m pytest -s tests/kernel/test_vm_hook.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vrnic.config import PROJECT_DIR
from vrnic.lab.kernel import kernel_image
from vrnic.lab.vm_host import URI, VmHost, VmHostConfig, leftover_processes
from vrnic.vm.domain_xml import DirectKernelBoot, DomainType, VirtioSerialChannel, VmDomain, VrnicAttachment
from vrnic.vm.hook import hook_wrapper_script

KNOWN = "v-known"


@pytest.fixture(scope="module")
def hooked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VmHost, Path]]:
    if os.environ.get("VRNIC_LAB") != "1":
        pytest.skip("needs the lab guest (libvirtd on a tmpfs): "
                    "vrnic lab run --topology single -- pytest tests/kernel/test_vm_hook.py")
    for tool in ("libvirtd", "virtlogd", "virsh"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    state = tmp_path_factory.mktemp("hook")
    known, log = state / "known.json", state / "events.jsonl"
    known.write_text(json.dumps([KNOWN]))
    config = VmHostConfig(require_kvm=False)
    script = hook_wrapper_script(Path(sys.executable), PROJECT_DIR, known, log, config.memory_backing_dir)
    host = VmHost(replace(config, hooks={"qemu": script}))
    host.start()
    yield host, log
    problems = host.stop()
    assert not problems, problems
    assert not leftover_processes(), leftover_processes()


def _virsh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["virsh", "-c", URI, *args], capture_output=True, text=True, check=False, timeout=120)


def _domain(name: str, vrnic_id: str, tmp: Path, domain_type: DomainType) -> str:
    return VmDomain(name=name, domain_type=domain_type, memory_mib=64,
                    boot=DirectKernelBoot(kernel=kernel_image(os.uname().release), cmdline="console=ttyS0"),
                    vrnics=(VrnicAttachment(vrnic_id),),
                    channels=(VirtioSerialChannel(tmp / f"{name}.sock"),)).to_xml()


def _events(log: Path, name: str) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["domain"] == name]


def test_prepare_refuses_an_unknown_vrnic(hooked: tuple[VmHost, Path], tmp_path: Path) -> None:
    host, log = hooked
    kind = DomainType.KVM if "kvm" in host.domain_types else DomainType.QEMU
    name = "vrnic-hook-refused"
    (tmp_path / "d.xml").write_text(_domain(name, "v-unknown", tmp_path, kind))
    assert _virsh("define", str(tmp_path / "d.xml")).returncode == 0
    try:
        t0 = time.monotonic()
        result = _virsh("start", "--paused", name)
        elapsed = time.monotonic() - t0
        print(f"\nvirsh start (refused) rc={result.returncode} in {elapsed:.2f} s\n"
              f"stdout: {result.stdout.strip()!r}\nstderr: {result.stderr.strip()!r}")
        assert result.returncode == 1
        assert "vrnic: unknown vRNIC(s) v-unknown; refusing to start vrnic-hook-refused" in result.stderr
        assert _virsh("domstate", name).stdout.strip() == "shut off"
        events = _events(log, name)
        print(f"hook ops for the refused domain: {[(e['op'], e['sub_op']) for e in events]}")
        assert events[0]["op"] == "prepare"
        assert events[0]["vrnics"] == [{"vrnic_id": "v-unknown", "channel": "org.vrnic.0"}]
        assert "started" not in [e["op"] for e in events]
    finally:
        _virsh("undefine", name)


def test_known_vrnic_starts_and_every_op_sees_the_metadata(hooked: tuple[VmHost, Path], tmp_path: Path) -> None:
    host, log = hooked
    kind = DomainType.KVM if "kvm" in host.domain_types else DomainType.QEMU
    name = "vrnic-hook-allowed"
    (tmp_path / "d.xml").write_text(_domain(name, KNOWN, tmp_path, kind))
    assert _virsh("define", str(tmp_path / "d.xml")).returncode == 0
    try:
        t0 = time.monotonic()
        result = _virsh("start", "--paused", name)
        print(f"\nvirsh start (allowed, paused) rc={result.returncode} in {time.monotonic() - t0:.2f} s "
              f"{result.stderr.strip()!r}")
        assert result.returncode == 0, result.stderr
        assert _virsh("domstate", name).stdout.strip() == "paused"
        assert _virsh("destroy", name).returncode == 0
    finally:
        _virsh("destroy", name)
        _virsh("undefine", name)
    events = _events(log, name)
    ops = [(e["op"], e["sub_op"]) for e in events]
    print(f"hook ops for the allowed domain: {ops}")
    print("RAM file per op: " + ", ".join(f"{e['op']}: id={e['domain_id']} exists={e.get('ram_file_exists')}"
                                          for e in events))
    started = next(e for e in events if e["op"] == "started")
    # at `started` the hook finds the RAM file from the XML alone (no call back into libvirtd)
    assert started["ram_file_exists"] is True, started
    assert ops[:3] == [("prepare", "begin"), ("start", "begin"), ("started", "begin")]
    assert ("stopped", "end") in ops and ("release", "end") in ops
    assert all(e["vrnics"] == [{"vrnic_id": KNOWN, "channel": "org.vrnic.0"}] for e in events)
    assert all(e["shared_file_memory"] for e in events)
