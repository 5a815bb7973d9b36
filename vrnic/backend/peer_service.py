"""The owner's side of peering: what this vrnicd tells other hosts' agents about the vRNICs it holds.

Each question names the asking vRNIC (its Identity, as its agent states it). Every answer goes through
the same reachability check a local session's would (Registry.local_peer: decide, audited), and only about
vRNICs held here: a question is never passed on to a third host. A refusal is the NotFound of a GID that
does not exist. The HTTP routes are vrnic.api.agent_peers; the asking side is peer_directory.AgentDirectory.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from vrnic.backend.cm import ConnectionManager
from vrnic.backend.engine import SharedRingEngine
from vrnic.backend.peer_directory import AgentRef, RemotePeer
from vrnic.backend.registry import Peer, Registry
from vrnic.backend.session import GuestSession
from vrnic.backend.vm_migration import CONSUMES_RECV
from vrnic.core.handover import Arrival, PeerQpStatus
from vrnic.core.migration import DirtyLog
from vrnic.core.peering import Identity
from vrnic.core.session_state import QpEntry
from vrnic.core.translate import MrWindow
from vrnic.core.vaddr import parse_virtual_gid
from vrnic.errors import Conflict, InvalidArgument, VrnicError

log = logging.getLogger(__name__)

# Connect requests from other hosts wait for a guest's answer on one of the API's worker threads: at most this
# many at once, so guests that never answer cannot take every thread of this agent's API.
MAX_REMOTE_CM_WAITS = 16


@dataclass
class _Moving:
    """A peer vRNIC (held elsewhere) that is moving to another host, as this host's peers of it see it."""

    log: DirtyLog
    own_log: bool  # started here (False: the source's own migration log, on the source's host)
    held: list[tuple[GuestSession, list[QpEntry]]] = field(default_factory=list)
    shadows: dict[int, _Shadow] = field(default_factory=dict)  # by the peer QP's id()


@dataclass
class _Shadow:
    """A second physical QP of one of our QPs, connected ahead to the moving vRNIC's QP at its destination."""

    session: GuestSession
    qp: QpEntry
    obj: object
    phys_qpn: int
    dgid: str  # the destination's device GID
    dest_qpn: int  # the moving QP's physical QPN there


class PeerService:
    def __init__(self, registry: Registry, cm: ConnectionManager) -> None:
        self.registry = registry
        self.cm = cm
        self._cm_waits = threading.BoundedSemaphore(MAX_REMOTE_CM_WAITS)
        self._moving: dict[str, _Moving] = {}
        self._moving_lock = threading.Lock()

    @staticmethod
    def _check_asker(asker: Identity) -> None:
        """A virtual GID carries its VPC: an asker whose GID and VPC disagree is made up."""
        vpc_id, _ = parse_virtual_gid(asker.virtual_gid)
        if vpc_id != asker.vpc_id:
            raise InvalidArgument(f"asker {asker.vrnic_id}: GID {asker.virtual_gid} is not of VPC {asker.vpc_id}")

    def qp(self, asker: Identity, virtual_gid: str, vqpn: int, via: str = "connect") -> tuple[Identity, str, int]:
        """(the target's identity, its device GID, the QP's physical QPN)."""
        self._check_asker(asker)
        target = self.registry.local_peer(asker, virtual_gid, f"{via} (remote)")
        return target.identity, target.phys_gid, self.registry.published_qpn(target, vqpn)

    def mrs(self, asker: Identity, virtual_gid: str) -> list[MrWindow]:
        self._check_asker(asker)
        return self.registry.published_mrs(self.registry.local_peer(asker, virtual_gid, "rdma (remote)"))

    def reverse(self, asker: Identity, phys_gid: str, phys_qpn: int) -> int:
        self._check_asker(asker)
        return self.registry.reverse(asker, phys_qpn, phys_gid)

    def cm_connect(self, asker: Identity, virtual_gid: str, port: int, vqpn: int, private_data: bytes,
                   timeout: float) -> tuple[int, bytes]:
        """Queue the request on the listener and wait for its guest's answer (the caller's thread waits)."""
        self._check_asker(asker)
        target = self.registry.local_peer(asker, virtual_gid, "cm connect (remote)")
        if not self._cm_waits.acquire(blocking=False):
            raise Conflict(f"connection refused: {MAX_REMOTE_CM_WAITS} requests from other hosts are waiting here "
                           f"already", current_state="rejected")
        try:
            return self.cm.connect(asker, target.spec.id, port, vqpn, private_data, timeout)
        finally:
            self._cm_waits.release()

    # ----- a peer of ours moves to another host (vrnic.backend.vm_handover drives these; see core.handover) ----
    def track(self, vrnic_id: str) -> None:
        """Log what our sessions' RDMA WRITEs and atomics put into vrnic_id's memory from now on."""
        with self._moving_lock:
            if vrnic_id in self._moving:
                return
            existing = self.registry.dirty_log(vrnic_id)
            moving = _Moving(existing or DirtyLog(), own_log=existing is None)
            if existing is None:
                self.registry.log_writes(vrnic_id, moving.log)
            self._moving[vrnic_id] = moving

    def shadows(self, vrnic_id: str, wanted: dict[int, tuple[str, int]]) -> dict[int, dict[str, object]]:
        """MigrRDMA's pre-setup across hosts: for each of our RC QPs connected to vrnic_id's QP vqpn (a key of
        `wanted`), a second physical QP connected to (GID, QPN), where that QP will live after the move. At
        `moved` our QP continues on it: a used rxe QP is never reset (rxe 6.1 loses its send queue's place then).
        Returns, by the moving QP's vqpn: our vRNIC, its virtual GID and QPN, its device GID, the new QPN."""
        moving = self._tracked(vrnic_id)
        made: dict[int, dict[str, object]] = {}
        for other in self.registry.connected_to(vrnic_id):
            session = other.session
            if not isinstance(session, GuestSession) or not isinstance(session.engine, SharedRingEngine):
                continue
            for qp in session.qps_connected_to(vrnic_id):
                target = wanted.get(qp.peer_vqpn if qp.peer_vqpn is not None else -1)
                if target is None or qp.qp_type != "rc" or qp.state != "rts" or id(qp) in moving.shadows:
                    continue
                try:
                    obj, phys_qpn = session.shadow(qp, target[0], target[1])
                except VrnicError as exc:  # that QP connects the slow way at `moved`
                    log.warning("vRNIC %s QP %d: no second QP towards %s's destination: %s", session.vrnic_id,
                                qp.vqpn, vrnic_id, exc)
                    continue
                moving.shadows[id(qp)] = _Shadow(session, qp, obj, phys_qpn, target[0], target[1])
                made[qp.peer_vqpn or 0] = {"peer_id": session.vrnic_id, "peer_gid": session.vrnic.spec.virtual_gid,
                                           "peer_vqpn": qp.vqpn, "peer_phys_gid": session.vrnic.phys_gid,
                                           "shadow_qpn": phys_qpn}
        return made

    def _tracked(self, vrnic_id: str) -> _Moving:
        moving = self._moving.get(vrnic_id)
        if moving is None:
            raise Conflict(f"no hand-over of vRNIC {vrnic_id} is tracked here", current_state="idle")
        return moving

    def hold(self, vrnic_id: str) -> list[PeerQpStatus]:
        """Hold every QP of ours connected to vrnic_id: no new send reaches the NIC; completions keep flowing."""
        with self._moving_lock:
            moving = self._tracked(vrnic_id)
            if not moving.held:
                for other in self.registry.connected_to(vrnic_id):
                    session = other.session
                    if isinstance(session, GuestSession) and isinstance(session.engine, SharedRingEngine):
                        qps = session.qps_connected_to(vrnic_id)
                        if qps:
                            session.hold(qps)
                            moving.held.append((session, qps))
        return self.status(vrnic_id)[0]

    def status(self, vrnic_id: str) -> tuple[list[PeerQpStatus], list[tuple[int, int]]]:
        """The held QPs' sends and receives on the NIC, and the pages our peers wrote into vrnic_id so far."""
        moving = self._tracked(vrnic_id)
        statuses = []
        for session, qps in moving.held:
            with session.lock:
                session.engine.settle()
                for qp in qps:
                    head = qp.send_fifo[0][1] if qp.send_fifo else None
                    statuses.append(PeerQpStatus(qp.peer_vqpn if qp.peer_vqpn is not None else -1,
                                                 len(qp.send_fifo),
                                                 head is not None and head.opcode in CONSUMES_RECV,
                                                 len(qp.recv_fifo)))
        return statuses, moving.log.ranges()

    def moved(self, vrnic_id: str, virtual_gid: str, arrival: Arrival | None = None) -> int:
        """vrnic_id now lives on another host: re-point each held QP at its new physical QP, post its receives
        again, let it go. Where it lives is taken from `arrival` (what its destination published) when that names
        the QP, else asked of the directory. Returns how many QPs were re-pointed; a QP whose peer cannot be
        reached any more goes to ERR (its guest sees its WRs flush)."""
        with self._moving_lock:
            moving = self._moving.pop(vrnic_id, None)
        if moving is None:
            return 0
        self.registry.forget_remote(vrnic_id, virtual_gid)
        remote = None
        if arrival is not None and arrival.identity.virtual_gid == virtual_gid and not self.registry.holds(virtual_gid):
            remote = RemotePeer(arrival.identity, arrival.phys_gid, AgentRef(arrival.agent_host, arrival.agent_url))
        if moving.own_log:
            self.registry.log_writes(vrnic_id, None)
        repointed = 0
        lookup_s = 0.0
        started = time.perf_counter()
        for session, qps in moving.held:
            for qp in qps:
                shadow = moving.shadows.pop(id(qp), None)
                try:
                    assert qp.peer_vqpn is not None
                    t0 = time.perf_counter()
                    if (remote is not None and arrival is not None and qp.peer_vqpn in arrival.qpns
                            and self.registry.learn_remote(session.vrnic, remote, arrival.windows)):
                        resolved: tuple[Peer, int] = (remote, arrival.qpns[qp.peer_vqpn])
                    else:
                        resolved = self.registry.peer_qp(session.vrnic, virtual_gid, qp.peer_vqpn, via="migration")
                    lookup_s += time.perf_counter() - t0
                    peer, phys_qpn = resolved
                    if shadow is not None and (peer.phys_gid, phys_qpn) == (shadow.dgid, shadow.dest_qpn):
                        session.adopt_shadow(qp, shadow.obj, shadow.phys_qpn, shadow.dgid, shadow.dest_qpn)
                        shadow = None
                    else:
                        session.reconnect(qp, resolved)
                    repointed += 1
                except VrnicError as exc:
                    log.warning("vRNIC %s QP %d: its peer %s moved and cannot be reached (%s); the QP goes to ERR",
                                session.vrnic_id, qp.vqpn, vrnic_id, exc)
                    with session.lock:
                        session.device.qp_to_state(qp.obj, "err")
                        qp.state = "err"
                if shadow is not None:
                    self._drop(shadow)
            session.release(qps)
        for shadow in moving.shadows.values():
            self._drop(shadow)
        log.info("vRNIC %s moved: %d QP(s) re-pointed in %.1f ms (%.1f ms of peer lookups)", vrnic_id, repointed,
                 (time.perf_counter() - started) * 1000, lookup_s * 1000)
        return repointed

    @staticmethod
    def _drop(shadow: _Shadow) -> None:
        try:
            shadow.session.drop_shadow(shadow.obj)
        except Exception as exc:  # a session that closed took its shadows with its context
            log.debug("vRNIC %s: shadow QP already gone: %s", shadow.session.vrnic_id, exc)

    def release(self, vrnic_id: str) -> None:
        """The hand-over was called off: our QPs go on with the peer where it was."""
        with self._moving_lock:
            moving = self._moving.pop(vrnic_id, None)
        if moving is None:
            return
        if moving.own_log:
            self.registry.log_writes(vrnic_id, None)
        for shadow in moving.shadows.values():
            self._drop(shadow)
        for session, qps in moving.held:
            session.release(qps)
