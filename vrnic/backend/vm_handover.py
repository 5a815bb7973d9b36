"""A VM's vRNICs handed from this host's vrnicd to another host's (cross-host live migration).

The plan and the records that travel are vrnic.core.handover. Here: the source's side (prepare, switchover,
abort), which VerbsDriver drives, and the two things it talks to:

- the destination (HandoverDestination): the other host's VerbsDriver (accept_handover, handover_pages,
  handover_take_over, handover_release, handover_abort), reached through its agent's /agent/v1 routes;
- every host with a peer QP connected to the VM (PeerHost): its PeerService (track, hold, status, moved,
  release), this host's own for local peers, the others' through their agents.

Same-host migration (vrnic.backend.vm_migration) pre-connects shadow QPs; across hosts the peers keep their
physical QPs and are reset and reconnected to the destination's (MigrRDMA's slower path), which needs no
second QP on the peer's device and no protocol between the agents beyond these calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from vrnic.backend.engine import SharedRingEngine
from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.registry import Registry, VirtualRnic
from vrnic.backend.session import GuestSession
from vrnic.backend.vm_migration import CONSUMES_RECV, ring_ranges
from vrnic.core.handover import (
    Arrival,
    HandoverPhase,
    PeerQpStatus,
    QpCarry,
    advance,
    batches,
    drained,
    merge_ranges,
)
from vrnic.core.migration import DirtyLog
from vrnic.core.peer_wire import IdentityWire
from vrnic.core.session_state import SessionSnapshot
from vrnic.core.specs import VmBinding, VrnicSpec
from vrnic.errors import Conflict, InvalidArgument, VrnicError

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 5.0


class HandoverDestination(Protocol):
    """The destination host's vrnicd, as the source drives it."""

    def accept(self, domain: str, specs: list[VrnicSpec], binding: VmBinding,
               snapshots: dict[str, SessionSnapshot]) -> dict[str, Any]: ...

    def preconnect(self, domain: str, vrnic_id: str, wires: list[dict[str, Any]]) -> int: ...

    def pages(self, domain: str, runs: list[tuple[int, bytes]]) -> None: ...

    def take_over(self, domain: str, snapshots: dict[str, SessionSnapshot], carried: dict[str, list[QpCarry]],
                  live_peers: dict[str, list[int]]) -> dict[str, Any]:
        """live_peers: per vRNIC, its QPs whose peers are held (alive). The answer's "published" names what the
        destination now publishes per vRNIC (phys_gid, qpns, windows); "agent" ({host, url}) where it is."""

    def release(self, domain: str) -> None: ...

    def abort(self, domain: str) -> None: ...


class PeerHost(Protocol):
    """A host with peer QPs connected to a moving vRNIC (vrnic.backend.peer_service.PeerService)."""

    def track(self, vrnic_id: str) -> None: ...

    def shadows(self, vrnic_id: str, wanted: dict[int, tuple[str, int]]) -> dict[int, dict[str, Any]]: ...

    def hold(self, vrnic_id: str) -> list[PeerQpStatus]: ...

    def status(self, vrnic_id: str) -> tuple[list[PeerQpStatus], list[tuple[int, int]]]: ...

    def moved(self, vrnic_id: str, virtual_gid: str, arrival: Arrival | None = None) -> int: ...

    def release(self, vrnic_id: str) -> None: ...


@dataclass
class HandoverReport:
    """What the cross-host switchover did and how long each part took (milliseconds)."""

    vrnics: list[str] = field(default_factory=list)
    peer_hosts: int = 0
    qps: int = 0
    peers_repointed: int = 0
    preconnected: int = 0  # of the VM's QPs, connected at prepare to their peers' second QPs
    dirty_pages: int = 0  # logged on every host
    copied_bytes: int = 0
    recvs_reposted: int = 0
    sends_carried: int = 0
    broken_qps: int = 0
    mrs_presetup: int = 0
    mrs_registered: int = 0
    hold_ms: float = 0.0
    drain_ms: float = 0.0
    copy_ms: float = 0.0
    take_over_ms: float = 0.0  # the destination: objects converged, QPs connected, receives posted
    record_ms: float = 0.0  # the control plane told where the vRNIC lives now
    cleanup_ms: float = 0.0  # the source's objects destroyed
    repoint_ms: float = 0.0
    release_ms: float = 0.0
    total_ms: float = 0.0
    take_over_steps: dict[str, float] = field(default_factory=dict)  # the destination's own time, per step


@dataclass
class Leaving:
    """One vRNIC of the VM leaving this host."""

    vrnic: VirtualRnic
    source: GuestSession
    dirty: DirtyLog


@dataclass
class Handover:
    domain: str
    target: VmBinding
    destination: HandoverDestination
    leaving: list[Leaving]
    peer_hosts: list[PeerHost]  # this host's PeerService first
    phase: HandoverPhase = HandoverPhase.PREPARED
    prepare_ms: float = 0.0
    accepted: dict[str, Any] = field(default_factory=dict)


def read_ranges(memory: GuestMemory, ranges: list[tuple[int, int]]) -> list[tuple[int, bytes]]:
    """The bytes of guest ranges (by guest address); a range across a hole goes page by page, RAM only."""
    runs: list[tuple[int, bytes]] = []
    for address, length in ranges:
        try:
            at = memory.layout.locate(address, length, "dirty range")
        except InvalidArgument:
            for page in range(address - address % 4096, address + length, 4096):
                with contextlib.suppress(InvalidArgument):
                    at = memory.layout.locate(page, 4096, "dirty page")
                    runs.append((page, bytes(memory.view[at:at + 4096])))
            continue
        runs.append((address, bytes(memory.view[at:at + length])))
    return runs


def write_runs(memory: GuestMemory, runs: list[tuple[int, bytes]]) -> int:
    written = 0
    for address, data in runs:
        at = memory.layout.locate(address, len(data), "page run")
        memory.view[at:at + len(data)] = data
        written += len(data)
    return written


def prepare(domain: str, target: VmBinding, vrnics: list[VirtualRnic], registry: Registry,
            destination: HandoverDestination, local_peers: PeerHost,
            peer_host_of: Callable[[Any], PeerHost]) -> Handover:
    """Start the dirty logs (here and on every peer host), pre-set-up the destination. On an error nothing is
    left running anywhere."""
    t0 = time.perf_counter()
    leaving: list[Leaving] = []
    for vrnic in vrnics:
        source = vrnic.session
        if not isinstance(source, GuestSession) or source.closed:
            raise Conflict(f"vRNIC {vrnic.spec.id} of VM {domain} has no guest attached; nothing to hand over",
                           current_state="bound")
        if not isinstance(source.engine, SharedRingEngine):
            raise Conflict(f"vRNIC {vrnic.spec.id} does not use the shared-ring engine; it cannot migrate")
        leaving.append(Leaving(vrnic, source, DirtyLog()))
    hosts: list[PeerHost] = [local_peers]
    agents: dict[str, Any] = {}
    for m in leaving:
        with m.source.lock:
            peer_ids = {q.peer_id for _, q in m.source.state.qps.items() if q.peer_id is not None}
        for peer_id in sorted(peer_ids):
            remote = registry.remote_peer(peer_id)
            if remote is not None:
                agents.setdefault(remote.agent.url, remote.agent)
    hosts += [peer_host_of(agent) for agent in agents.values()]
    handover = Handover(domain, target, destination, leaving, hosts)
    try:
        for m in leaving:
            with m.source.lock:
                m.source.dirty = m.dirty
            registry.log_writes(m.vrnic.spec.id, m.dirty)
            for host in hosts:
                host.track(m.vrnic.spec.id)
        snapshots = {m.vrnic.spec.id: m.source.snapshot_state() for m in leaving}
        handover.accepted = destination.accept(domain, [m.vrnic.spec for m in leaving], target, snapshots)
        handover.accepted["preconnected"] = sum(_preconnect(handover, m) for m in leaving)
    except BaseException:
        _call_off(handover, registry, destination_too=True)
        raise
    handover.prepare_ms = (time.perf_counter() - t0) * 1000
    return handover


def _preconnect(handover: Handover, m: Leaving) -> int:
    """Each connected RC QP's destination twin gets a second physical QP on its peer's host, connected both
    ways ahead of the switchover (MigrRDMA's pre-setup); QPs left out connect the slow way at the switchover."""
    vrnic_id = m.vrnic.spec.id
    dgid = str(handover.accepted["phys_gid"][vrnic_id])
    phys = {int(v): int(q) for v, q in handover.accepted["qpns"][vrnic_id].items()}
    with m.source.lock:
        connected = {q.vqpn: (h, q.peer_gid, q.peer_vqpn, q.access, q.qkey, dict(q.link))
                     for h, q in m.source.state.qps.items()
                     if q.qp_type == "rc" and q.state == "rts" and q.peer_gid and q.peer_vqpn is not None}
    wanted = {vqpn: (dgid, phys[vqpn]) for vqpn in connected if vqpn in phys}
    if not wanted:
        return 0
    wires = []
    for host in handover.peer_hosts:
        for vqpn, made in host.shadows(vrnic_id, wanted).items():
            handle, peer_gid, peer_vqpn, access, qkey, link = connected[int(vqpn)]
            if (made["peer_gid"], made["peer_vqpn"]) != (peer_gid, peer_vqpn):
                continue  # not the pair the guest made (it reconnected meanwhile): the slow way
            wires.append({"handle": handle, "peer_id": made["peer_id"], "peer_gid": peer_gid, "peer_vqpn": peer_vqpn,
                          "peer_phys_gid": made["peer_phys_gid"], "dest_qpn": made["shadow_qpn"], "access": access,
                          "qkey": qkey, "link": link})
    return handover.destination.preconnect(handover.domain, vrnic_id, wires) if wires else 0


def _call_off(handover: Handover, registry: Registry, destination_too: bool) -> None:
    """Back to where the source serves: holds released on every host, logs stopped, the destination cleaned."""
    for m in handover.leaving:
        for host in handover.peer_hosts:
            try:
                host.release(m.vrnic.spec.id)
            except VrnicError as exc:  # a peer host that went away: its QPs went with it
                log.warning("VM %s: releasing peers of %s: %s", handover.domain, m.vrnic.spec.id, exc)
        registry.log_writes(m.vrnic.spec.id, None)
        with m.source.lock:
            m.source.dirty = None
        m.source.release()
    if destination_too:
        try:
            handover.destination.abort(handover.domain)
        except VrnicError as exc:
            log.warning("VM %s: the destination did not drop its pre-setup: %s", handover.domain, exc)


def abort(handover: Handover, registry: Registry) -> None:
    handover.phase = advance(handover.phase, HandoverPhase.ABORTED)
    _call_off(handover, registry, destination_too=True)


def _vm_side(m: Leaving) -> tuple[dict[int, int], dict[int, tuple[int, bool]]]:
    """Per VM QP (by virtual QPN): receives on the NIC; and sends on the NIC with whether the first consumes a
    receive."""
    with m.source.lock:
        m.source.engine.settle()
        recvs, sends = {}, {}
        for _, qp in m.source.state.qps.items():
            recvs[qp.vqpn] = len(qp.recv_fifo)
            head = qp.send_fifo[0][1] if qp.send_fifo else None
            sends[qp.vqpn] = (len(qp.send_fifo), head is not None and head.opcode in CONSUMES_RECV)
        return recvs, sends


def switchover(handover: Handover, source_memory: GuestMemory, registry: Registry,
               record_move: Callable[[], None], leave: Callable[[], None],
               drain_timeout: float = DRAIN_TIMEOUT_S) -> HandoverReport:
    """Hold, drain, copy, hand the state over, record the move (the control plane); then leave (the source's
    objects go), re-point the peers and let the destination serve. An error up to the recorded move calls
    everything off (the source serves on; the caller resumes the VM there); after it there is no way back."""
    handover.phase = advance(handover.phase, HandoverPhase.SWITCHING)
    report = HandoverReport(vrnics=[m.vrnic.spec.id for m in handover.leaving], peer_hosts=len(handover.peer_hosts))
    started = time.perf_counter()
    try:
        for m in handover.leaving:
            m.source.hold()
            for host in handover.peer_hosts:
                host.hold(m.vrnic.spec.id)
        t_hold = time.perf_counter()
        report.hold_ms = (t_hold - started) * 1000
        deadline = time.monotonic() + drain_timeout
        logged: list[list[tuple[int, int]]] = []
        live_peers: dict[str, list[int]] = {}  # per vRNIC, its QPs whose peers are held: alive
        for m in handover.leaving:
            while True:
                statuses: list[PeerQpStatus] = []
                ranges: list[list[tuple[int, int]]] = []
                for host in handover.peer_hosts:
                    status, logged_here = host.status(m.vrnic.spec.id)
                    statuses += status
                    ranges.append(logged_here)
                vm_recvs, vm_sends = _vm_side(m)
                if drained(statuses, vm_recvs, vm_sends):
                    live_peers[m.vrnic.spec.id] = sorted({s.vm_vqpn for s in statuses})
                    break
                if time.monotonic() > deadline:
                    raise Conflict(f"sends of vRNIC {m.vrnic.spec.id} or its peers did not complete within "
                                   f"{drain_timeout:.0f} s; the VM stays on the source", current_state="draining")
                time.sleep(0.001)
            logged.append(merge_ranges(m.dirty.ranges(), *ranges, ring_ranges(m.source)))
            report.dirty_pages += sum(length // 4096 for length in (r[1] for r in merge_ranges(m.dirty.ranges(),
                                                                                                *ranges)))
        t_drain = time.perf_counter()
        report.drain_ms = (t_drain - t_hold) * 1000
        for wanted in logged:
            for batch in batches(wanted):
                runs = read_ranges(source_memory, batch)
                handover.destination.pages(handover.domain, runs)
                report.copied_bytes += sum(len(data) for _, data in runs)
        t_copy = time.perf_counter()
        report.copy_ms = (t_copy - t_drain) * 1000
        snapshots = {m.vrnic.spec.id: m.source.snapshot_state() for m in handover.leaving}
        carried = {m.vrnic.spec.id: m.source.carry_out() for m in handover.leaving}
        taken = handover.destination.take_over(handover.domain, snapshots, carried, live_peers)
        for key in ("qps", "recvs_reposted", "sends_carried", "broken_qps", "mrs_presetup", "mrs_registered",
                    "preconnected"):
            setattr(report, key, int(taken.get(key, 0)))
        report.take_over_steps = {str(k): float(v) for k, v in dict(taken.get("steps", {})).items()}
        t0 = time.perf_counter()
        report.take_over_ms = (t0 - t_copy) * 1000
        # Until the control plane says where the vRNIC lives, no peer was re-pointed and the source's QPs are
        # intact: a failure here is still called off like any before it.
        record_move()
    except BaseException:
        handover.phase = advance(handover.phase, HandoverPhase.ABORTED)
        _call_off(handover, registry, destination_too=True)
        raise
    handover.phase = advance(handover.phase, HandoverPhase.HANDED_OVER)
    t1 = time.perf_counter()
    try:
        leave()
    except Exception:  # the destination serves the VM either way; what is left here is logged for the operator
        log.exception("VM %s: the source's objects were not all released after the hand-over", handover.domain)
    t2 = time.perf_counter()
    for m in handover.leaving:
        arrival = _arrival(m, taken)
        for host in handover.peer_hosts:
            try:
                report.peers_repointed += host.moved(m.vrnic.spec.id, m.vrnic.spec.virtual_gid, arrival)
            except VrnicError as exc:  # that host's peers find out by their QPs' errors
                log.warning("VM %s: peers of %s on one host were not re-pointed: %s", handover.domain,
                            m.vrnic.spec.id, exc)
    t3 = time.perf_counter()
    handover.destination.release(handover.domain)
    t4 = time.perf_counter()
    report.record_ms, report.cleanup_ms = (t1 - t0) * 1000, (t2 - t1) * 1000
    report.repoint_ms, report.release_ms = (t3 - t2) * 1000, (t4 - t3) * 1000
    report.total_ms = (t4 - started) * 1000
    handover.phase = advance(handover.phase, HandoverPhase.DONE)
    return report


def _arrival(m: Leaving, taken: dict[str, Any]) -> Arrival | None:
    """What the destination published for this vRNIC, for its peers' hosts; None if it did not say (they look
    it up then)."""
    published, agent = dict(taken.get("published") or {}).get(m.vrnic.spec.id), taken.get("agent")
    if not published or not agent:
        return None
    try:
        return Arrival.from_dict({"target": IdentityWire.of(m.vrnic.identity).model_dump(), "agent_host": agent["host"],
                                  "agent_url": agent["url"], **published})
    except (InvalidArgument, KeyError, TypeError) as exc:
        log.warning("vRNIC %s: the destination's publication is unusable (%s); peers look it up", m.vrnic.spec.id,
                    exc)
        return None


def report_dict(report: HandoverReport) -> dict[str, object]:
    return asdict(report)
