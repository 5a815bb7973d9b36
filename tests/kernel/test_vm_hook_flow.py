"""A VM with a vRNIC the way an operator runs it: real libvirtd, `vrnic daemon`, `vrnic hook install`,
`vrnic vm attach`, `virsh start` (nested KVM in the lab).

Proves: attach and detach round-trip the persistent XML, with clear errors for an unknown domain,
another tenant's vRNIC, a vRNIC attached elsewhere and a released one; the hook runs for every
operation and a domain whose vRNIC is unknown does not start, with the reason in `virsh start`'s
output; a started VM does RDMA with a container guest; after libvirtd restarts (`reconnect`) the VM
is still served; `virsh destroy` mid-traffic leaves no kernel object; a migration to the same host is refused.

Run: vrnic lab run -e PYTHONPATH=$PWD -- pytest -m kernel tests/kernel/test_vm_hook_flow.py
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.specs import AttachInfo
from vrnic.errors import LabError
from vrnic.lab.vm_guest import HostPeer, peer_domain
from vrnic.lab.vm_host import URI, bounded, define_domain, leftover_processes
from vrnic.lab.vm_lab import PROJECT, VmLab
from vrnic.vm.domain_edit import canonical
from vrnic.vm.domain_xml import DomainType

from .conftest import wait_for_baseline

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VmLab]:
    if os.environ.get("VRNIC_LAB") != "1":
        pytest.skip("needs the lab guest: vrnic lab run -- pytest tests/kernel/test_vm_hook_flow.py")
    pytest.importorskip("libvirt", reason="libvirt-python is not installed (make setup)")
    for tool in ("libvirtd", "virtlogd", "virsh", "cpio"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    vm_lab = VmLab(tmp_path_factory.mktemp("vmlab"), print).start()
    yield vm_lab
    problems = vm_lab.stop()
    print(f"\nTIMINGS {vm_lab.timings}")
    assert not problems, problems
    assert not leftover_processes(), leftover_processes()


def _persistent_xml(name: str) -> str:
    import libvirt

    def read() -> str:
        conn = libvirt.open(URI)
        try:
            return str(conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        finally:
            conn.close()

    return bounded(read, 60, f"reading {name}'s persistent XML (virDomainGetXMLDesc)")


def _canon(text: str) -> str:
    return canonical(text)


def _undefine(lab: VmLab, name: str) -> None:
    lab.virsh("destroy", name)
    lab.virsh("undefine", name)


def test_attach_detach_round_trip_and_refusals(lab: VmLab) -> None:
    acme, other = lab.tenant("acme-xml"), lab.tenant("other-xml")
    mine, theirs = lab.allocate(acme), lab.allocate(other)
    lab.define_vm("xml-1")
    lab.define_vm("xml-2")
    try:
        original = _persistent_xml("xml-1")
        with pytest.raises(LabError, match="no domain"):
            lab.vrnic("vm", "attach", "no-such-domain", "--vrnic", mine["id"], token=acme)
        with pytest.raises(LabError, match="404|not found|does not exist"):
            lab.vrnic("vm", "attach", "xml-1", "--vrnic", theirs["id"], token=acme)
        lab.vrnic("vm", "attach", "xml-1", "--vrnic", mine["id"], token=acme)
        attached = ET.fromstring(_persistent_xml("xml-1"))
        assert attached.find("memoryBacking/access[@mode='shared']") is not None
        assert attached.find("devices/channel/target[@name='org.vrnic.0']") is not None
        assert mine["id"] in _persistent_xml("xml-1")
        with pytest.raises(LabError, match="xml-1"):  # attached elsewhere names where
            lab.vrnic("vm", "attach", "xml-2", "--vrnic", mine["id"], token=acme)
        assert mine["id"] not in _persistent_xml("xml-2")
        lab.vrnic("vm", "detach", "xml-1", token=acme)
        assert _canon(_persistent_xml("xml-1")) == _canon(original)
        released = lab.allocate(acme)
        with lab.api(acme) as api:
            assert api.delete(f"/vrnics/{released['id']}").status_code == 200
        with pytest.raises(LabError, match="released"):
            lab.vrnic("vm", "attach", "xml-1", "--vrnic", released["id"], token=acme)
        assert _canon(_persistent_xml("xml-1")) == _canon(original)
    finally:
        _undefine(lab, "xml-1")
        _undefine(lab, "xml-2")


def test_an_unknown_vrnic_stops_the_start_with_the_reason_in_virsh(lab: VmLab, tmp_path: Path) -> None:
    domain_type = DomainType.KVM if "kvm" in lab.host.domain_types else DomainType.QEMU
    spec = peer_domain("refused-1", tmp_path, PROJECT, "no-such-vrnic", domain_type)
    define_domain(spec.to_xml())
    try:
        started = lab.virsh("start", "refused-1")
        assert started.returncode != 0
        assert "no-such-vrnic" in started.stderr, started.stderr
        assert "refused-1" not in lab.host.running_domains()
        ops = [(e["op"], e.get("outcome")) for e in lab.hook_events("refused-1")]
        assert ("prepare", "refused") in ops, ops
        assert {"stopped", "release"} <= {op for op, _ in ops}, ops  # libvirt cleans up after a refusal
    finally:
        lab.virsh("undefine", "refused-1")


def test_started_vm_is_served_across_a_libvirtd_restart_and_destroy_leaks_nothing(lab: VmLab) -> None:
    acme = lab.tenant("acme-run")
    vm_vrnic, peer_vrnic = lab.allocate(acme, "rxe0"), lab.allocate(acme, "rxe1")
    files = lab.define_vm("run-1")
    baseline = resource_counts()
    peer = control = None
    try:
        lab.vrnic("vm", "attach", "run-1", "--vrnic", vm_vrnic["id"], token=acme)
        t0 = time.monotonic()
        # virsh start (the hook binds), the VM program's ready; once more if the nested guest died unborn
        control, vm = lab.start_vm("run-1", files)
        lab.timings["virsh_start_to_guest_ready_s"] = time.monotonic() - t0
        with lab.api() as operator:
            bound = operator.get("/vms").json()["items"]
        assert [b["domain"] for b in bound] == ["run-1"] and bound[0]["vrnics"][0]["vrnic_id"] == vm_vrnic["id"]
        ops = [e["op"] for e in lab.hook_events("run-1")]
        assert ops[:3] == ["prepare", "start", "started"], ops
        peer = HostPeer(AttachInfo(**peer_vrnic["attach"]))
        control.call("connect", **peer.info())
        peer.connect(vm)
        payload = secrets.token_bytes(48)
        peer.write_into_vm(payload, vm_offset=4096)
        assert control.call("peek", offset=4096, length=48)["data"] == payload.hex()
        # libvirtd restarts: the hook's reconnect re-binds (a no-op here) and the VM is still served
        lab.timings["libvirtd_restart_with_vm_s"] = lab.host.restart_libvirtd()
        deadline = time.monotonic() + 120  # libvirtd reconnects to running domains in a thread of its own
        while "reconnect" not in [e["op"] for e in lab.hook_events("run-1")] and time.monotonic() < deadline:
            time.sleep(0.5)
        reconnects = [e for e in lab.hook_events("run-1") if e["op"] == "reconnect"]
        assert reconnects and reconnects[-1]["outcome"] == "bound", lab.hook_events("run-1")
        again = b"after libvirtd restarted " + secrets.token_bytes(8)
        peer.post_recv()
        control.call("send", data=again.hex())
        peer.cq.wait(1, timeout=30)
        assert peer.mr.read(len(again)) == again
        # a migration to the host that serves it is refused by the hook (run as libvirtd would, with its XML)
        migrate = subprocess.run(["/etc/libvirt/hooks/qemu", "run-1", "migrate", "begin", "-"],
                                 input=_persistent_xml("run-1"), capture_output=True, text=True, timeout=60)
        assert migrate.returncode != 0 and "migration" in migrate.stderr, migrate
        # destroy in the middle of traffic
        control.call("flood", size=4096)
        time.sleep(1.0)
        assert lab.virsh("destroy", "run-1").returncode == 0
        peer.close()
        peer = None
        assert wait_for_baseline(baseline, timeout=20) == baseline, "kernel objects left after virsh destroy"
        ops = [e["op"] for e in lab.hook_events("run-1")]
        assert {"stopped", "release"} <= set(ops), ops
        with lab.api() as operator:
            assert operator.get("/vms").json()["items"] == []
    finally:
        if peer is not None:
            peer.close()
        if control is not None:
            control.close()
        _undefine(lab, "run-1")
