"""The operator's REST calls of a cross-host migration (POST /vms/{domain}/handover, .../switchover, DELETE),
with the real DbLocator: the switchover moves the vRNIC's row to the destination host before the peer hosts
re-point their QPs, so a peer finds the VM on its new host through the database, as in production.

Two agents on one SQLite database (tests/peering_rig.py two_agents_on_one_database), the in-memory fabric, and
the scene of tests/handover_rig.py (a VM on host-a, a peer guest on each host).
"""

from __future__ import annotations

import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.handover_rig import Scene
from tests.peering_fakes import MemoryLocator
from tests.peering_rig import Cluster, two_agents_on_one_database
from tests.unit.fake_qemu import Vm, vm_factory
from tests.unit.test_backend_vm_migration import resume_on
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.peer_directory import AgentRef
from vrnic.core.rings import WcStatus
from vrnic.core.specs import AttachInfo

pytestmark = pytest.mark.api


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Cluster, FakeEdge]]:
    edge = FakeEdge()
    with two_agents_on_one_database(edge, ("fake0", "fake1"), tmp_path) as made:
        httpx.post(f"{made.agents['host-a'].url}/api/v1/tenants", json={"name": "acme"},
                   headers=made.operator).raise_for_status()
        yield made, edge
    assert not edge.live, "objects left on the fake NIC"


@pytest.fixture
def scene(cluster: tuple[Cluster, FakeEdge], tmp_path: Path) -> Iterator[Scene]:
    rig, edge = cluster
    (tmp_path / "vms").mkdir()
    vms = vm_factory(tmp_path / "vms")
    make_vm: Callable[[str], Vm] = next(vms)

    def make(host: str) -> AttachInfo:
        return rig.allocate("host-a", {"tenant": "acme", "host": f"host-{host}"})

    drivers = {"a": rig.agents["host-a"].driver, "b": rig.agents["host-b"].driver}
    # The REST calls drive the hand-over here, with the agents' own clients: no destination or peer hosts given.
    made = Scene(drivers, make, MemoryLocator(), edge, make_vm, None, None,  # type: ignore[arg-type]
                 AgentRef("host-b", rig.agents["host-b"].url))
    yield made
    made.close()
    next(vms, None)


def api(rig: Cluster, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, f"{rig.agents['host-a'].url}/api/v1{path}", json=body, headers=rig.operator,
                         timeout=60)


def test_the_operator_moves_a_vm_to_another_host_and_the_database_follows(cluster: tuple[Cluster, FakeEdge],
                                                                         scene: Scene) -> None:
    rig, edge = cluster
    shutil.copyfile(scene.source.ram, scene.dest.ram)
    prepared = api(rig, "POST", "/vms/vm1/handover", {"host": "host-b", "binding": scene.target().model_dump()})
    assert prepared.status_code == 200, prepared.text
    assert prepared.json()["moving"] == [scene.vm_id]
    scene.dest.accept()
    again = api(rig, "POST", "/vms/vm1/handover", {"host": "host-b", "binding": scene.target().model_dump()})
    assert again.status_code == 409, again.text
    for seq in range(1, 5):
        scene.write("a", seq)
        scene.write("b", seq)
    for host in ("a", "b"):
        assert [c.status for c in scene.p_cq[host].wait(4)] == [WcStatus.SUCCESS] * 4
    before = scene.source_objects()
    switched = api(rig, "POST", "/vms/vm1/handover/switchover")
    assert switched.status_code == 200, switched.text
    report = switched.json()
    assert report["peers_repointed"] == 2 and report["broken_qps"] == 0, report
    assert not before & edge.live
    row = api(rig, "GET", f"/vrnics/{scene.vm_id}").json()
    assert row["host"] == "host-b" and row["device"] == "fake1", row
    moved = api(rig, "GET", "/events", None).json()["items"]
    assert any(e["action"] == "vrnic.moved" and e["subject"] == f"vrnic/{scene.vm_id}" for e in moved)
    for base in (8192, 16384):
        assert scene.dest.read_gpa(scene.g_mr.addr + base + 8, 32) == b"".join(
            struct.pack("<Q", s) for s in range(1, 5))
    resume_on(scene.guest, scene.dest)
    for seq, host in ((5, "a"), (6, "b")):  # a's peer found the VM on host-b through the database
        scene.write(host, seq)
        assert [c.status for c in scene.p_cq[host].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", scene.g_mr.read(8, 8192 + 40))[0] == 5
    assert struct.unpack("<Q", scene.g_mr.read(8, 16384 + 48))[0] == 6


def test_a_cancelled_move_is_aborted_through_the_api_and_the_vm_stays(cluster: tuple[Cluster, FakeEdge],
                                                                      scene: Scene) -> None:
    rig, edge = cluster
    live = set(edge.live)
    assert api(rig, "POST", "/vms/vm1/handover", {"host": "host-a", "binding": scene.target().model_dump()}
               ).status_code == 400  # this host: the same-host migration is another call
    shutil.copyfile(scene.source.ram, scene.dest.ram)
    assert api(rig, "POST", "/vms/vm1/handover", {"host": "host-b", "binding": scene.target().model_dump()}
               ).status_code == 200
    scene.dest.accept()
    aborted = api(rig, "DELETE", "/vms/vm1/handover")
    assert aborted.status_code == 200 and aborted.json() == {"domain": "vm1", "aborted": True}
    assert edge.live == live
    assert api(rig, "GET", f"/vrnics/{scene.vm_id}").json()["host"] == "host-a"
    assert api(rig, "POST", "/vms/vm1/handover/switchover").status_code == 409
    scene.write("b", 1)
    assert [c.status for c in scene.p_cq["b"].wait(1)] == [WcStatus.SUCCESS]


def _qemu_on_a_ends(scene: Scene) -> None:
    """libvirt's Confirm ends the source QEMU: its end of the vRNIC channel closes."""
    assert scene.source.port is not None
    scene.source.port.close()


def test_the_libvirt_flow_the_source_hooks_stopped_hands_the_vrnic_over(cluster: tuple[Cluster, FakeEdge],
                                                                        scene: Scene) -> None:
    """`virsh migrate --live --suspend`: the source QEMU ends before the switchover, and the hook's DELETE
    .../binding at stopped hands the vRNIC over instead of releasing it (vrnic.vm.hook)."""
    rig, edge = cluster
    shutil.copyfile(scene.source.ram, scene.dest.ram)
    assert api(rig, "POST", "/vms/vm1/handover", {"host": "host-b", "binding": scene.target().model_dump()}
               ).status_code == 200
    scene.dest.accept()
    for seq in range(1, 3):
        scene.write("a", seq)
    assert [c.status for c in scene.p_cq["a"].wait(2)] == [WcStatus.SUCCESS] * 2
    before = scene.source_objects()
    _qemu_on_a_ends(scene)
    time.sleep(0.5)  # the link saw the channel close
    assert before <= edge.live  # the session waits for its hand-over
    stopped = api(rig, "DELETE", "/vms/vm1/binding")
    assert stopped.status_code == 200 and stopped.json()["unbound"] == [scene.vm_id], stopped.text
    assert not before & edge.live
    assert api(rig, "GET", f"/vrnics/{scene.vm_id}").json()["host"] == "host-b"
    assert api(rig, "GET", "/vms").json()["items"] == []
    for base in (8192,):
        assert scene.dest.read_gpa(scene.g_mr.addr + base + 8, 16) == b"".join(struct.pack("<Q", s) for s in (1, 2))
    resume_on(scene.guest, scene.dest)
    scene.write("a", 3)
    assert [c.status for c in scene.p_cq["a"].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", scene.g_mr.read(8, 8192 + 24))[0] == 3


def test_a_hand_over_called_off_after_the_source_qemu_ended_releases_it(cluster: tuple[Cluster, FakeEdge],
                                                                        scene: Scene) -> None:
    rig, edge = cluster
    shutil.copyfile(scene.source.ram, scene.dest.ram)
    assert api(rig, "POST", "/vms/vm1/handover", {"host": "host-b", "binding": scene.target().model_dump()}
               ).status_code == 200
    scene.dest.accept()
    before = scene.source_objects()
    _qemu_on_a_ends(scene)
    time.sleep(0.5)
    assert before <= edge.live
    assert api(rig, "DELETE", "/vms/vm1/handover").json()["aborted"] is True
    assert not before & edge.live  # nobody runs the VM on a any more: its session's objects went
    assert api(rig, "GET", f"/vrnics/{scene.vm_id}").json()["host"] == "host-a"
    assert api(rig, "DELETE", "/vms/vm1/binding").json()["unbound"] == [scene.vm_id]
