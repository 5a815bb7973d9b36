"""The vRNICs this vrnicd holds, and the one index through which sessions see each other.

A session never reads another session's tables. It publishes its QPs and MRs
here, and resolves peers here, always under the registry's lock and always
through the isolation rule: a peer is reachable only from the same tenant and
the same VPC, and anything else looks exactly like an identity that does not
exist.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from vrnic.core.migration import DirtyLog
from vrnic.core.specs import VrnicSpec
from vrnic.core.translate import MrWindow
from vrnic.errors import Conflict, NotFound


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass
class VirtualRnic:
    spec: VrnicSpec
    device: str
    token: str
    phys_gid: str  # the device's RoCE v2 GID: programmed into peers' QPs, never shown to guests
    gid_index: int
    session: Closeable | None = field(default=None, repr=False)  # the attached guest's session
    vm_domain: str | None = None  # the running VM this vRNIC is bound to; only its channel may attach


def reachable(asker: VrnicSpec, target: VrnicSpec) -> bool:
    """The isolation rule between two vRNICs: the same tenant and the same VPC."""
    return asker.tenant == target.tenant and asker.vpc_id == target.vpc_id


@dataclass
class _Published:
    qpn_by_vqpn: dict[int, int] = field(default_factory=dict)  # virtual -> physical QPN
    mrs: dict[int, MrWindow] = field(default_factory=dict)  # virtual key -> window


class PeerMrs(Mapping[int, MrWindow]):
    """A connected peer's MRs by virtual key, read under the registry lock (the peer may be deregistering)."""

    def __init__(self, registry: Registry, vrnic_id: str) -> None:
        self._registry, self._id = registry, vrnic_id

    def __getitem__(self, vkey: int) -> MrWindow:
        with self._registry._lock:
            published = self._registry._published.get(self._id)
            if published is None:
                raise KeyError(vkey)
            return published.mrs[vkey]

    def __iter__(self) -> Iterator[int]:
        with self._registry._lock:
            published = self._registry._published.get(self._id)
            return iter(list(published.mrs) if published else [])

    def __len__(self) -> int:
        with self._registry._lock:
            published = self._registry._published.get(self._id)
            return len(published.mrs) if published else 0


class Registry:
    def __init__(self) -> None:
        self._by_id: dict[str, VirtualRnic] = {}
        self._published: dict[str, _Published] = {}  # only attached vRNICs
        self._by_phys: dict[tuple[str, int], tuple[str, int]] = {}  # (phys GID, phys QPN) -> (vRNIC id, vQPN)
        self._dirty: dict[str, DirtyLog] = {}  # vRNICs whose VM migrates: peers log their writes into it here
        self._lock = threading.Lock()

    # ----- membership ----------------------------------------------------------------------------
    def add(self, vrnic: VirtualRnic) -> None:
        with self._lock:
            if vrnic.spec.id in self._by_id:
                raise Conflict(f"vRNIC {vrnic.spec.id} already exists in the backend")
            if any(v.spec.virtual_gid == vrnic.spec.virtual_gid for v in self._by_id.values()):
                raise Conflict(f"virtual GID {vrnic.spec.virtual_gid} is already in use")
            self._by_id[vrnic.spec.id] = vrnic

    def remove(self, vrnic_id: str) -> VirtualRnic:
        with self._lock:
            vrnic = self._by_id.pop(vrnic_id, None)
        if vrnic is None:
            raise NotFound(f"no vRNIC {vrnic_id} in the backend")
        return vrnic

    def by_token(self, token: str) -> VirtualRnic:
        with self._lock:
            candidates = list(self._by_id.values())
        for vrnic in candidates:
            if hmac.compare_digest(vrnic.token.encode(), token.encode()):
                return vrnic
        raise NotFound("invalid attach token")

    def get(self, vrnic_id: str) -> VirtualRnic:
        with self._lock:
            vrnic = self._by_id.get(vrnic_id)
        if vrnic is None:
            raise NotFound(f"no vRNIC {vrnic_id} in the backend")
        return vrnic

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._by_id)

    def all_on(self, device: str) -> list[VirtualRnic]:
        with self._lock:
            return [v for v in self._by_id.values() if v.device == device]

    def on_device(self, device: str) -> int:
        with self._lock:
            return sum(1 for v in self._by_id.values() if v.device == device)

    # ----- attachment ----------------------------------------------------------------------------
    def attach(self, vrnic: VirtualRnic, session: Closeable, vm_domain: str | None = None) -> None:
        """Claim the vRNIC for one guest (of the VM vm_domain, if given); Conflict if another guest holds it."""
        with self._lock:
            if self._by_id.get(vrnic.spec.id) is not vrnic:
                raise NotFound(f"vRNIC {vrnic.spec.id} was released")
            if vrnic.vm_domain != vm_domain:
                raise Conflict(f"vRNIC {vrnic.spec.id} is bound to VM {vrnic.vm_domain}", current_state="attached")
            if vrnic.session is not None:
                raise Conflict(f"vRNIC {vrnic.spec.id} already has a guest attached", current_state="attached")
            vrnic.session = session
            self._published[vrnic.spec.id] = _Published()

    def detach(self, vrnic: VirtualRnic, session: Closeable) -> None:
        """Forget the guest's session and everything it published (idempotent).

        A session that handed the vRNIC over (migration) published nothing that is still its own."""
        with self._lock:
            if vrnic.session is not None and vrnic.session is not session:
                return
            vrnic.session = None
            published = self._published.pop(vrnic.spec.id, None)
            if published is not None:
                for phys_qpn in published.qpn_by_vqpn.values():
                    self._by_phys.pop((vrnic.phys_gid, phys_qpn), None)

    def hand_over(self, vrnic: VirtualRnic, old: Closeable, new: Closeable, qpns: dict[int, int],
                  mrs: dict[int, MrWindow]) -> None:
        """The vRNIC's guest is served by `new` from now on (its VM migrated): new's QPs (virtual -> physical
        QPN, the same virtual QPNs) and MRs (the same virtual keys) replace old's, in one step."""
        with self._lock:
            if vrnic.session is not old:
                raise Conflict(f"vRNIC {vrnic.spec.id} is no longer served by the migrating session")
            published = self._published.get(vrnic.spec.id)
            if published is None:
                raise Conflict(f"vRNIC {vrnic.spec.id} has nothing published to hand over")
            for phys_qpn in published.qpn_by_vqpn.values():
                self._by_phys.pop((vrnic.phys_gid, phys_qpn), None)
            vrnic.session = new
            published.qpn_by_vqpn = dict(qpns)
            published.mrs = dict(mrs)
            for vqpn, phys_qpn in qpns.items():
                self._by_phys[(vrnic.phys_gid, phys_qpn)] = (vrnic.spec.id, vqpn)

    def move_qp(self, vrnic: VirtualRnic, vqpn: int, old_qpn: int, new_qpn: int) -> None:
        """A QP continues on another physical QP (its peer migrated and it took its pre-set-up one)."""
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is None:
                return
            published.qpn_by_vqpn[vqpn] = new_qpn
            self._by_phys.pop((vrnic.phys_gid, old_qpn), None)
            self._by_phys[(vrnic.phys_gid, new_qpn)] = (vrnic.spec.id, vqpn)

    def log_writes(self, vrnic_id: str, log: DirtyLog | None) -> None:
        """Start (a log) or stop (None) logging peers' RDMA WRITEs and atomics into this vRNIC's memory."""
        with self._lock:
            if log is None:
                self._dirty.pop(vrnic_id, None)
            else:
                self._dirty[vrnic_id] = log

    def note_remote_write(self, vrnic_id: str, address: int, length: int) -> None:
        log = self._dirty.get(vrnic_id)  # one dict lookup on the data path; no lock while nobody migrates
        if log is not None:
            log.mark(address, length)

    def connected_to(self, vrnic_id: str) -> list[VirtualRnic]:
        """Attached vRNICs other than vrnic_id (candidates for holding QPs connected to it)."""
        with self._lock:
            return [v for i, v in self._by_id.items() if i != vrnic_id and v.session is not None]

    def bind_vm(self, vrnic: VirtualRnic, domain: str) -> None:
        """Reserve the vRNIC for a VM's channel: no container guest may attach it until unbind_vm."""
        with self._lock:
            if self._by_id.get(vrnic.spec.id) is not vrnic:
                raise NotFound(f"no vRNIC {vrnic.spec.id} in the backend")
            if vrnic.vm_domain not in (None, domain):
                raise Conflict(f"vRNIC {vrnic.spec.id} is bound to VM {vrnic.vm_domain}", current_state="attached")
            if vrnic.session is not None and vrnic.vm_domain is None:
                raise Conflict(f"vRNIC {vrnic.spec.id} has a container guest attached", current_state="attached")
            vrnic.vm_domain = domain

    def unbind_vm(self, vrnic: VirtualRnic, domain: str) -> None:
        with self._lock:
            if vrnic.vm_domain == domain:
                vrnic.vm_domain = None

    def attached_ids(self) -> set[str]:
        with self._lock:
            return {i for i, v in self._by_id.items() if v.session is not None}

    # ----- what a session publishes --------------------------------------------------------------
    def publish_qp(self, vrnic: VirtualRnic, vqpn: int, phys_qpn: int) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is not None:
                published.qpn_by_vqpn[vqpn] = phys_qpn
                self._by_phys[(vrnic.phys_gid, phys_qpn)] = (vrnic.spec.id, vqpn)

    def withdraw_qp(self, vrnic: VirtualRnic, vqpn: int) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            phys_qpn = None if published is None else published.qpn_by_vqpn.pop(vqpn, None)
            if phys_qpn is not None:
                self._by_phys.pop((vrnic.phys_gid, phys_qpn), None)

    def publish_mr(self, vrnic: VirtualRnic, window: MrWindow) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is not None:
                published.mrs[window.vkey] = window

    def withdraw_mr(self, vrnic: VirtualRnic, vkey: int) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is not None:
                published.mrs.pop(vkey, None)
            # Direct guests that may have cached this key as a peer's rkey must look again.
            for other in self._by_id.values():
                changed = getattr(other.session, "translations_changed", None)
                if other is not vrnic and changed is not None and reachable(other.spec, vrnic.spec):
                    changed()

    # ----- resolving peers -----------------------------------------------------------------------
    def peer(self, asker: VirtualRnic, virtual_gid: str) -> VirtualRnic:
        """The attached vRNIC with that virtual GID, if asker may reach it.

        Anything else looks exactly like a GID that does not exist.
        """
        with self._lock:
            found = next((v for v in self._by_id.values() if v.spec.virtual_gid == virtual_gid), None)
            if found is None or found.session is None or not reachable(asker.spec, found.spec):
                raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}")
            return found

    def peer_qp(self, asker: VirtualRnic, virtual_gid: str, vqpn: int) -> tuple[VirtualRnic, int]:
        """A reachable peer's QP named virtually -> (the peer, the QP's physical QPN)."""
        peer = self.peer(asker, virtual_gid)
        with self._lock:
            published = self._published.get(peer.spec.id)
            phys_qpn = None if published is None else published.qpn_by_vqpn.get(vqpn)
        if phys_qpn is None:
            raise NotFound(f"no QP {vqpn} on {virtual_gid}")
        return peer, phys_qpn

    def peer_mrs(self, peer_id: str) -> PeerMrs:
        return PeerMrs(self, peer_id)

    def virtual_qpn(self, asker: VirtualRnic, phys_qpn: int, phys_gid: str | None) -> int:
        """The virtual QPN of a peer QP seen as a UD source; 0 if unknown, ambiguous or unreachable.

        Physical QPNs are per device, so the source GID narrows the search to one device. Without a GID
        (no GRH) the QPN alone must be unambiguous.
        """
        with self._lock:
            if phys_gid is not None:
                hit = self._by_phys.get((phys_gid, phys_qpn))
                hits = [] if hit is None else [hit]
            else:
                hits = [v for (_, qpn), v in self._by_phys.items() if qpn == phys_qpn]
            reachable_hits = [vqpn for vrnic_id, vqpn in hits
                              if vrnic_id in self._by_id and reachable(asker.spec, self._by_id[vrnic_id].spec)]
        return reachable_hits[0] if len(reachable_hits) == 1 else 0
