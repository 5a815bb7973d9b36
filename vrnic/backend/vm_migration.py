"""Live migration of a bound VM's vRNICs between two QEMU processes served by this vrnicd.

The three steps, driven by whoever drives QEMU's migration (vrnic.vm.live_migration):

- prepare, before QEMU starts copying: map the destination's RAM, connect its channels, start the dirty
  log (vrnic.core.migration), and pre-set-up a staged session per vRNIC: its PDs and MRs registered over
  the destination RAM (MigrRDMA's pre-setup; registering is the slow verb).
- switchover, after QEMU's last pass and before the destination's vCPUs run (wait-before-stop): hold the
  VM's QPs and every peer QP connected to them, wait until no send is on the NIC, move the last
  completions into the guest's CQ rings, copy the pages the NIC and vrnicd wrote (the dirty log and every
  ring) from the source RAM to the destination's, create the CQs and QPs with the same handles and virtual
  QPNs, publish them in one step, reset and reconnect each peer QP to its new physical QP, post the
  receives again on both sides, and let everything go. The source's kernel objects are then destroyed.
- abort, when QEMU's migration failed or was cancelled: the staged session goes, the source never stopped.

The guest's identities (handles, virtual QPNs, keys, GID) do not change; its rings move with its RAM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vrnic.backend.engine import SharedRingEngine
from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.registry import Registry, VirtualRnic
from vrnic.backend.session import GuestSession
from vrnic.backend.vm_link import VmLink
from vrnic.core.migration import DirtyLog, MigrationPhase, SwitchoverReport, advance
from vrnic.core.rings import CQ_SLOT, RQ_SLOT, SQ_SLOT, Ring, WrOpcode
from vrnic.core.session_state import QpEntry
from vrnic.errors import Conflict, InvalidArgument, NotFound

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 5.0
CONSUMES_RECV = frozenset({WrOpcode.SEND, WrOpcode.SEND_WITH_IMM, WrOpcode.RDMA_WRITE_WITH_IMM})


@dataclass
class Preconnected:
    """One of the VM's QPs and its peer's, connected ahead of the switchover on new physical QPs."""

    handle: int  # the VM's QP, in both sessions
    staged_qp: QpEntry
    peer_id: str
    peer: GuestSession
    peer_qp: QpEntry
    peer_gid: str  # the VM's QP's peer, by virtual identity, as it was at prepare
    peer_vqpn: int
    shadow: Any  # the peer's second physical QP
    shadow_qpn: int


@dataclass
class MovingVrnic:
    """One vRNIC of the migrating VM whose guest program is attached (others only change channel)."""

    vrnic: VirtualRnic
    source: GuestSession
    staged: GuestSession
    dirty: DirtyLog
    pairs: list[Preconnected] = field(default_factory=list)
    peers: list[tuple[GuestSession, list[QpEntry]]] = field(default_factory=list)  # filled at the switchover


@dataclass
class Migration:
    domain: str
    memory: GuestMemory  # the destination's RAM
    links: list[VmLink]  # connected to the destination's channels, serving nothing until the switchover
    moving: list[MovingVrnic]
    phase: MigrationPhase = MigrationPhase.PREPARED
    presetup_mrs: int = 0
    prepare_ms: float = 0.0


def stage(vrnic: VirtualRnic, source: GuestSession, make_session: Callable[[], GuestSession],
          registry: Registry) -> MovingVrnic:
    """Start logging what the NIC writes into the VM, and pre-set-up the destination's session."""
    if not isinstance(source.engine, SharedRingEngine):
        raise Conflict(f"vRNIC {vrnic.spec.id} does not use the shared-ring engine; it cannot migrate")
    for other in registry.connected_to(vrnic.spec.id):
        peer = other.session
        if isinstance(peer, GuestSession) and peer.qps_connected_to(vrnic.spec.id) \
                and not isinstance(peer.engine, SharedRingEngine):
            raise Conflict(f"vRNIC {other.spec.id} is connected to {vrnic.spec.id} and uses the direct engine, "
                           f"whose sends vrnicd cannot hold or drain; the VM cannot migrate while it is connected")
    dirty = DirtyLog()
    with source.lock:
        source.dirty = dirty
    registry.log_writes(vrnic.spec.id, dirty)  # peers' WRITEs into it are logged from now on
    staged = make_session()
    staged.staged = True
    moving = MovingVrnic(vrnic, source, staged, dirty)
    try:
        staged.converge(source.snapshot_state())
        moving.pairs = preconnect(vrnic, source, staged, registry)
    except BaseException:
        unstage(moving, registry)
        raise
    return moving


def preconnect(vrnic: VirtualRnic, source: GuestSession, staged: GuestSession,
               registry: Registry) -> list[Preconnected]:
    """Connect each connected RC QP's staged twin to a second physical QP of its peer's (MigrRDMA's pre-setup)."""
    with source.lock:
        wanted = [(h, q.vqpn, q.peer_id, q.peer_gid, q.peer_vqpn, q.access, q.qkey, dict(q.link))
                  for h, q in source.state.qps.items()
                  if q.qp_type == "rc" and q.state == "rts" and q.peer_id and q.peer_gid and q.peer_vqpn is not None]
    pairs = []
    try:
        for handle, vqpn, peer_id, peer_gid, peer_vqpn, access, qkey, link in wanted:
            try:
                peer_vrnic = registry.get(peer_id)
            except NotFound:
                continue
            peer = peer_vrnic.session
            if not isinstance(peer, GuestSession) or not isinstance(peer.engine, SharedRingEngine):
                continue
            with peer.lock:
                peer_qp = peer.state.qp_by_vqpn.get(peer_vqpn)
            if peer_qp is None or peer_qp.state != "rts" or peer_qp.peer_id != vrnic.spec.id \
                    or peer_qp.peer_vqpn != vqpn:
                continue  # not a pair (yet): the switchover connects it the slow way
            staged_qp = staged.state.qps.get(handle)
            shadow, shadow_qpn = peer.shadow(peer_qp, vrnic.phys_gid, staged_qp.phys_qpn)
            try:
                staged.preconnect(handle, peer_id, peer_gid, peer_vqpn, peer_vrnic.phys_gid, shadow_qpn, access,
                                  qkey, link)
            except BaseException:
                peer.drop_shadow(shadow)
                raise
            pairs.append(Preconnected(handle, staged_qp, peer_id, peer, peer_qp, peer_gid, peer_vqpn, shadow,
                                      shadow_qpn))
    except BaseException:
        for pair in pairs:
            with contextlib.suppress(Exception):
                pair.peer.drop_shadow(pair.shadow)
        raise
    return pairs


def unstage(moving: MovingVrnic, registry: Registry) -> None:
    registry.log_writes(moving.vrnic.spec.id, None)
    with moving.source.lock:
        moving.source.dirty = None
    for pair in moving.pairs:
        with contextlib.suppress(Exception):  # a peer that closed took its shadow with its context
            pair.peer.drop_shadow(pair.shadow)
    moving.pairs = []
    moving.staged.close()


def _still_paired(pair: Preconnected, m: MovingVrnic, registry: Registry) -> bool:
    """Is a pre-connected pair still what the guests have (nobody reconnected or went since prepare)?"""
    if pair.handle not in m.staged.state.qps or m.staged.state.qps.get(pair.handle) is not pair.staged_qp:
        return False
    if pair.handle not in m.source.state.qps:
        return False
    old = m.source.state.qps.get(pair.handle)
    if (old.state, old.peer_gid, old.peer_vqpn) != ("rts", pair.peer_gid, pair.peer_vqpn):
        return False
    try:
        if registry.get(pair.peer_id).session is not pair.peer:
            return False
    except NotFound:
        return False
    peer_qp = pair.peer.state.qp_by_vqpn.get(pair.peer_vqpn)
    return (peer_qp is pair.peer_qp and peer_qp.state == "rts" and peer_qp.peer_id == m.vrnic.spec.id
            and peer_qp.peer_vqpn == old.vqpn and peer_qp.held)


def ring_ranges(session: GuestSession) -> list[tuple[int, int]]:
    """The guest ranges of every ring: vrnicd writes their indices and completions."""
    ranges = []
    for _, cq in session.state.cqs.items():
        ranges.append((cq.ring_addr, Ring.bytes_needed(cq.cqe, CQ_SLOT.size)))
    for _, qp in session.state.qps.items():
        ranges.append((qp.sq_addr, Ring.bytes_needed(qp.max_send_wr, SQ_SLOT.size)))
        ranges.append((qp.rq_addr, Ring.bytes_needed(qp.max_recv_wr, RQ_SLOT.size)))
    return ranges


def copy_nic_writes(source: GuestMemory, dest: GuestMemory, ranges: list[tuple[int, int]]) -> int:
    """Copy guest ranges from the source RAM to the destination's; returns the bytes copied."""
    copied = 0
    for address, length in ranges:
        try:
            at = source.layout.locate(address, length, "dirty range")
        except InvalidArgument:  # a run that crosses a hole: page by page, skipping what is not RAM
            for page in range(address, address + length, 4096):
                with contextlib.suppress(InvalidArgument):
                    at = source.layout.locate(page, 4096, "dirty page")
                    dest.view[at:at + 4096] = source.view[at:at + 4096]
                    copied += 4096
            continue
        dest.view[at:at + length] = source.view[at:at + length]
        copied += length
    return copied


def switchover(migration: Migration, source_memory: GuestMemory, registry: Registry,
               drain_timeout: float = DRAIN_TIMEOUT_S) -> SwitchoverReport:
    """Move every attached vRNIC of the VM to its staged session. On an error before the hand-over the
    source keeps serving (holds released); the caller then aborts."""
    migration.phase = advance(migration.phase, MigrationPhase.SWITCHING)
    report = SwitchoverReport(vrnics=[m.vrnic.spec.id for m in migration.moving])
    started = time.perf_counter()
    held: list[tuple[GuestSession, list[QpEntry] | None]] = []
    try:
        # 1. hold: no new send reaches the NIC from the VM or from any peer QP connected to it
        for m in migration.moving:
            m.source.hold()
            held.append((m.source, None))
            m.peers = []
            for other in registry.connected_to(m.vrnic.spec.id):
                peer = other.session
                if isinstance(peer, GuestSession) and peer is not m.source:
                    qps = peer.qps_connected_to(m.vrnic.spec.id)
                    if qps:
                        peer.hold(qps)
                        held.append((peer, qps))
                        m.peers.append((peer, qps))
        t_hold = time.perf_counter()
        report.hold_ms = (t_hold - started) * 1000
        # 2. drain: wait until every send on the NIC completed (the completions reach the guest's CQ rings)
        deadline = time.monotonic() + drain_timeout
        while True:
            left = sum(session.outstanding_sends(only) for session, only in held)
            if not left or blocked_only(migration):
                break
            if time.monotonic() > deadline:
                raise Conflict(f"{left} send(s) did not complete within {drain_timeout:.0f} s; the VM stays on the "
                               f"source", current_state="draining")
            time.sleep(0.0005)
        t_drain = time.perf_counter()
        report.drain_ms = (t_drain - t_hold) * 1000
    except BaseException:
        _release(held)
        migration.phase = advance(migration.phase, MigrationPhase.ABORTED)
        raise
    for m in migration.moving:
        progress: list[str] = []
        try:
            _move(m, migration, source_memory, registry, report, progress)
        except BaseException:
            if progress:  # the point of no return was passed: nothing sane to go back to
                log.error("VM %s: switchover of vRNIC %s failed after the hand-over", migration.domain,
                          m.vrnic.spec.id)
            else:
                _release(held)
                migration.phase = advance(migration.phase, MigrationPhase.ABORTED)
            raise
    report.total_ms = (time.perf_counter() - started) * 1000
    return report


def blocked_only(migration: Migration) -> bool:
    """Is every send still on the NIC blocked for want of a receive at the other end (RNR)?

    The VM cannot post receives while it is stopped, so a peer's SEND can wait for one forever. Such a
    SEND was not taken (the responder has no receive posted, and posts none while held), nor was anything
    after it on the same QP (RC executes in order): all of them go again, first, on the new connection."""
    for m in migration.moving:
        pairs = [(m.source, qp, peer, peer_qp) for peer, qps in m.peers for peer_qp in qps
                 if (qp := m.source.state.qp_by_vqpn.get(peer_qp.peer_vqpn or -1)) is not None]
        for one, one_qp, other, other_qp in pairs:
            for sender, sender_qp, responder, responder_qp in ((one, one_qp, other, other_qp),
                                                                (other, other_qp, one, one_qp)):
                with sender.lock, responder.lock:
                    sender.engine.settle()
                    responder.engine.settle()
                    if not sender_qp.send_fifo:
                        continue
                    _, head = sender_qp.send_fifo[0]
                    if head.opcode not in CONSUMES_RECV or responder_qp.recv_fifo:
                        return False
        if any(q.send_fifo for _, q in m.source.state.qps.items() if q.peer_id is None):
            return False  # not connected to anyone we hold: nothing to wait for but the NIC
    return True


def _release(held: list[tuple[GuestSession, list[QpEntry] | None]]) -> None:
    for session, only in held:
        with contextlib.suppress(Exception):
            session.release(only)


def _move(m: MovingVrnic, migration: Migration, source_memory: GuestMemory, registry: Registry,
          report: SwitchoverReport, progress: list[str]) -> None:
    """Steps 3 to 5 for one vRNIC, under its source session's lock (its engine stays out). `progress` gets
    "handed_over" once the registry serves the destination: from there on there is no way back."""
    with m.source.lock:
        m.source.engine.settle()
        # 3. copy what QEMU could not see: every page the NIC or vrnicd wrote, and all rings
        ranges = m.dirty.ranges() + ring_ranges(m.source)
        report.dirty_pages += len(m.dirty)
        t0 = time.perf_counter()
        report.copied_bytes += copy_nic_writes(source_memory, migration.memory, ranges)
        t1 = time.perf_counter()
        report.copy_ms += (t1 - t0) * 1000
        # 4. the destination's CQs and QPs, same handles and virtual QPNs; MRs reconciled with the presetup
        kept, added = m.staged.converge(m.source.state.snapshot())
        report.mrs_presetup += kept
        report.mrs_registered += added
        report.qps += len(m.staged.state.qps)
        t2 = time.perf_counter()
        report.rebuild_ms += (t2 - t1) * 1000
        # 5. publish in one step; peers resolve the VM's QPs to the new physical QPs from here on
        qpns, mrs = m.staged.publications()
        registry.hand_over(m.vrnic, m.source, m.staged, qpns, mrs)
        progress.append("handed_over")
        m.staged.staged = False
        ready: set[int] = set()
        moved: set[int] = set()
        for pair in m.pairs:  # the pre-set-up pairs: the peer's QP only swaps to its shadow
            if _still_paired(pair, m, registry):
                reposted, again = pair.peer.adopt_shadow(pair.peer_qp, pair.shadow, pair.shadow_qpn,
                                                         m.vrnic.phys_gid, pair.staged_qp.phys_qpn)
                ready.add(pair.handle)
                moved.add(id(pair.peer_qp))
                report.recvs_reposted += reposted
                report.sends_carried += again
                report.peers_repointed += 1
                report.preconnected += 1
            else:
                pair.peer.drop_shadow(pair.shadow)
        m.pairs = []
        for peer, qps in m.peers:  # the others: reset and connect again
            for qp in qps:
                if id(qp) in moved:
                    continue
                reposted, again = peer.reconnect(qp)
                report.recvs_reposted += reposted
                report.sends_carried += again
                report.peers_repointed += 1
        reposted, carried, broken = m.staged.take_over(m.source, frozenset(ready))
        report.recvs_reposted += reposted
        report.sends_carried += carried
        report.broken_qps += broken
        report.connect_ms += (time.perf_counter() - t2) * 1000


def finish(migration: Migration, report: SwitchoverReport, registry: Registry) -> None:
    """After the hand-over: the destination links serve the new sessions, holds go, the source closes."""
    t0 = time.perf_counter()
    by_id = {link.vrnic_id: link for link in migration.links}
    for m in migration.moving:
        by_id[m.vrnic.spec.id].adopt(m.staged)
        m.staged.start()
        m.staged.release()
        for peer, qps in m.peers:
            peer.release(qps)
        registry.log_writes(m.vrnic.spec.id, None)
        m.dirty = DirtyLog()
    report.release_ms = (time.perf_counter() - t0) * 1000
    migration.phase = advance(migration.phase, MigrationPhase.DONE)


def new_doorbell() -> int:
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
