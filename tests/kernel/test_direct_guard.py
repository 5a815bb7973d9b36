"""The packet guard, programmed by vrnicd at connect time, stops a direct guest that re-points its own QP.

A direct guest holds its ucontext's fd, so it can MODIFY_QP its QP to any destination. Here it aims at
another tenant's QP and writes with that tenant's rkey and next PSN (the attacker's perfect guess). Without the
guard the write lands (the control case: the kernel's PD check is satisfied, the rkey is the target QP's own);
with it the packets never leave and the target's memory is untouched. Runs on the lab's pair
topology, where rxe0 and rxe1 sit on the two ends of a veth, so the traffic crosses the netfilter hooks.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.flow_guard import FlowGuard
from vrnic.backend.packet_guard import PacketGuard
from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.rnic_edge import RtrParams, RtsParams
from vrnic.backend.uverbs_edge import DirectContext, UverbsFile
from vrnic.core.specs import AttachInfo, DataEngine, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict
from vrnic.frontend import QP, SendRequest, WcStatus, WrOpcode
from vrnic.frontend.direct import PhysKey

from .conftest import wait_for_baseline
from .guest_objects import ALL, Guest

pytestmark = pytest.mark.kernel
TABLE = "vrnic_guard_test"


def _nft_ready() -> None:
    if shutil.which("nft") is None:
        pytest.skip("nft is not installed (make setup installs nftables)")
    probe = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"nftables unusable here: {probe.stderr.strip()}")


@pytest.fixture(params=[False, True], ids=["unguarded", "guarded"])
def guarded_driver(request: pytest.FixtureRequest, device_pair: tuple[str, str], tmp_path: Path) -> Iterator[Any]:
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    if request.param:
        _nft_ready()
    baseline = resource_counts()
    guard = FlowGuard(PacketGuard(table=TABLE)) if request.param else False
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock", direct_containment="best-effort", packet_guard=guard)
    yield drv
    drv.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"
    if request.param:
        assert not PacketGuard(table=TABLE).installed(), "the guard table outlived vrnicd"


_serial = iter(range(5000, 6000))


def _vrnic(driver: Any, device: str, tenant: str, engine: str = "direct") -> AttachInfo:
    serial = next(_serial)
    spec = VrnicSpec(id=f"g{serial}", tenant=tenant, vpc_id=1, quota=Quota(), engine=DataEngine(engine),
                     virtual_gid=make_virtual_gid(1, serial))
    return driver.create_vrnic(spec, device)  # type: ignore[no-any-return]


def _session(driver: Any, guest: Guest) -> Any:
    return driver.registry.get(guest.ctx.vrnic_id).session


def _repoint(driver: Any, attacker: Guest, qp: QP, victim: Guest, victim_qp: QP) -> None:
    """What a hostile direct guest can do with its fd: RESET -> INIT -> RTR/RTS towards a QP of its choosing."""
    assert attacker.ctx.direct is not None
    own = _session(driver, attacker)
    raw_qp = own.state.qps.get(qp.handle).obj
    target = _session(driver, victim)
    file = UverbsFile.__new__(UverbsFile)  # the guest's copy of the fd, driven with raw commands
    file.fd, file.async_fd, file.device = attacker.ctx.direct.fd, -1, own.vrnic.device
    raw = DirectContext.__new__(DirectContext)
    raw.file = file
    raw.qp_to_state(raw_qp, "reset")
    raw.qp_to_init(raw_qp, "rc", int(ALL), 0)
    raw.qp_to_rtr(raw_qp, "rc", RtrParams(dgid=target.vrnic.phys_gid, sgid_index=own.vrnic.gid_index, path_mtu=1024,
                                          dest_qpn=target.state.qps.get(victim_qp.handle).phys_qpn))
    raw.qp_to_rts(raw_qp, "rc", RtsParams(timeout=10, retry_cnt=1, rnr_retry=1))


def test_a_direct_guest_repointing_its_qp_at_another_tenant_is_stopped_by_the_guard(
        guarded_driver: Any, device_pair: tuple[str, str]) -> None:
    guarded = guarded_driver.guard is not None
    alice = Guest(_vrnic(guarded_driver, device_pair[0], "alice"))
    bob = Guest(_vrnic(guarded_driver, device_pair[1], "alice"))
    mallory_victim = Guest(_vrnic(guarded_driver, device_pair[1], "victim", engine="ring"))
    try:
        # The honest connection works, guard or not.
        qa, qb = alice.qp(), bob.qp()
        qa.connect(bob.ctx.gid, qb.qpn)
        qb.connect(alice.ctx.gid, qa.qpn)
        qa.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (alice.mr.sge(0, 64),), remote_addr=bob.mr.addr,
                                 rkey=bob.mr.rkey))
        assert alice.cq.wait(1)[0].status == WcStatus.SUCCESS
        if guarded:
            flows = PacketGuard(table=TABLE).flows()
            assert {f.vrnic_id for f in flows} == {alice.ctx.vrnic_id, bob.ctx.vrnic_id}  # one flow per RC QP

        # The victim's QP is connected, by vrnicd, to a QP of its own tenant: it is live and accepts writes.
        vq = mallory_victim.qp()
        other = Guest(_vrnic(guarded_driver, device_pair[0], "victim", engine="ring"))
        try:
            oq = other.qp()
            vq.connect(other.ctx.gid, oq.qpn)
            oq.connect(mallory_victim.ctx.gid, vq.qpn)
            victim = _session(guarded_driver, mallory_victim).state.mr_by_vkey[mallory_victim.mr.lkey]
            mallory_victim.mr.write(b"V" * 64)

            # Alice's guest re-points its QP at the victim's and writes with the victim's physical rkey.
            _repoint(guarded_driver, alice, qa, mallory_victim, vq)
            assert alice.ctx.direct is not None
            alice.ctx.direct.remote[(qa.handle, 0xBAD)] = PhysKey(victim.phys_rkey, victim.base)
            alice.mr.write(b"A" * 64)
            qa.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (alice.mr.sge(0, 64),),
                                     remote_addr=mallory_victim.mr.addr, rkey=0xBAD))
            # Either way the attacker sees retry exceeded (IBV_WC_RETRY_EXC_ERR): the victim's QP acknowledges
            # to its real peer, never to the attacker. What differs is whether the bytes landed.
            assert alice.cq.wait(1, timeout=30)[0].status == 12
            if guarded:  # no packet got out
                assert mallory_victim.mr.read(64) == b"V" * 64
            else:  # the control case: nothing else stops it
                assert mallory_victim.mr.read(64) == b"A" * 64
        finally:
            other.close()
    finally:
        for g in (alice, bob, mallory_victim):
            g.close()
    if guarded:
        assert PacketGuard(table=TABLE).flows() == []  # every flow went with its QP


def test_strict_isolation_refuses_the_direct_engine_on_rxe(device_pair: tuple[str, str], tmp_path: Path) -> None:
    """rxe loops traffic between its own QPs back past the guard: strict isolation says no to direct there."""
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    _nft_ready()
    drv = VerbsDriver(socket_path=tmp_path / "strict.sock", packet_guard=FlowGuard(PacketGuard(table=TABLE)),
                      strict_isolation=True)
    try:
        assert drv.edge.describe(device_pair[0]).caps["direct_guard_loopback_gap"] == 1
        with pytest.raises(Conflict, match="loops traffic between its own QPs"):
            _vrnic(drv, device_pair[0], "alice")
        _vrnic(drv, device_pair[0], "alice", engine="ring")  # the ring engine is fine
    finally:
        drv.close()
    assert not PacketGuard(table=TABLE).installed()
