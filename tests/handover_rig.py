"""A VM with one vRNIC on host a, its guest program, and a peer guest on each of hosts a and b: the scene of the
cross-host hand-over tests (tests/unit/test_backend_vm_handover.py in-process, tests/api/test_vm_handover_agents.py
over the agents' HTTP routes). QEMU is played by tests/unit/fake_qemu.py."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable

from tests.peering_fakes import MemoryLocator
from tests.unit.fake_qemu import Vm
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.peer_directory import AgentRef
from vrnic.backend.vm_handover import HandoverDestination, PeerHost
from vrnic.core.rings import Access, SendRequest, WrOpcode
from vrnic.core.specs import AttachInfo, VmBinding
from vrnic.frontend import CQ, MR, PD, QP, Context

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class Scene:
    """VM vm1 on host a with one vRNIC, its guest program, and a peer guest on each host, each connected to
    one of the VM's QPs (QP 0 <-> the peer on a, QP 1 <-> the peer on b)."""

    def __init__(self, drivers: dict[str, VerbsDriver], make: Callable[[str], AttachInfo], locator: MemoryLocator,
                 edge: FakeEdge, make_vm: Callable[[str], Vm], destination: HandoverDestination,
                 peer_host_of: Callable[[AgentRef], PeerHost], b_agent: AgentRef) -> None:
        self.drivers, self.locator, self.edge, self.b_agent = drivers, locator, edge, b_agent
        self.vm_info = make("a")
        self.source, self.dest = make_vm("vm1"), make_vm("vm1-on-b")
        a, b = drivers["a"], drivers["b"]
        a.bind_vm(self.source.binding(self.vm_info.vrnic_id))
        self.source.accept()
        self.guest = self.source.guest()
        self.peers = {host: Context.attach(make(host)) for host in ("a", "b")}
        self.g_pd = PD(self.guest)
        self.g_cq = CQ(self.guest, 64)
        self.g_mr = MR(self.g_pd, 64 << 10, RW)
        self.g_qps = [QP(self.g_pd, self.g_cq, self.g_cq, max_send_wr=16, max_recv_wr=16) for _ in range(2)]
        self.p_cq, self.p_mr, self.p_qps = {}, {}, {}
        for i, host in enumerate(("a", "b")):
            peer = self.peers[host]
            pd = PD(peer)
            self.p_cq[host] = CQ(peer, 64)
            self.p_mr[host] = MR(pd, 64 << 10, RW)
            self.p_qps[host] = QP(pd, self.p_cq[host], self.p_cq[host], max_send_wr=16, max_recv_wr=16)
            self.g_qps[i].connect(peer.gid, self.p_qps[host].qpn)
            self.p_qps[host].connect(self.guest.gid, self.g_qps[i].qpn)
        self.a, self.b = a, b
        self.destination = destination
        self.peer_host_of = peer_host_of

    @property
    def vm_id(self) -> str:
        return self.vm_info.vrnic_id

    def target(self) -> VmBinding:
        return self.dest.binding(self.vm_id).model_copy(update={"domain": "vm1"})

    def prepare(self, destination: HandoverDestination | None = None) -> dict[str, object]:
        shutil.copyfile(self.source.ram, self.dest.ram)  # QEMU's pre-copy
        prepared = self.a.prepare_vm_handover("vm1", self.target(), destination or self.destination,
                                              self.peer_host_of)
        if destination is None:
            self.dest.accept()
        return prepared

    def record_move(self) -> None:
        """What the control plane does: the vRNIC's row names host b now."""
        self.locator.place(self.b_agent, self.vm_info.virtual_gid, self.edge.gids["fake1"], 1)

    def write(self, host: str, seq: int) -> None:
        """An 8-byte sequence number RDMA-written into the VM's MR at slot seq (and staged at the same offset)."""
        mr = self.p_mr[host]
        base = 8192 if host == "a" else 16384
        mr.write(struct.pack("<Q", seq), base + seq * 8)
        self.p_qps[host].post_send(SendRequest(seq, WrOpcode.RDMA_WRITE, (mr.sge(base + seq * 8, 8),),
                                               remote_addr=self.g_mr.addr + base + seq * 8, rkey=self.g_mr.rkey))

    def source_objects(self) -> set[int]:
        session = self.a.registry.get(self.vm_id).session
        state = session.state  # type: ignore[union-attr]
        tables = (state.pds, state.cqs, state.mrs, state.qps)
        return {id(entry.obj) for table in tables for _, entry in table.items()}

    def close(self) -> None:
        self.guest.close()
        for peer in self.peers.values():
            peer.close()
