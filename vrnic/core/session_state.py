"""A vRNIC session's state as plain data: handles, object tables, quota ledger, identity translations.

No I/O here. Each entry carries the facts about one object (its handle, virtual
key or QPN, ring offsets, who uses it) plus `obj`, the opaque object the RNIC
edge returned for it. The session (vrnic.backend.session) pairs every edge call
with one of the add/take methods below; snapshot() gives everything needed to
re-create the session elsewhere (live migration), without the edge objects.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vrnic.core.guest_phys import MemoryLayout
from vrnic.core.handles import HandleTable, random_word, random_words
from vrnic.core.quota import QuotaLedger, Resource
from vrnic.core.rings import Ring
from vrnic.core.specs import Quota
from vrnic.core.translate import MrWindow
from vrnic.errors import Conflict

VQPN_LIMIT = 1 << 24  # QPNs are 24 bits on the wire
_VQPN_BYTES = ((VQPN_LIMIT - 1).bit_length() + 7) // 8


@dataclass(eq=False)
class PdEntry:
    obj: Any = field(default=None, repr=False)
    handle: int = 0
    users: int = 0  # MRs and QPs on it: a PD in use cannot be deallocated


@dataclass(eq=False)
class CqEntry:
    cqe: int
    ring: Ring | None = field(repr=False)  # None on the direct engine: the guest polls the NIC's own CQ
    ring_addr: int = 0  # where the guest put the ring, in its own addresses
    obj: Any = field(default=None, repr=False)  # the edge's CQ, with its completion channel
    handle: int = 0
    users: int = 0  # QPs using it
    armed: bool = False  # completion notification requested and not yet delivered


@dataclass(eq=False)
class MrEntry:
    window: MrWindow
    pd: PdEntry
    obj: Any = field(default=None, repr=False)
    handle: int = 0


@dataclass(eq=False)
class QpEntry:
    vqpn: int
    qp_type: str  # "rc" or "ud"
    phys_qpn: int
    pd: PdEntry
    send_cq: CqEntry
    recv_cq: CqEntry
    sq: Ring | None = field(repr=False)  # None on the direct engine: the guest posts to the NIC's own queues
    rq: Ring | None = field(repr=False)
    max_sge: int = 1
    max_send_wr: int = 0
    max_recv_wr: int = 0
    sq_addr: int = 0  # where the guest put its rings, in its own addresses
    rq_addr: int = 0
    obj: Any = field(default=None, repr=False)
    handle: int = 0
    state: str = "reset"
    access: int = 0
    qkey: int = 0
    peer_id: str | None = None  # the connected peer vRNIC (RC), whose MRs RDMA may name
    peer_gid: str | None = None  # its virtual identity, as the guest named it
    peer_vqpn: int | None = None
    ahs: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)  # UD address handles
    pending: list[Any] = field(default_factory=list, repr=False)  # WRs not on the NIC yet, in order: refused for
    # lack of room, or waiting for the receives of a local peer whose lock was taken (until peer_wait_until)
    peer_wait_until: float = 0.0
    peer_primed: bool = False  # the peer's receives went to the NIC while the engine waited for its lock
    grh_at: dict[int, int] = field(default_factory=dict, repr=False)  # UD recv wr_id -> address of its GRH
    guard_flow: Any = field(default=None, repr=False)  # the packet guard's flow for this RC QP, when guarded
    # The shared-ring engine's account of what the NIC holds, so a migration can drain and re-post:
    send_fifo: deque[tuple[bool, Any]] = field(default_factory=deque, repr=False)  # posted sends: (signaled, WR)
    recv_fifo: deque[Any] = field(default_factory=deque, repr=False)  # posted receives (guest WRs) in order
    held: bool = False  # a migration holds this QP: the engine leaves its rings alone
    # No one ever wrote either ring's page (each reads as zeros: nothing posted). The engine leaves the rings
    # unread until the guest's next doorbell, and a verb's drain until a look at the file finds one written: a
    # first read faults a page of shared memory in (issue 14).
    blank: bool = False
    link: dict[str, int] = field(default_factory=dict, repr=False)  # RTR/RTS parameters, to reconnect alike
    dest_qpn: int | None = None  # the physical QPN an RC QP is connected to (what QoS classifies it by)
    qos_key: tuple[int, int | None] | None = None  # what QoS tells its packets by (rxe: UDP port, peer QPN)
    qos_rx: int | None = None  # the physical QPN whose arrivals QoS counts as its vRNIC's
    # (the physical QP, the RC timeout vrnicd gave it at RTS): what QoS checks read instead of asking the NIC for
    # every connected QP on every connect (O(N^2) queries for N connects); worth nothing once obj is another QP
    rts_timeout: tuple[Any, int] | None = field(default=None, repr=False)


# ----- snapshots: plain, JSON-able records -------------------------------------------------------------

@dataclass(frozen=True)
class MrRecord:
    handle: int
    pd: int
    vkey: int
    offset: int
    length: int
    access: int


@dataclass(frozen=True)
class CqRecord:
    handle: int
    cqe: int
    ring: int  # address of the guest's CQ ring in its memory


@dataclass(frozen=True)
class QpRecord:
    handle: int
    vqpn: int
    qp_type: str
    pd: int
    send_cq: int
    recv_cq: int
    sq_ring: int
    rq_ring: int
    max_send_wr: int
    max_recv_wr: int
    max_sge: int
    state: str
    access: int
    qkey: int
    peer_gid: str | None
    peer_vqpn: int | None


@dataclass(frozen=True)
class SessionSnapshot:
    """Everything a guest can name in its vRNIC, in creation order, and what it has used of its quota."""

    memory_bytes: int
    pds: tuple[int, ...]
    mrs: tuple[MrRecord, ...]
    cqs: tuple[CqRecord, ...]
    qps: tuple[QpRecord, ...]
    used: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionSnapshot:
        return cls(memory_bytes=int(data["memory_bytes"]), pds=tuple(int(h) for h in data["pds"]),
                   mrs=tuple(MrRecord(**m) for m in data["mrs"]), cqs=tuple(CqRecord(**c) for c in data["cqs"]),
                   qps=tuple(QpRecord(**q) for q in data["qps"]), used=dict(data["used"]))


class SessionState:
    """The tables of one session. Callers hold the session lock; this class only keeps them consistent."""

    def __init__(self, quota: Quota, layout: MemoryLayout) -> None:
        self.quota = quota
        self.layout = layout
        self.ledger = QuotaLedger(quota)
        self.pds: HandleTable[PdEntry] = HandleTable("PD")
        self.cqs: HandleTable[CqEntry] = HandleTable("CQ")
        self.mrs: HandleTable[MrEntry] = HandleTable("MR")
        self.qps: HandleTable[QpEntry] = HandleTable("QP")
        self.mr_by_vkey: dict[int, MrWindow] = {}
        self.qp_by_vqpn: dict[int, QpEntry] = {}
        self.qp_by_phys: dict[int, QpEntry] = {}

    # ----- identities ----------------------------------------------------------------------------
    def locate(self, address: int, length: int, what: str) -> int:
        """The offset in the memory file of a guest range; InvalidArgument unless it is all guest RAM."""
        return self.layout.locate(address, length, what)

    def locate_many(self, addresses: Sequence[int], length: int, what: str) -> list[int]:
        """locate() of each address, for ranges of one length."""
        return self.layout.locate_many(addresses, length, what)

    def new_vkey(self) -> int:
        while True:
            key = random_word() >> 32 or 1
            if key not in self.mr_by_vkey:
                return key

    def new_vkeys(self, count: int) -> list[int]:
        """count distinct virtual MR keys that no MR of the session has, from one draw of randomness."""
        out: list[int] = []
        drawn: set[int] = set()
        while len(out) < count:
            for word in random_words(count - len(out)):
                key = word >> 32 or 1
                if key not in self.mr_by_vkey and key not in drawn:
                    drawn.add(key)
                    out.append(key)
        return out

    def new_vqpn(self) -> int:
        return self.new_vqpns(1)[0]

    def new_vqpns(self, count: int) -> list[int]:
        """count distinct virtual QPNs that no QP of the session has, uniform over [2, VQPN_LIMIT) (0 and 1 are
        special QPNs in verbs), from one draw of randomness for a batch rather than one per QP."""
        out: list[int] = []
        drawn: set[int] = set()
        while len(out) < count:
            raw = secrets.token_bytes(_VQPN_BYTES * (count - len(out)))
            for at in range(0, len(raw), _VQPN_BYTES):
                vqpn = int.from_bytes(raw[at:at + _VQPN_BYTES], "big")
                if 2 <= vqpn < VQPN_LIMIT and vqpn not in self.qp_by_vqpn and vqpn not in drawn:
                    drawn.add(vqpn)
                    out.append(vqpn)
        return out

    # ----- PDs -----------------------------------------------------------------------------------
    def add_pd(self, pd: PdEntry, handle: int | None = None) -> int:
        pd.handle = self._insert(self.pds, pd, handle)
        return pd.handle

    def take_pd(self, handle: object) -> PdEntry:
        pd = self.pds.get(handle)
        if pd.users:
            raise Conflict(f"PD {handle} still has {pd.users} MR(s)/QP(s)", current_state="in_use")
        self.pds.pop(handle)
        self.ledger.refund(Resource.PD)
        return pd

    # ----- MRs -----------------------------------------------------------------------------------
    def add_mr(self, mr: MrEntry, handle: int | None = None) -> int:
        mr.handle = self._insert(self.mrs, mr, handle)
        self._remember_mr(mr)
        return mr.handle

    def add_mrs(self, mrs: list[MrEntry]) -> None:
        """add_mr() of each, new handles drawn at once (a batch's MRs): all of them, or none. _remember_mr's work
        inline: a pool refill adds up to 32 (issue 14)."""
        by_vkey = self.mr_by_vkey
        for mr, handle in zip(mrs, self.mrs.add_many(mrs), strict=True):
            mr.handle = handle
            mr.pd.users += 1
            by_vkey[mr.window.vkey] = mr.window

    def _remember_mr(self, mr: MrEntry) -> None:
        mr.pd.users += 1
        self.mr_by_vkey[mr.window.vkey] = mr.window

    def take_mrs(self, handles: list[int]) -> list[MrEntry]:
        """take_mr() of each, all or none (every handle known and named once), refunded in one charge each."""
        mrs = self.mrs.pop_many(handles)
        for mr in mrs:
            self._forget_mr(mr)
        self.ledger.refund(Resource.MR, len(mrs))
        self.ledger.refund(Resource.PINNED_BYTES, sum(mr.window.length for mr in mrs))
        return mrs

    def take_mr(self, handle: object) -> MrEntry:
        mr = self.mrs.pop(handle)
        self._forget_mr(mr)
        self.ledger.refund(Resource.MR)
        self.ledger.refund(Resource.PINNED_BYTES, mr.window.length)
        return mr

    def _forget_mr(self, mr: MrEntry) -> None:
        """_remember_mr undone (the caller refunds)."""
        self.mr_by_vkey.pop(mr.window.vkey, None)
        mr.pd.users -= 1

    # ----- CQs -----------------------------------------------------------------------------------
    def add_cq(self, cq: CqEntry, handle: int | None = None) -> int:
        cq.handle = self._insert(self.cqs, cq, handle)
        return cq.handle

    def take_cq(self, handle: object) -> CqEntry:
        cq = self.cqs.get(handle)
        if cq.users:
            raise Conflict(f"CQ {handle} is still used by {cq.users} QP(s)", current_state="in_use")
        self.cqs.pop(handle)
        self.ledger.refund(Resource.CQ)
        return cq

    # ----- QPs -----------------------------------------------------------------------------------
    def add_qp(self, qp: QpEntry, handle: int | None = None) -> int:
        qp.handle = self._insert(self.qps, qp, handle)
        self._remember_qp(qp)
        return qp.handle

    def add_qps(self, qps: list[QpEntry]) -> None:
        """add_qp() of each, new handles drawn at once (a batch's QPs): all of them, or none."""
        self._insert_many(self.qps, qps, self._remember_qp)

    def _remember_qp(self, qp: QpEntry) -> None:
        qp.pd.users += 1
        qp.send_cq.users += 1
        qp.recv_cq.users += 1
        self.qp_by_vqpn[qp.vqpn] = qp
        self.qp_by_phys[qp.phys_qpn] = qp

    def take_qp(self, handle: object) -> QpEntry:
        qp = self.qps.pop(handle)
        self._forget_qp(qp)
        return qp

    def _forget_qp(self, qp: QpEntry) -> None:
        self.qp_by_vqpn.pop(qp.vqpn, None)
        self.qp_by_phys.pop(qp.phys_qpn, None)
        qp.pd.users -= 1
        qp.send_cq.users -= 1
        qp.recv_cq.users -= 1
        self.ledger.refund(Resource.QP)

    # ----- everything ----------------------------------------------------------------------------
    def take_all(self) -> tuple[list[QpEntry], list[CqEntry], list[MrEntry], list[PdEntry]]:
        """Empty every table, in the order objects must be destroyed: QPs, CQs, MRs, PDs."""
        qps = [self.take_qp(h) for h, _ in self.qps.items()]
        cqs = [self.take_cq(h) for h, _ in self.cqs.items()]
        mrs = [self.take_mr(h) for h, _ in self.mrs.items()]
        pds = [self.take_pd(h) for h, _ in self.pds.items()]
        return qps, cqs, mrs, pds

    def snapshot(self) -> SessionSnapshot:
        return SessionSnapshot(
            memory_bytes=self.layout.file_bytes,
            pds=tuple(h for h, _ in self.pds.items()),
            mrs=tuple(MrRecord(h, m.pd.handle, m.window.vkey, m.window.offset, m.window.length, int(m.window.access))
                      for h, m in self.mrs.items()),
            cqs=tuple(CqRecord(h, c.cqe, c.ring_addr) for h, c in self.cqs.items()),
            qps=tuple(QpRecord(h, q.vqpn, q.qp_type, q.pd.handle, q.send_cq.handle, q.recv_cq.handle, q.sq_addr,
                               q.rq_addr, q.max_send_wr, q.max_recv_wr, q.max_sge, q.state, q.access, q.qkey,
                               q.peer_gid, q.peer_vqpn)
                      for h, q in self.qps.items()),
            used=self.ledger.used())

    @staticmethod
    def _insert_many(table: HandleTable[Any], entries: list[Any], remember: Callable[[Any], None]) -> None:
        """entries under new handles drawn at once (HandleTable.add_many), each then remembered."""
        for entry, handle in zip(entries, table.add_many(entries), strict=True):
            entry.handle = handle
            remember(entry)

    @staticmethod
    def _insert(table: HandleTable[Any], entry: Any, handle: int | None) -> int:
        if handle is None:
            return table.add(entry)
        table.put(handle, entry)
        return handle

