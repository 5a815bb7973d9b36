"""The vRNICs this vrnicd holds, and the one index through which sessions see each other.

A session never reads another session's tables. It publishes its QPs and MRs
here, and resolves peers here, always under the registry's lock and always
through the reachability rule (vrnic.core.peering.decide: the same VPC, or
security-group rules of both VPCs that allow it). Anything refused looks exactly
like an identity that does not exist, and is audited through the Locator.

Peers this vrnicd does not hold are asked of a PeerDirectory (the owner agent
checks reachability on its side too). Their QPs for UD and their MR windows are
cached for a short while, so the data path does not ask another host per work
request.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from vrnic.backend.peer_directory import Locator, PeerDirectory, RemotePeer
from vrnic.core.migration import DirtyLog
from vrnic.core.peering import Decision, Identity, SecurityRule, decide
from vrnic.core.recovery import token_digest
from vrnic.core.specs import VrnicSpec
from vrnic.core.translate import MrWindow
from vrnic.core.vaddr import parse_virtual_gid
from vrnic.errors import Conflict, InvalidArgument, NotFound, Unavailable, VrnicError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

RULES_TTL_S = 1.0  # security-group changes reach connect-time checks within this
REMOTE_CACHE_S = 1.0  # a remote UD destination or UD source, once resolved, is trusted this long
MR_REFETCH_S = 0.25  # a missing remote key asks the owner again at most this often
MR_TTL_S = 5.0  # remote MR windows are trusted this long: a peer's deregistered MR stops translating by then
AUDIT_QUIET_S = 10.0  # the same refusal (asker, target, action) is written once per this


class Closeable(Protocol):
    def close(self) -> None: ...


class ChangeMark:
    """Moves at every change of any vRNIC's spec and of the vRNICs a registry holds, so that what is kept while it
    stays put (the QoS drain plan, asked at every connect) needs no walk to stay right. Each move draws a new
    number, so a writer that lost a race cannot set the mark back to one a reader kept."""

    _draws = itertools.count(1)
    current = 0

    @classmethod
    def move(cls) -> None:
        cls.current = next(cls._draws)


@dataclass
class VirtualRnic:
    spec: VrnicSpec
    device: str
    token_hash: str  # vrnic.core.recovery.token_digest of the attach token (the token itself is not kept)
    phys_gid: str  # the device's RoCE v2 GID: programmed into peers' QPs, never shown to guests
    gid_index: int
    session: Closeable | None = field(default=None, repr=False)  # the attached guest's session
    vm_domain: str | None = None  # the running VM this vRNIC is bound to; only its channel may attach
    # (the spec it was made from, the identity): every connect asks for both ends' identities
    _identity: tuple[VrnicSpec, Identity] | None = field(default=None, repr=False, compare=False)

    @property
    def vrnic_id(self) -> str:
        return self.spec.id

    @property
    def identity(self) -> Identity:
        kept = self._identity
        if kept is None or kept[0] is not self.spec:  # a new spec (set_qos replaces it) makes it again
            kept = self._identity = (self.spec, identity_of(self.spec))
        return kept[1]

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name == "spec":  # after the new spec is in place: a reader that sees the mark move sees the spec
            ChangeMark.move()


# What a session connects a QP to: a vRNIC of this vrnicd, or one of another host's.
Peer = VirtualRnic | RemotePeer


def identity_of(spec: VrnicSpec) -> Identity:
    return Identity(vrnic_id=spec.id, tenant=spec.tenant, vpc_id=spec.vpc_id, virtual_gid=spec.virtual_gid)


def same_vpc(asker: Identity, target: Identity) -> bool:
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


class RemoteMrs(Mapping[int, MrWindow]):
    """A remote peer's MR windows by virtual key, from the registry's cache (a missing key asks its owner)."""

    def __init__(self, registry: Registry, asker: Identity, peer: RemotePeer) -> None:
        self._registry, self._asker, self._peer = registry, asker, peer

    def __getitem__(self, vkey: int) -> MrWindow:
        return self._registry._remote_window(self._asker, self._peer, vkey)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._registry._remote_windows(self._asker, self._peer)))

    def __len__(self) -> int:
        return len(self._registry._remote_windows(self._asker, self._peer))


@dataclass
class _MrCache:
    fetched_at: float
    windows: dict[int, MrWindow]


class Registry:
    def __init__(self, locator: Locator | None = None, directory: PeerDirectory | None = None) -> None:
        """locator: the cluster's rules, virtual IPs and audit log (None: no rules, same VPC only, no audit);
        directory: peers of other hosts (None: only this vrnicd's vRNICs are peers)."""
        self.locator = locator
        self.directory = directory
        self._rules_cache: tuple[float, list[SecurityRule]] | None = None
        self._audited: dict[tuple[str, str, str], float] = {}
        self._remote: dict[str, RemotePeer] = {}  # remote peers sessions connected to, by vRNIC id
        self._remote_cache: dict[tuple[object, ...], tuple[float, object]] = {}  # UD lookups: (expiry, answer)
        self._mr_cache: dict[tuple[str, str], _MrCache] = {}  # (asker id, peer id) -> windows
        self._by_id: dict[str, VirtualRnic] = {}
        self._by_gid: dict[str, VirtualRnic] = {}  # the same vRNICs by virtual GID: a connect looks its peer up here
        self._published: dict[str, _Published] = {}  # only attached vRNICs
        # Attached vRNICs whose session caches peers' keys (the direct engine): only they hear of a withdrawn MR.
        # Kept as sessions come and go, so a deregistration does not walk every vRNIC of the host (issue 14).
        self._key_cachers: dict[str, VirtualRnic] = {}
        self._by_phys: dict[tuple[str, int], tuple[str, int]] = {}  # (phys GID, phys QPN) -> (vRNIC id, vQPN)
        self._dirty: dict[str, DirtyLog] = {}  # vRNICs whose VM migrates: peers log their writes into it here
        # token digest -> its vRNICs (one; tests may reuse a digest): attach finds its vRNIC without comparing
        # against every vRNIC on the host. The lookup's timing tells nothing of a token: a digest cannot be aimed.
        self._by_token: dict[str, list[VirtualRnic]] = {}
        self._lock = threading.Lock()

    # ----- membership ----------------------------------------------------------------------------
    def add(self, vrnic: VirtualRnic) -> None:
        with self._lock:
            if vrnic.spec.id in self._by_id:
                raise Conflict(f"vRNIC {vrnic.spec.id} already exists in the backend")
            if vrnic.spec.virtual_gid in self._by_gid:
                raise Conflict(f"virtual GID {vrnic.spec.virtual_gid} is already in use")
            self._by_id[vrnic.spec.id] = vrnic
            self._by_gid[vrnic.spec.virtual_gid] = vrnic
            self._by_token.setdefault(vrnic.token_hash, []).append(vrnic)
            ChangeMark.move()

    def remove(self, vrnic_id: str) -> VirtualRnic:
        with self._lock:
            vrnic = self._by_id.pop(vrnic_id, None)
            self._key_cachers.pop(vrnic_id, None)
            if vrnic is not None:
                self._by_gid.pop(vrnic.spec.virtual_gid, None)
                self._drop_token(vrnic)
                ChangeMark.move()
        if vrnic is None:
            raise NotFound(f"no vRNIC {vrnic_id} in the backend")
        return vrnic

    def by_token(self, token: str) -> VirtualRnic:
        digest = token_digest(token)
        with self._lock:
            candidates = list(self._by_token.get(digest, ()))
        for vrnic in candidates:
            if hmac.compare_digest(vrnic.token_hash, digest):
                return vrnic
        raise NotFound("invalid attach token")

    def reissue_token(self, vrnic_id: str) -> str:
        """A new attach token for the vRNIC; the old one stops working now (an attached guest stays)."""
        token = secrets.token_urlsafe(24)
        with self._lock:
            vrnic = self._by_id.get(vrnic_id)
            if vrnic is None:
                raise NotFound(f"no vRNIC {vrnic_id} in the backend")
            self._drop_token(vrnic)
            vrnic.token_hash = token_digest(token)
            self._by_token.setdefault(vrnic.token_hash, []).append(vrnic)
        return token

    def _drop_token(self, vrnic: VirtualRnic) -> None:
        holders = [v for v in self._by_token.get(vrnic.token_hash, ()) if v is not vrnic]
        if holders:
            self._by_token[vrnic.token_hash] = holders
        else:
            self._by_token.pop(vrnic.token_hash, None)

    def get(self, vrnic_id: str) -> VirtualRnic:
        with self._lock:
            vrnic = self._by_id.get(vrnic_id)
        if vrnic is None:
            raise NotFound(f"no vRNIC {vrnic_id} in the backend")
        return vrnic

    def still_holds(self, vrnic: VirtualRnic) -> bool:
        """Is this vRNIC (this very object, not a later one of the same id) still here?"""
        with self._lock:
            return self._by_id.get(vrnic.spec.id) is vrnic

    def session_of(self, vrnic_id: str) -> Closeable | None:
        """The session serving a vRNIC of this vrnicd; None if it has none, or is not here."""
        with self._lock:
            vrnic = self._by_id.get(vrnic_id)
        return None if vrnic is None else vrnic.session

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
            self._set_session(vrnic, session)
            self._published[vrnic.spec.id] = _Published()

    def detach(self, vrnic: VirtualRnic, session: Closeable) -> None:
        """Forget the guest's session and everything it published (idempotent).

        A session that handed the vRNIC over (migration) published nothing that is still its own."""
        with self._lock:
            if vrnic.session is not None and vrnic.session is not session:
                return
            self._set_session(vrnic, None)
            published = self._published.pop(vrnic.spec.id, None)
            if published is not None:
                for phys_qpn in published.qpn_by_vqpn.values():
                    self._by_phys.pop((vrnic.phys_gid, phys_qpn), None)
            # what it cached of remote peers goes with it
            for pair in [k for k in self._mr_cache if k[0] == vrnic.spec.id]:
                del self._mr_cache[pair]
            for key in [k for k in self._remote_cache if k[1] == vrnic.spec.id]:
                del self._remote_cache[key]

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
            self._set_session(vrnic, new)
            published.qpn_by_vqpn = dict(qpns)
            published.mrs = dict(mrs)
            for vqpn, phys_qpn in qpns.items():
                self._by_phys[(vrnic.phys_gid, phys_qpn)] = (vrnic.spec.id, vqpn)

    def adopt(self, vrnic: VirtualRnic, session: Closeable, domain: str, qpns: dict[int, int],
              mrs: dict[int, MrWindow]) -> None:
        """A vRNIC handed over from another host: its VM's session here, its QPs and MRs published in one step."""
        with self._lock:
            if vrnic.session is not None:
                raise Conflict(f"vRNIC {vrnic.spec.id} already has a guest attached", current_state="attached")
            self._set_session(vrnic, session)
            vrnic.vm_domain = domain
            published = self._published[vrnic.spec.id] = _Published()
            published.qpn_by_vqpn = dict(qpns)
            published.mrs = dict(mrs)
            for vqpn, phys_qpn in qpns.items():
                self._by_phys[(vrnic.phys_gid, phys_qpn)] = (vrnic.spec.id, vqpn)

    def _set_session(self, vrnic: VirtualRnic, session: Closeable | None) -> None:
        """Under the lock: the vRNIC's session, and whether it is told of withdrawn MRs."""
        vrnic.session = session
        if getattr(session, "translations_changed", None) is not None:
            self._key_cachers[vrnic.spec.id] = vrnic
        else:
            self._key_cachers.pop(vrnic.spec.id, None)

    def remote_peer(self, vrnic_id: str) -> RemotePeer | None:
        """A peer on another host that a session here connected to (None if none, or if it is held here)."""
        with self._lock:
            return None if vrnic_id in self._by_id else self._remote.get(vrnic_id)

    def learn_remote(self, asker: VirtualRnic, remote: RemotePeer, windows: Iterable[MrWindow]) -> bool:
        """A peer that moved to another host, as its destination published it (vrnic.core.handover.Arrival): kept
        as if looked up, its MR windows as if fetched, if asker may reach it (the same check as peer_qp)."""
        if not self.check(asker.identity, remote.identity, "migration").allowed:
            return False
        with self._lock:
            self._remote[remote.vrnic_id] = remote
            self._mr_cache[(asker.spec.id, remote.vrnic_id)] = _MrCache(time.monotonic(), {w.vkey: w for w in windows})
        return True

    def forget_remote(self, vrnic_id: str, virtual_gid: str) -> None:
        """A peer moved to another host: nothing cached about it (its agent, QPs, MR windows) is true any more."""
        with self._lock:
            self._remote.pop(vrnic_id, None)
            for pair in [k for k in self._mr_cache if k[1] == vrnic_id]:
                del self._mr_cache[pair]
            for key in [k for k in self._remote_cache if virtual_gid in k]:
                del self._remote_cache[key]

    def dirty_log(self, vrnic_id: str) -> DirtyLog | None:
        with self._lock:
            return self._dirty.get(vrnic_id)

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
        self.publish_qps(vrnic, ((vqpn, phys_qpn),))

    def publish_qps(self, vrnic: VirtualRnic, qpns: Iterable[tuple[int, int]]) -> None:
        """Each (virtual QPN, physical QPN) of the vRNIC's, for peers to find."""
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is not None:
                vrnic_id, phys_gid = vrnic.spec.id, vrnic.phys_gid
                for vqpn, phys_qpn in qpns:
                    published.qpn_by_vqpn[vqpn] = phys_qpn
                    self._by_phys[(phys_gid, phys_qpn)] = (vrnic_id, vqpn)

    def withdraw_qp(self, vrnic: VirtualRnic, vqpn: int) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            phys_qpn = None if published is None else published.qpn_by_vqpn.pop(vqpn, None)
            if phys_qpn is not None:
                self._by_phys.pop((vrnic.phys_gid, phys_qpn), None)

    def publish_mr(self, vrnic: VirtualRnic, window: MrWindow) -> None:
        self.publish_mrs(vrnic, (window,))

    def publish_mrs(self, vrnic: VirtualRnic, windows: Iterable[MrWindow]) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is not None:
                published.mrs.update((window.vkey, window) for window in windows)

    def withdraw_mr(self, vrnic: VirtualRnic, vkey: int) -> None:
        self.withdraw_mrs(vrnic, (vkey,))

    def withdraw_mrs(self, vrnic: VirtualRnic, vkeys: Iterable[int]) -> None:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            if published is not None:
                for vkey in vkeys:
                    published.mrs.pop(vkey, None)
            others = [o for o in self._key_cachers.values() if o is not vrnic]
        if not others:
            return
        # Direct guests that may have cached this key as a peer's rkey must look again.
        rules = self._rules_if_needed(vrnic.identity, [o.identity for o in others])
        for other in others:
            changed = getattr(other.session, "translations_changed", None)
            if changed is not None and decide(other.identity, vrnic.identity, rules).allowed:
                changed()

    # ----- reachability ------------------------------------------------------------------------
    def _rules(self) -> list[SecurityRule]:
        if self.locator is None:
            return []
        now = time.monotonic()
        cached = self._rules_cache
        if cached is not None and now - cached[0] < RULES_TTL_S:
            return cached[1]
        try:
            rules = list(self.locator.rules())
        except VrnicError as exc:  # the store is down: keep what we knew, same-VPC traffic does not need it
            log.warning("cannot read the security-group rules (%s); using the last known ones", exc)
            return cached[1] if cached is not None else []
        self._rules_cache = (now, rules)
        return rules

    def _rules_if_needed(self, asker: Identity, targets: list[Identity]) -> list[SecurityRule]:
        """The rules, read only when some pair crosses VPCs (same-VPC checks never touch the store)."""
        return self._rules() if any(not same_vpc(asker, t) for t in targets) else []

    def check(self, asker: Identity, target: Identity, via: str) -> Decision:
        """decide(), with refusals and cross-VPC allows written to the audit log (never under the lock)."""
        # One target: whether the rules are needed is one comparison (the list and any() of _rules_if_needed
        # were a third of a connect's peer lookup under TCG; issue 14)
        decision = decide(asker, target, () if same_vpc(asker, target) else self._rules())
        if decision.cross_vpc and self.locator is not None:
            action = "peer.allowed" if decision.allowed else "peer.refused"
            key = (action, asker.vrnic_id, target.vrnic_id)
            now = time.monotonic()
            if now - self._audited.get(key, -AUDIT_QUIET_S) >= AUDIT_QUIET_S:
                self._audited[key] = now
                if len(self._audited) > 10_000:
                    self._audited.clear()
                try:
                    self.locator.audit(action, asker, target, {"reason": decision.reason, "via": via})
                except VrnicError as exc:
                    log.warning("could not audit %s of %s -> %s: %s", action, asker.vrnic_id, target.vrnic_id, exc)
        if not decision.allowed:
            log.info("peer refused: %s -> %s (%s, %s)", asker.vrnic_id, target.vrnic_id, via, decision.reason)
        return decision

    # ----- resolving peers -----------------------------------------------------------------------
    def local_peer(self, asker: Identity, virtual_gid: str, via: str = "connect") -> VirtualRnic:
        """The attached vRNIC of this vrnicd with that virtual GID, if asker may reach it.

        Anything else looks exactly like a GID that does not exist.
        """
        with self._lock:
            found = self._by_gid.get(virtual_gid)
            attached = found is not None and found.session is not None
        if found is None or not attached or not self.check(asker, found.identity, via).allowed:
            raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}")
        return found

    def holds(self, virtual_gid: str) -> bool:
        """Does this vrnicd hold a vRNIC with that virtual GID (attached or not)?"""
        with self._lock:
            return virtual_gid in self._by_gid

    def peer(self, asker: VirtualRnic, virtual_gid: str) -> VirtualRnic:
        """A reachable attached vRNIC of this vrnicd (see local_peer)."""
        return self.local_peer(asker.identity, virtual_gid)

    def published_qpn(self, vrnic: VirtualRnic, vqpn: int) -> int:
        """The physical QPN of one of vrnic's published QPs; NotFound if it has none by that number."""
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            phys_qpn = None if published is None else published.qpn_by_vqpn.get(vqpn)
        if phys_qpn is None:
            raise NotFound(f"no QP {vqpn} on {vrnic.spec.virtual_gid}")
        return phys_qpn

    def published_mrs(self, vrnic: VirtualRnic) -> list[MrWindow]:
        with self._lock:
            published = self._published.get(vrnic.spec.id)
            return list(published.mrs.values()) if published else []

    def peer_qp(self, asker: VirtualRnic, virtual_gid: str, vqpn: int, via: str = "connect") -> tuple[Peer, int]:
        """A reachable peer's QP named virtually -> (the peer, the QP's physical QPN), here or on another host."""
        if self.directory is None or self.holds(virtual_gid):
            peer = self.local_peer(asker.identity, virtual_gid, via)
            return peer, self.published_qpn(peer, vqpn)
        remote, phys_qpn = self.remote(asker.identity, virtual_gid,
                                       lambda d: d.peer_qp(asker.identity, virtual_gid, vqpn))
        if not self.check(asker.identity, remote.identity, via).allowed:  # this end checks too
            raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}")
        with self._lock:
            self._remote[remote.vrnic_id] = remote
        return remote, phys_qpn

    def peer_qps(self, asker: VirtualRnic, virtual_gid: str, vqpns: list[int]) -> list[tuple[Peer, int]]:
        """peer_qp for several QPs of one peer: a peer this vrnicd holds is looked up and checked once."""
        if self.directory is not None and not self.holds(virtual_gid):
            return [self.peer_qp(asker, virtual_gid, vqpn) for vqpn in vqpns]
        peer = self.local_peer(asker.identity, virtual_gid)
        with self._lock:
            published = self._published.get(peer.spec.id)
            phys = [None if published is None else published.qpn_by_vqpn.get(vqpn) for vqpn in vqpns]
        found: list[tuple[Peer, int]] = []
        for vqpn, phys_qpn in zip(vqpns, phys, strict=True):
            if phys_qpn is None:
                raise NotFound(f"no QP {vqpn} on {peer.spec.virtual_gid}")
            found.append((peer, phys_qpn))
        return found

    def ud_peer(self, asker: VirtualRnic, virtual_gid: str, vqpn: int) -> tuple[Peer, int]:
        """peer_qp for a UD work request: a remote answer (or refusal) is kept for REMOTE_CACHE_S."""
        if self.directory is None or self.holds(virtual_gid):
            return self.peer_qp(asker, virtual_gid, vqpn, via="ud")
        return self._cached(("ud", asker.spec.id, virtual_gid, vqpn),
                            lambda: self.peer_qp(asker, virtual_gid, vqpn, via="ud"))

    def remote(self, asker: Identity, virtual_gid: str, ask: Callable[[PeerDirectory], _T]) -> _T:
        """Ask the directory about a GID this vrnicd does not hold. An unreachable agent is NotFound to an asker
        of another VPC (the GID's existence is none of its business), Unavailable to one of the same VPC."""
        if self.directory is None:
            raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}")
        try:
            return ask(self.directory)
        except Unavailable as exc:
            try:
                vpc_id, _ = parse_virtual_gid(virtual_gid)
            except InvalidArgument:
                vpc_id = -1
            if vpc_id != asker.vpc_id:
                log.warning("peer lookup of %s for %s failed: %s", virtual_gid, asker.vrnic_id, exc)
                raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}") from None
            raise

    def _cached(self, key: tuple[object, ...], compute: Callable[[], _T]) -> _T:
        now = time.monotonic()
        with self._lock:
            hit = self._remote_cache.get(key)
        if hit is not None and hit[0] > now:
            answer = hit[1]
        else:
            try:
                answer = compute()
            except VrnicError as exc:
                answer = exc
            with self._lock:
                if len(self._remote_cache) > 10_000:
                    self._remote_cache.clear()
                self._remote_cache[key] = (now + REMOTE_CACHE_S, answer)
        if isinstance(answer, VrnicError):
            raise answer
        return answer  # type: ignore[return-value]

    def peer_mrs(self, peer_id: str, asker: VirtualRnic | None = None) -> Mapping[int, MrWindow]:
        """A connected peer's MRs by virtual key (asker: who reads them, needed for a remote peer)."""
        with self._lock:
            remote = None if peer_id in self._by_id or asker is None else self._remote.get(peer_id)
        if remote is None or asker is None:
            return PeerMrs(self, peer_id)
        return RemoteMrs(self, asker.identity, remote)

    def _remote_windows(self, asker: Identity, peer: RemotePeer, refetch: bool = False) -> dict[int, MrWindow]:
        key = (asker.vrnic_id, peer.vrnic_id)
        now = time.monotonic()
        with self._lock:
            cached = self._mr_cache.get(key)
        age = now - cached.fetched_at if cached is not None else 0.0
        if cached is not None and age < MR_TTL_S and (not refetch or age < MR_REFETCH_S):
            return cached.windows
        try:
            windows = {w.vkey: w for w in self.remote(asker, peer.identity.virtual_gid,
                                                      lambda d: d.peer_mrs(asker, peer))}
        except VrnicError as exc:  # the WR fails with a remote access error; the next miss asks again
            log.warning("MRs of remote peer %s for %s: %s", peer.vrnic_id, asker.vrnic_id, exc)
            windows = cached.windows if cached is not None else {}
        with self._lock:
            self._mr_cache[key] = _MrCache(now, windows)
        return windows

    def _remote_window(self, asker: Identity, peer: RemotePeer, vkey: int) -> MrWindow:
        window = self._remote_windows(asker, peer).get(vkey)
        if window is None:  # registered after we looked, or never: ask again (not more often than MR_REFETCH_S)
            window = self._remote_windows(asker, peer, refetch=True).get(vkey)
        if window is None:
            raise KeyError(vkey)
        return window

    def virtual_qpn(self, asker: VirtualRnic, phys_qpn: int, phys_gid: str | None) -> int:
        """The virtual QPN of a peer QP seen as a UD source; 0 if unknown, ambiguous or unreachable.

        Physical QPNs are per device, so the source GID narrows the search to one device. Without a GID
        (no GRH) the QPN alone must be unambiguous. A GID of another host's device is asked of its agent.
        """
        return self.reverse(asker.identity, phys_qpn, phys_gid, remote_too=True)

    def reverse(self, asker: Identity, phys_qpn: int, phys_gid: str | None, remote_too: bool = False) -> int:
        with self._lock:
            if phys_gid is not None:
                hit = self._by_phys.get((phys_gid, phys_qpn))
                hits = [] if hit is None else [hit]
            else:
                hits = [v for (_, qpn), v in self._by_phys.items() if qpn == phys_qpn]
            targets = [(self._by_id[vrnic_id].identity, vqpn) for vrnic_id, vqpn in hits if vrnic_id in self._by_id]
            local_gid = phys_gid is None or any(v.phys_gid == phys_gid for v in self._by_id.values())
        rules = self._rules_if_needed(asker, [t for t, _ in targets])
        reachable_hits = [vqpn for target, vqpn in targets if decide(asker, target, rules).allowed]
        if reachable_hits or local_gid or not remote_too or self.directory is None or phys_gid is None:
            return reachable_hits[0] if len(reachable_hits) == 1 else 0
        gid, directory = phys_gid, self.directory
        try:
            return self._cached(("reverse", asker.vrnic_id, gid, phys_qpn),
                                lambda: directory.virtual_qpn(asker, gid, phys_qpn))
        except VrnicError as exc:
            log.debug("UD source %s/%d for %s: %s", gid, phys_qpn, asker.vrnic_id, exc)
            return 0

    # ----- virtual IPs ---------------------------------------------------------------------------
    def resolve_ip(self, asker: VirtualRnic, ip: str) -> str:
        """The virtual GID of the vRNIC with virtual IP `ip` in asker's VPC; NotFound if none."""
        try:
            address = str(ipaddress.ip_address(ip))
        except ValueError:
            raise InvalidArgument(f"not an IP address: {ip!r}") from None
        me = asker.identity
        with self._lock:
            found = next((v.spec.virtual_gid for v in self._by_id.values()
                          if v.spec.virtual_ip == address and same_vpc(me, v.identity)), None)
        if found is None and self.locator is not None:
            try:
                found = self.locator.virtual_gid_of_ip(me, address)
            except VrnicError as exc:
                raise Unavailable(f"cannot resolve {address}: {exc}") from exc
        if found is None:
            raise NotFound(f"no vRNIC with virtual IP {address} in this VPC")
        return found
