"""A VM's vRNIC handed from host a's vrnicd to host b's (vrnic.backend.vm_handover), on the in-memory fabric.

Two real verbs drivers (a on fake0, b on fake1) share one locator and reach each other through a loopback
directory, as tests/unit/test_backend_peering.py sets them up. The source drives the destination and the peer
hosts through their JSON forms (vrnic.core.handover), in-process: what the agents' routes would carry. QEMU is
played as in tests/unit/test_backend_vm_migration.py: two RAM files and two channel sockets; the peers' RDMA
WRITEs during the migration land in the source RAM only, so the destination has them only if the hand-over
copied them. The peers are ordinary guests, one on each host: a's becomes remote, b's becomes local.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.handover_rig import Scene
from tests.unit.fake_qemu import Vm, vm_factory
from tests.unit.test_backend_peering import Hosts
from tests.unit.test_backend_vm_migration import resume_on
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.peer_directory import AgentRef
from vrnic.backend.peer_service import PeerService
from vrnic.core.handover import (
    Arrival,
    HandoverPhase,
    PeerQpStatus,
    QpCarry,
    advance,
    batches,
    drained,
    merge_ranges,
    pages_from_wire,
    pages_to_wire,
    recv_from_wire,
    recv_to_wire,
    send_from_wire,
    send_to_wire,
)
from vrnic.core.peering import Identity
from vrnic.core.rings import Access, RecvRequest, SendRequest, Sge, WcOpcode, WcStatus, WrOpcode
from vrnic.core.session_state import SessionSnapshot
from vrnic.core.specs import VmBinding, VrnicSpec
from vrnic.core.translate import MrWindow
from vrnic.errors import Conflict, InvalidArgument, Unavailable
from vrnic.frontend.guest_library import QP_POOL

pytestmark = pytest.mark.unit


def _wire(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _wire_keys(wanted: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]]:
    """A dict with int keys and (str, int) values, through JSON (keys become strings, tuples lists)."""
    return {int(k): (str(v[0]), int(v[1])) for k, v in _wire({str(k): v for k, v in wanted.items()}).items()}


class WireDestination:
    """The destination's driver behind its JSON forms (what /agent/v1 would carry), in-process."""

    def __init__(self, driver: VerbsDriver) -> None:
        self.driver = driver
        self.pages_sent = 0

    def accept(self, domain: str, specs: list[VrnicSpec], binding: VmBinding,
               snapshots: dict[str, SessionSnapshot]) -> dict[str, Any]:
        specs = [VrnicSpec.model_validate(_wire(s.model_dump(mode="json"))) for s in specs]
        binding = VmBinding.model_validate(_wire(binding.model_dump(mode="json")))
        snaps = {k: SessionSnapshot.from_dict(_wire(v.to_dict())) for k, v in snapshots.items()}
        return self.driver.accept_handover(domain, specs, binding, snaps)

    def preconnect(self, domain: str, vrnic_id: str, wires: list[dict[str, Any]]) -> int:
        return self.driver.handover_preconnect(domain, vrnic_id, _wire(wires))

    def pages(self, domain: str, runs: list[tuple[int, bytes]]) -> None:
        self.pages_sent += len(runs)
        self.driver.handover_pages(domain, pages_from_wire(_wire(pages_to_wire(runs))))

    def take_over(self, domain: str, snapshots: dict[str, SessionSnapshot], carried: dict[str, list[QpCarry]],
                  live_peers: dict[str, list[int]]) -> dict[str, Any]:
        snaps = {k: SessionSnapshot.from_dict(_wire(v.to_dict())) for k, v in snapshots.items()}
        qps = {k: [QpCarry.from_dict(_wire(c.to_dict())) for c in v] for k, v in carried.items()}
        answer: dict[str, Any] = _wire(self.driver.handover_take_over(domain, snaps, qps, _wire(live_peers)))
        return {**answer, "agent": {"host": "b", "url": "http://b.invalid"}}

    def release(self, domain: str) -> None:
        self.driver.handover_release(domain)

    def abort(self, domain: str) -> None:
        self.driver.handover_abort(domain)


class WirePeerHost:
    """Another host's PeerService behind its JSON forms."""

    def __init__(self, service: PeerService) -> None:
        self.service = service

    def track(self, vrnic_id: str) -> None:
        self.service.track(vrnic_id)

    def shadows(self, vrnic_id: str, wanted: dict[int, tuple[str, int]]) -> dict[int, dict[str, Any]]:
        made = _wire({str(k): v for k, v in self.service.shadows(vrnic_id, _wire_keys(wanted)).items()})
        return {int(k): v for k, v in made.items()}

    def hold(self, vrnic_id: str) -> list[PeerQpStatus]:
        return [PeerQpStatus.from_dict(_wire(s.to_dict())) for s in self.service.hold(vrnic_id)]

    def status(self, vrnic_id: str) -> tuple[list[PeerQpStatus], list[tuple[int, int]]]:
        statuses, ranges = self.service.status(vrnic_id)
        return [PeerQpStatus.from_dict(_wire(s.to_dict())) for s in statuses], [tuple(r) for r in _wire(ranges)]

    def moved(self, vrnic_id: str, virtual_gid: str, arrival: Arrival | None = None) -> int:
        return self.service.moved(vrnic_id, virtual_gid,
                                  None if arrival is None else Arrival.from_dict(_wire(arrival.to_dict())))

    def release(self, vrnic_id: str) -> None:
        self.service.release(vrnic_id)


class Down:
    """A destination host whose vrnicd does not answer."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*_: Any, **__: Any) -> Any:
            raise Unavailable("the agent of host b cannot be reached")
        return call


@pytest.fixture
def hosts(edge: FakeEdge, tmp_path: Path) -> Iterator[Hosts]:
    pair = Hosts(edge, tmp_path)
    yield pair
    pair.close()
    assert not edge.live, "objects left on the fake NIC"


@pytest.fixture
def make_vm(tmp_path: Path) -> Iterator[Callable[[str], Vm]]:
    yield from vm_factory(tmp_path)


@pytest.fixture
def scene(hosts: Hosts, make_vm: Callable[[str], Vm]) -> Iterator[Scene]:
    made = Scene(hosts.drivers, hosts.make, hosts.locator, hosts.edge, make_vm, WireDestination(hosts.drivers["b"]),
                 lambda agent: WirePeerHost(hosts.drivers[agent.host].peers), AgentRef("b", "http://b.invalid"))
    yield made
    made.close()


def test_a_vm_moves_to_another_host_under_traffic_and_keeps_every_write(scene: Scene, edge: FakeEdge) -> None:
    g_qps, g_mr, g_cq = scene.g_qps, scene.g_mr, scene.g_cq
    handles_before = [(q.handle, q.qpn) for q in g_qps]
    g_qps[0].post_recv([RecvRequest(100 + i, (g_mr.sge(i * 1024, 1024),)) for i in range(4)])
    g_qps[1].post_recv([RecvRequest(200 + i, (g_mr.sge(4096 + i * 512, 512),)) for i in range(4)])
    prepared = scene.prepare()
    assert prepared["moving"] == [scene.vm_id] and prepared["peer_hosts"] == 2
    assert prepared["presetup_mrs"] == 1 + scene.guest.spare_mr_count  # the guest's MR and its pool's spares
    assert scene.vm_id not in scene.b.registry.ids()  # peers on b still find it on a until the take-over
    # during the migration: both peers write sequence numbers into the VM and send to it
    for seq in range(1, 9):
        scene.write("a", seq)
        scene.write("b", seq)
    for host in ("a", "b"):
        mr = scene.p_mr[host]
        mr.write(struct.pack("<Q", 1000 if host == "a" else 2000), 0)
        scene.p_qps[host].post_send(SendRequest(77, WrOpcode.SEND, (mr.sge(0, 8),)))
    for host in ("a", "b"):
        assert [c.status for c in scene.p_cq[host].wait(9)] == [WcStatus.SUCCESS] * 9
    assert scene.source.read_gpa(g_mr.addr + 16384 + 8, 8) == struct.pack("<Q", 1)
    assert scene.dest.read_gpa(g_mr.addr + 16384 + 8, 8) == bytes(8)  # QEMU did not see the NIC's writes
    before = scene.source_objects()
    assert before <= edge.live
    asked = scene.a.registry.directory.calls  # type: ignore[union-attr]
    asked_before = len(asked)
    report = scene.a.complete_vm_handover("vm1", scene.record_move)
    # nobody asked the directory during the blackout: b knew from a which peers live, a's peer re-pointed from
    # what b published at take-over (its QPs and MR windows)
    assert asked[asked_before:] == []
    spares = scene.guest.spare_qp_count  # the guest's pool of new QPs moves too
    assert spares == QP_POOL - 2
    assert report["qps"] == 2 + spares and report["peers_repointed"] == 2 and report["peer_hosts"] == 2, report
    assert report["mrs_presetup"] == 1 + scene.guest.spare_mr_count and report["mrs_registered"] == 0, report
    assert report["recvs_reposted"] == 6 and report["broken_qps"] == 0, report  # 3 unused receives on each QP
    assert report["dirty_pages"] >= 2, report
    assert isinstance(scene.destination, WireDestination) and scene.destination.pages_sent >= 1
    # the source is back to its baseline: none of the VM's kernel objects, no vRNIC, no VM
    assert not before & edge.live
    assert scene.vm_id not in scene.a.registry.ids() and "vm1" not in scene.a.vm_bindings()
    assert scene.b.vm_bindings()["vm1"].ram_path == str(scene.dest.ram)
    # every completed write is in the destination's RAM, exactly once in its slot
    for base in (8192, 16384):
        assert scene.dest.read_gpa(g_mr.addr + base + 8, 64) == b"".join(struct.pack("<Q", s) for s in range(1, 9))
    resume_on(scene.guest, scene.dest)
    # the guest program carries on unchanged: same handles and QPNs, its receives completed, its data there
    assert [(q.handle, q.qpn) for q in g_qps] == handles_before
    done = sorted((c.wr_id, c.status, c.opcode) for c in g_cq.wait(2))
    assert done == [(100, WcStatus.SUCCESS, WcOpcode.RECV), (200, WcStatus.SUCCESS, WcOpcode.RECV)]
    assert struct.unpack("<Q", g_mr.read(8, 0))[0] == 1000 and struct.unpack("<Q", g_mr.read(8, 4096))[0] == 2000
    # after the move, both ways, with both peers: a's is now remote, b's now local
    for seq, host in ((9, "a"), (10, "b")):
        scene.write(host, seq)
        assert [c.status for c in scene.p_cq[host].wait(1)] == [WcStatus.SUCCESS]
    assert asked[asked_before:] == []  # a's peer wrote with the windows b published, not fetched ones
    assert struct.unpack("<Q", g_mr.read(8, 8192 + 9 * 8))[0] == 9
    assert struct.unpack("<Q", g_mr.read(8, 16384 + 10 * 8))[0] == 10
    for i, host in enumerate(("a", "b")):
        scene.p_qps[host].post_recv(RecvRequest(5, (scene.p_mr[host].sge(30000, 64),)))
        g_mr.write(f"from b, qp {i}".encode(), 40000)
        g_qps[i].post_send(SendRequest(50 + i, WrOpcode.SEND, (g_mr.sge(40000, 12),)))
        assert [(c.wr_id, c.status) for c in g_cq.wait(1)] == [(50 + i, WcStatus.SUCCESS)]
        assert scene.p_cq[host].wait(1)[0].byte_len == 12
        assert scene.p_mr[host].read(12, 30000) == f"from b, qp {i}".encode()
    for host in ("a", "b"):  # and the peers send into receives the guest had posted before the move
        scene.p_mr[host].write(b"late", 100)
        scene.p_qps[host].post_send(SendRequest(6, WrOpcode.SEND, (scene.p_mr[host].sge(100, 4),)))
        assert [c.status for c in scene.p_cq[host].wait(1)] == [WcStatus.SUCCESS]
    assert sorted(c.wr_id for c in g_cq.wait(2)) == [101, 201]


def test_no_vrnicd_at_the_destination_leaves_the_vm_served_on_the_source(scene: Scene) -> None:
    with pytest.raises(Unavailable):
        scene.prepare(destination=Down())
    assert scene.a.registry.dirty_log(scene.vm_id) is None  # nothing logging any more, on any host
    assert scene.b.registry.dirty_log(scene.vm_id) is None
    with pytest.raises(Conflict, match="no hand-over prepared"):
        scene.a.complete_vm_handover("vm1", scene.record_move)
    scene.write("b", 1)
    assert [c.status for c in scene.p_cq["b"].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", scene.g_mr.read(8, 16384 + 8))[0] == 1


def test_a_handover_called_off_midway_leaves_nothing_on_the_destination(scene: Scene, edge: FakeEdge) -> None:
    live = set(edge.live)
    scene.prepare()
    assert edge.live > live  # b's pre-setup
    with pytest.raises(Conflict, match="already migrating"):
        scene.a.prepare_vm_handover("vm1", scene.target(), scene.destination, scene.peer_host_of)
    assert scene.a.abort_vm_handover("vm1") is True
    assert scene.a.abort_vm_handover("vm1") is False
    assert edge.live == live  # the destination's pre-setup is gone, the source's objects stay
    assert scene.vm_id not in scene.b.registry.ids() and "vm1" not in scene.b.vm_bindings()
    assert scene.b.registry.dirty_log(scene.vm_id) is None
    for seq, host in ((1, "a"), (2, "b")):
        scene.write(host, seq)
        assert [c.status for c in scene.p_cq[host].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", scene.g_mr.read(8, 16384 + 16))[0] == 2


def test_a_peer_that_died_during_the_handover_breaks_only_its_qp(scene: Scene) -> None:
    scene.prepare()
    scene.peers["b"].close()  # its guest program is gone: its vRNIC's session and QPs go
    report = scene.a.complete_vm_handover("vm1", scene.record_move)
    assert report["broken_qps"] == 1 and report["qps"] == 2 + QP_POOL - 2, report  # with the guest's spares
    resume_on(scene.guest, scene.dest)
    assert scene.guest.call("query_qp", qp=scene.g_qps[1].handle)["state"] == "err"
    scene.write("a", 3)
    assert [c.status for c in scene.p_cq["a"].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", scene.g_mr.read(8, 8192 + 24))[0] == 3


def test_a_control_plane_that_cannot_record_the_move_calls_the_handover_off(scene: Scene, edge: FakeEdge) -> None:
    live = set(edge.live)
    scene.prepare()

    def database_down() -> None:
        raise Unavailable("the database is unreachable")

    with pytest.raises(Unavailable):
        scene.a.complete_vm_handover("vm1", database_down)
    assert edge.live == live and scene.vm_id not in scene.b.registry.ids()  # the destination took nothing
    for seq, host in ((1, "a"), (2, "b")):  # the peers were let go towards the source, which serves on
        scene.write(host, seq)
        assert [c.status for c in scene.p_cq[host].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", scene.g_mr.read(8, 16384 + 16))[0] == 2
    scene.prepare()  # and it can be tried again
    assert scene.a.complete_vm_handover("vm1", scene.record_move)["peers_repointed"] == 2


# ----- the pure parts (vrnic.core.handover) ----------------------------------------------------------------

def test_phases_only_move_forward_and_not_back_past_the_handover() -> None:
    assert advance(HandoverPhase.PREPARED, HandoverPhase.SWITCHING) is HandoverPhase.SWITCHING
    assert advance(HandoverPhase.SWITCHING, HandoverPhase.ABORTED) is HandoverPhase.ABORTED
    with pytest.raises(Conflict):
        advance(HandoverPhase.HANDED_OVER, HandoverPhase.ABORTED)
    with pytest.raises(Conflict):
        advance(HandoverPhase.DONE, HandoverPhase.SWITCHING)


def test_work_requests_and_pages_survive_their_json_form() -> None:
    send = SendRequest(7, WrOpcode.RDMA_WRITE_WITH_IMM, (Sge(4096, 64, 0x1234), Sge(8192, 8, 0x99)), signaled=False,
                       imm=5, remote_addr=1 << 40, rkey=0xABCD, ud_gid=bytes(range(16)), ud_qpn=3, ud_qkey=9)
    assert send_from_wire(_wire(send_to_wire(send))) == send
    recv = RecvRequest(9, (Sge(0, 4096, 1),))
    assert recv_from_wire(_wire(recv_to_wire(recv))) == recv
    carry = QpCarry(3, "rts", "rc", 7, 0, "fd00::1", 12, {"path_mtu": 1024}, [recv], [send])
    assert QpCarry.from_dict(_wire(carry.to_dict())) == carry
    runs = [(0x200000, b"\x00\x01" * 2048), (0x300000, b"z")]
    assert pages_from_wire(_wire(pages_to_wire(runs))) == runs
    with pytest.raises(InvalidArgument):
        send_from_wire({"wr_id": 1})
    with pytest.raises(InvalidArgument):
        pages_from_wire([{"address": 1, "data": "not base64!"}])
    with pytest.raises(InvalidArgument):
        QpCarry.from_dict({"handle": "x"})


def test_an_arrival_survives_its_json_form_and_a_bad_one_is_refused() -> None:
    arrival = Arrival(Identity("v1", "t1", 1, "fd00::1"), "b", "http://10.77.0.2:8470", "fe80::2", {5: 0x1234},
                      (MrWindow(3, 4096, 8192, Access.REMOTE_WRITE | Access.LOCAL_WRITE, 0, 0x77, 1 << 30),))
    assert Arrival.from_dict(_wire(arrival.to_dict())) == arrival
    good = arrival.to_dict()
    for bad in ({"qpns": {"5": 1 << 24}}, {"agent_url": "file:///etc/passwd"}, {"phys_gid": "not a gid"},
                {"windows": [{"vkey": 1}]}, {"extra": 1}):
        with pytest.raises(InvalidArgument, match="not an arrival record"):
            Arrival.from_dict({**good, **bad})


def test_ranges_are_merged_across_hosts_and_cut_into_batches() -> None:
    assert merge_ranges([(0, 4096), (8192, 4096)], [(4096, 4096), (100000, 0)], [(20000, 10)]) == [
        (0, 12288), (20000, 10)]
    assert batches([(0, 10), (100, 25)], limit=16) == [[(0, 10), (100, 6)], [(106, 16)], [(122, 3)]]
    assert batches([]) == []
    with pytest.raises(InvalidArgument):
        batches([(0, 1)], limit=0)


def test_drained_waits_for_sends_except_those_that_wait_for_a_receive_nobody_can_post() -> None:
    peer = PeerQpStatus(vm_vqpn=5, sends=1, head_needs_recv=True, recvs=0)
    assert drained([peer], vm_recvs={5: 0}, vm_sends={5: (0, False)})  # RNR: the VM posts nothing while stopped
    assert not drained([peer], vm_recvs={5: 1}, vm_sends={5: (0, False)})  # it has a receive: it will complete
    write = PeerQpStatus(vm_vqpn=5, sends=1, head_needs_recv=False, recvs=0)
    assert not drained([write], vm_recvs={5: 0}, vm_sends={})
    idle = PeerQpStatus(vm_vqpn=5, sends=0, head_needs_recv=False, recvs=0)
    assert drained([idle], vm_recvs={5: 0}, vm_sends={5: (1, True)})  # the VM's SEND waits for the peer's receive
    assert not drained([PeerQpStatus(5, 0, False, 2)], vm_recvs={}, vm_sends={5: (1, True)})
    assert not drained([], vm_recvs={}, vm_sends={6: (1, False)})  # towards nobody held: wait for the NIC
