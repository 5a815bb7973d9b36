"""One attached guest: its control verbs, checked against its own state and run on its own device context.

Every control verb a guest sends lands in GuestSession.handle(), which checks
handles, ranges and quotas (vrnic.core.session_state), then runs the verb on
the RNIC edge. Peers are reached only through the registry. Closing the session
destroys everything in dependency order: QPs, CQs, MRs, PDs, then the context.
The session does not pick its devices, memory or engine: the driver composes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from pydantic import ValidationError

from vrnic.backend.attachment import PeerCred
from vrnic.backend.cm import ConnectionManager
from vrnic.backend.engine import DataPathEngine, EngineHost
from vrnic.backend.flow_guard import FlowGuard
from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.qos_shaper import QosMechanism
from vrnic.backend.registry import Peer, Registry, VirtualRnic
from vrnic.backend.rnic_edge import PORT, DeviceContext, QpCaps, RtrParams, RtsParams
from vrnic.core import verb_args
from vrnic.core.arena import page_runs
from vrnic.core.handover import QpCarry
from vrnic.core.migration import DirtyLog
from vrnic.core.qos import (
    MAX_PATH_MTU,
    TimedSenders,
    queue_wait_s,
    rc_timeout,
    rc_timeout_floor,
    rc_timeout_outlasts,
    rc_timeout_s,
)
from vrnic.core.quota import Resource
from vrnic.core.rings import CQ_SLOT, HEADER_BYTES, RQ_SLOT, SQ_SLOT, Access, Ring, RingFlags
from vrnic.core.session_state import (
    CqEntry,
    MrEntry,
    PdEntry,
    QpEntry,
    QpRecord,
    SessionSnapshot,
    SessionState,
)
from vrnic.core.translate import MrWindow
from vrnic.errors import Conflict, InvalidArgument, NotFound, QuotaExceeded, VrnicError

log = logging.getLogger(__name__)

# Ops after which the engine must look again at once. Creating or destroying a queue needs no wake-up: a new
# queue has nothing to move until the guest posts (its doorbell wakes the engine, which then arms the new CQ),
# and a destroyed one is gone from the tables the engine reads under the lock. Waking on every create made the
# engine thread compete with the verb for the CPU (issue 14).
ENGINE_OPS = frozenset({"busy_poll"})
RESOLVED_OPS = frozenset({"connect", "modify_qp"})


class QpPlan(NamedTuple):
    """A create_qp checked against its session, before the NIC is asked: what the QP is made from."""

    pd: PdEntry
    send_cq: CqEntry
    recv_cq: CqEntry
    qp_type: str
    caps: QpCaps
    sq: Ring | None = None  # the guest's rings (the shared-ring engine), and where the guest put them
    rq: Ring | None = None
    sq_addr: int = 0
    rq_addr: int = 0


@dataclass
class RcJoins:
    """What an RC QP's RTS reads about its vRNIC, kept through a batch of connects: each is a walk over every
    vRNIC on the device or every QP of the session, repeated per QP, and the drain rate plans every class."""

    drain: int | None  # the class's drain rate (rc_timeout's and the join check's); None: nothing to hold
    connected: int | None = None  # connected RC QPs, the one joining included (None: count them when needed)
    timed: TimedSenders | None = None  # the senders a join check sees (None: walk the QPs when needed)


# connect's path settings (INIT qkey, RTR and RTS): modify_qp's defaults, built once
CONNECT_LINK = verb_args.ModifyQp(qp=1, state="rts")  # the handle is never read

LIVE_SESSIONS: weakref.WeakSet[GuestSession] = weakref.WeakSet()  # for the daemon's debug dump (SIGUSR1)

T = TypeVar("T")
# Access bits as plain ints: a check of IntFlags builds a flag per operation, per MR of a pool refill
_REMOTE_WRITES = int(Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)  # each needs LOCAL_WRITE with it
_LOCAL_WRITE = int(Access.LOCAL_WRITE)


def _within_quota(create: Callable[[T], int], items: Iterable[T]) -> list[int]:
    """create(item) for each item until the quota refuses one: the handles made, at least one (else the quota
    error of the first). The frontend's pools (alloc_pds, create_cqs) take what the quota leaves room for."""
    handles: list[int] = []
    for item in items:
        try:
            handles.append(create(item))
        except QuotaExceeded:
            if not handles:
                raise
            break
    return handles


def _distinct(handles: list[int], op: str, what: str) -> None:
    if len(set(handles)) != len(handles):
        raise InvalidArgument(f"{op} names {what} twice")


def _each_then_first_error(act: Callable[[T], None], items: Iterable[T]) -> None:
    """act(item) for every item, even after one failed; then the first failure, if any, is raised."""
    first: BaseException | None = None
    for item in items:
        try:
            act(item)
        except VrnicError as exc:
            first = first or exc
    if first is not None:
        raise first


def _same_qp(qp: QpEntry, q: QpRecord) -> bool:
    """Is a staged QP the one the record describes (the same guest object, the same shape)?"""
    return (qp.vqpn, qp.qp_type, qp.pd.handle, qp.send_cq.handle, qp.recv_cq.handle, qp.sq_addr, qp.rq_addr,
            qp.max_send_wr, qp.max_recv_wr, qp.max_sge) == (q.vqpn, q.qp_type, q.pd, q.send_cq, q.recv_cq, q.sq_ring,
                                                            q.rq_ring, q.max_send_wr, q.max_recv_wr, q.max_sge)


class GuestSession:
    def __init__(self, vrnic: VirtualRnic, registry: Registry, device: DeviceContext, memory: GuestMemory,
                 cred: PeerCred, doorbell_fd: int, notify_fd: int | None,
                 engine_factory: Callable[[EngineHost], DataPathEngine],
                 disconnect: Callable[[], None] = lambda: None, guard: FlowGuard | None = None,
                 qos: QosMechanism | None = None, cm: ConnectionManager | None = None,
                 qos_drain_kbit: Callable[[], int | None] | None = None,
                 give_back_device: Callable[[DeviceContext], None] | None = None) -> None:
        """give_back_device: takes the device context when the session closes as its vRNIC's session (it closes
        the context, or keeps it for the next guest); without it the session closes the context itself."""
        self.vrnic = vrnic
        self.vrnic_id = vrnic.spec.id
        self.registry = registry
        self.device = device
        self.give_back_device = give_back_device
        self.memory = memory
        self.cred = cred
        self.doorbell_fd = doorbell_fd
        self.notify_fd = notify_fd
        self.disconnect = disconnect
        self.guard = guard
        self.qos = qos  # its vRNIC's QoS on its device, when enforced: every connected QP is classified
        # the rate its QoS class drains at on its device, shaping now or not (None: the device shapes nothing)
        self.qos_drain_kbit = qos_drain_kbit
        self.cm = cm if cm is not None else ConnectionManager()  # the driver's: listeners of all its vRNICs
        self.lock = threading.RLock()
        self.state = SessionState(vrnic.spec.quota, memory.layout)
        self._closed = False
        self.dirty: DirtyLog | None = None  # while its VM migrates: what the NIC and vrnicd wrote
        self.staged = False  # a migration's destination session: built, not yet published or serving
        self.engine = engine_factory(self)
        self._may_run = self._engine_running = False
        self._engine_due = False  # a verb made the first QP: the engine starts once its reply is out
        # The least RC timeout (0, none, aside) vrnicd has given any QP of this session at RTS, never raised again:
        # a lower bound on every timeout the NIC holds for them, which lets a connect skip the walk of the join check
        self._least_timeout: int | None = None
        # QPs whose rings' pages no one ever wrote, by handle: unread until the guest's next doorbell, or until a
        # verb's look at the file finds one written
        self._blank_qps: dict[int, QpEntry] = {}
        LIVE_SESSIONS.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Let the engine run. Its thread starts with the first QP: until then it has nothing to move, and
        starting and stopping it cost more than a whole attach without QPs (issue 14)."""
        self._may_run = True
        if len(self.state.qps):
            self._engine_due = True
            self.after_reply()

    def _engine_wanted(self) -> None:
        """A verb made a QP: the engine is due, unless it runs. Its thread starts after the verb's reply
        (after_reply): a new thread took 2.6 ms of a first create_qps in the lab, and until the guest has its QPs
        it posts nothing."""
        if self._may_run and not self._engine_running:
            self._engine_due = True

    def after_reply(self) -> None:
        """What a request's reply need not wait for; the channel calls it once the reply is out (and the next
        request, or a VM's doorbell, does if no one did)."""
        if self._engine_due:
            self._engine_due = False
            if self._may_run and not self._engine_running and not self._closed:
                self._engine_running = True
                try:
                    self.engine.start()
                except Exception:  # no thread (RuntimeError): the guest's data path cannot run, its session ends
                    log.exception("vRNIC %s: the data-path engine did not start", self.vrnic_id)
                    self.engine_failed()

    # ----- dispatch ----------------------------------------------------------------------------
    def handle(self, op: str, raw_args: dict[str, Any]) -> dict[str, Any]:
        if self._engine_due:  # a caller that did not run after_reply
            self.after_reply()
        schema = verb_args.OPS.get(op)
        if schema is None or op == "attach":
            raise InvalidArgument(f"unknown operation {op!r}")
        try:
            args = schema.model_validate(raw_args)
        except ValidationError as exc:  # reported as one line: the first problem
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            message = first["msg"].removeprefix("Value error, ")  # a check of the whole message names no field
            raise InvalidArgument(f"{op}: {where}: {message}" if where else f"{op}: {message}") from None
        if op in verb_args.UNLOCKED_OPS:  # they wait on peers: the engine must not wait with them
            if self._closed:
                raise Conflict("the session is closed", current_state="detached")
            unlocked: dict[str, Any] = getattr(self, f"op_{op}")(args)
            return unlocked
        # A peer on another host is looked up before the lock is taken: the engine does not wait for that agent.
        resolved: Any = self._remote_peer(args) if op in RESOLVED_OPS else None
        if isinstance(args, verb_args.ConnectQps) and self.registry.directory is not None:
            resolved = [self._remote_peer(c) for c in args.each()]
        with self.lock:
            if self._closed:
                raise Conflict("the session is closed", current_state="detached")
            result: dict[str, Any] = (getattr(self, f"op_{op}")(args) if resolved is None
                                      else getattr(self, f"op_{op}")(args, resolved=resolved))
        if op in ENGINE_OPS:
            self.engine.wake()
        return result

    def debug_state(self) -> dict[str, Any]:
        """The engine's counters and every QP as vrnicd and its rings see it (the daemon's SIGUSR1 dump). Reads
        without the lock when the lock stays taken: a dump must not hang on the stall it is meant to show."""
        locked = self.lock.acquire(timeout=2.0)
        try:
            stats = getattr(self.engine, "stats", None)
            qps = []
            for _, qp in list(self.state.qps.items()):
                entry: dict[str, Any] = {
                    "vqpn": qp.vqpn, "phys_qpn": qp.phys_qpn, "dest_qpn": qp.dest_qpn, "state": qp.state,
                    "peer_vqpn": qp.peer_vqpn, "held": qp.held, "pending": len(qp.pending),
                    "send_fifo": len(qp.send_fifo), "recv_fifo": len(qp.recv_fifo)}
                for name, ring in (("sq", qp.sq), ("rq", qp.rq)):
                    if ring is not None:
                        with contextlib.suppress(VrnicError):
                            entry[f"{name}_waiting"] = ring.count()
                with contextlib.suppress(Exception):  # a dump reports what it can
                    entry["nic_state"] = self.device.query_qp_state(qp.obj)
                qps.append(entry)
            cqs = []
            for _, cq in list(self.state.cqs.items()):
                info: dict[str, Any] = {"handle": cq.handle, "armed": cq.armed}
                if cq.ring is not None:
                    with contextlib.suppress(VrnicError):
                        info["ring_waiting"] = cq.ring.count()
                    info["ring_flags"] = int(cq.ring.flags)
                cqs.append(info)
            return {"vrnic_id": self.vrnic_id, "closed": self._closed, "lock_taken_by_other": not locked,
                    "engine": stats() if stats is not None else type(self.engine).__name__, "qps": qps, "cqs": cqs}
        finally:
            if locked:
                self.lock.release()

    def ring_doorbell(self) -> None:
        """The doorbell of a guest that cannot write our eventfd itself (a VM: a message on its channel)."""
        if self._engine_due:
            self.after_reply()
        with contextlib.suppress(OSError):
            os.eventfd_write(self.doorbell_fd, 1)

    def attach_result(self) -> dict[str, Any]:
        """What the guest needs to start. Its limits are query_device's (clipped to the quota, with what is used):
        the quota and arena size this used to carry were read by no guest, and each attach encoded and decoded
        them (issue 14)."""
        spec = self.vrnic.spec
        # shape_batches: create_qps takes one shape, connect_qps one peer's lists; teardown_batches: dereg_mrs and
        # destroy_qps exist (a guest library falls back to one item or object per request with a vrnicd that does
        # not say so)
        return {"vrnic_id": spec.id, "virtual_gid": spec.virtual_gid, "virtual_ip": spec.virtual_ip, "engine": "ring",
                "shape_batches": True, "teardown_batches": True}

    def attach_fds(self) -> list[int]:
        """Descriptors that go back to the guest with the attach reply (the direct engine's uverbs fd)."""
        return []

    # ----- queries -----------------------------------------------------------------------------
    def op_query_device(self, _: verb_args.NoArgs) -> dict[str, Any]:
        attr = self.device.query_device()
        quota = self.vrnic.spec.quota
        # The guest sees the device's limits clipped to its quota, and no physical identifiers.
        return {"max_qp": min(attr.max_qp, quota.max_qps), "max_cq": min(attr.max_cq, quota.max_cqs),
                "max_mr": min(attr.max_mr, quota.max_mrs), "max_pd": min(attr.max_pd, quota.max_pds),
                "max_cqe": min(attr.max_cqe, quota.max_cqe), "max_qp_wr": min(attr.max_qp_wr, quota.max_wr),
                "max_sge": min(attr.max_sge, 4), "max_pinned_bytes": quota.max_pinned_bytes,
                "arena_bytes": self.memory.size, "atomic_caps": attr.atomic_caps, "phys_port_cnt": 1,
                "quota_used": self.state.ledger.used()}

    def op_query_port(self, args: verb_args.QueryPort) -> dict[str, Any]:
        if args.port != PORT:
            raise InvalidArgument(f"a vRNIC has one port (1), not {args.port}")
        attr = self.device.query_port(PORT)
        return {"state": attr.state, "active_mtu": attr.active_mtu, "max_mtu": attr.max_mtu, "gid_tbl_len": 1}

    def op_query_gid(self, args: verb_args.QueryGid) -> dict[str, Any]:
        if args.port != PORT or args.index != 0:
            raise InvalidArgument("a vRNIC has one GID: port 1, index 0")
        return {"gid": self.vrnic.spec.virtual_gid}

    # ----- PD ----------------------------------------------------------------------------------
    def op_alloc_pd(self, _: verb_args.NoArgs, handle: int | None = None) -> dict[str, Any]:
        with self.state.ledger.reserve((Resource.PD, 1)):
            pd = PdEntry(self.device.alloc_pd())
            try:
                self.state.add_pd(pd, handle)
            except BaseException:
                self.device.destroy(pd.obj)
                raise
        return {"pd": pd.handle}

    def op_alloc_pds(self, args: verb_args.AllocPds) -> dict[str, Any]:
        """Up to args.count PDs within the quota, at least one (else the quota error of the first)."""
        return {"pds": _within_quota(lambda _: self.op_alloc_pd(verb_args.NoArgs())["pd"], range(args.count))}

    def op_dealloc_pd(self, args: verb_args.PdRef) -> dict[str, Any]:
        self.device.destroy(self.state.take_pd(args.pd).obj)
        return {}

    # ----- MR ----------------------------------------------------------------------------------
    def op_reg_mr(self, args: verb_args.RegMr, handle: int | None = None, vkey: int | None = None) -> dict[str, Any]:
        return self._reg_mr(args.pd, args.addr, args.length, args.access, handle, vkey)

    def _require_allocated(self, offsets: list[int], length: int) -> list[list[int]]:
        """Refuse to register a container guest's pages it has not allocated: vrnicd's registration would allocate
        them, charged to vrnicd's memory cgroup, not the guest's (GuestMemory.unallocated_page). The frontend
        faults a buffer's pages in before it registers it (Context.provision). A VM's RAM is QEMU's: not checked.
        The runs of pages looked at (page_runs), none for a VM."""
        if not self.memory.guest_allocates:
            return []
        runs = page_runs([(at, at + length) for at in offsets])
        page = self.memory.first_unallocated(runs)
        if page is not None:
            raise InvalidArgument(f"the MR covers arena pages the guest never allocated (offset {page:#x}): "
                                  "write its pages (or madvise MADV_POPULATE_WRITE) before registering it, so that "
                                  "they count against the guest's own memory limit")
        return runs

    def _reg_mr(self, pd_handle: int, addr: int, length: int, access_bits: int, handle: int | None = None,
                vkey: int | None = None) -> dict[str, Any]:
        """reg_mr of fields its schema (RegMr, or RegMrs for each of a pool's MRs) has checked."""
        pd = self.state.pds.get(pd_handle)
        at = self.state.locate(addr, length, "MR")
        if access_bits & _REMOTE_WRITES and not access_bits & _LOCAL_WRITE:
            raise InvalidArgument("remote write or atomic access needs LOCAL_WRITE too")
        if handle is None:  # the guest's request (a restore re-registers what was registered before)
            self._require_allocated([at], length)
        with self.state.ledger.reserve((Resource.MR, 1), (Resource.PINNED_BYTES, length)):
            mr = self._enter_mr(pd, addr, at, length, access_bits, Access(access_bits), handle, vkey)
        window = mr.window
        if not self.staged:
            self.registry.publish_mr(self.vrnic, window)
        return {"mr": mr.handle, "lkey": window.vkey, "rkey": window.vkey, "addr": addr, "length": length}

    def _enter_mr(self, pd: PdEntry, addr: int, at: int, length: int, access_bits: int, access: Access,
                  handle: int | None = None, vkey: int | None = None) -> MrEntry:
        """The NIC's MR of the guest's [addr, +length) (at `at` in its memory file), entered in the state; the
        NIC's MR is destroyed again if it cannot be entered. The caller has charged the quota."""
        registered = self.device.reg_mr(pd.obj, self.memory.base + at, length, access_bits)
        try:
            mr = self._new_mr(pd, addr, at, length, access, registered, vkey or self.state.new_vkey())
            self.state.add_mr(mr, handle)
        except BaseException:
            self.device.destroy(registered[0])
            raise
        return mr

    def _new_mr(self, pd: PdEntry, addr: int, at: int, length: int, access: Access,
                registered: tuple[Any, int, int], vkey: int) -> MrEntry:
        """The entry of a registration of the guest's [addr, +length), not yet in the state."""
        obj, lkey, rkey = registered
        base = self.memory.base + at - addr  # WRs name the MR by guest address; base turns one into vrnicd's
        return MrEntry(MrWindow(vkey=vkey, offset=addr, length=length, access=access, phys_lkey=lkey,
                                phys_rkey=rkey, base=base), pd, obj)

    def op_reg_mrs(self, args: verb_args.RegMrs) -> dict[str, Any]:
        """An MR at each of args.addrs, up to the quota (at least one, else the quota error of the first): the
        frontend's pool of MRs of that shape. Every address is checked before any MR is made; any failure takes
        back the MRs already made and is raised.

        One pass for the batch, not reg_mr per MR: the PD, the access check and the quota once, the windows
        published at once. Per MR, what is left is the NIC's registration and the tables (issue 14: vrnicd's
        Python was more than half of a 32-MR refill under TCG)."""
        pd = self.state.pds.get(args.pd)
        length, access_bits = args.length, args.access
        if access_bits & _REMOTE_WRITES and not access_bits & _LOCAL_WRITE:
            raise InvalidArgument("remote write or atomic access needs LOCAL_WRITE too")
        addrs = args.addrs
        offsets = self.state.locate_many(addrs, length, "MR")
        runs = self._require_allocated(offsets, length)
        ledger = self.state.ledger
        count = ledger.charge_up_to(len(offsets), (Resource.MR, 1), (Resource.PINNED_BYTES, length))
        if runs and count < len(offsets):  # the quota cut the pool short: only the pages of the MRs it allows
            runs = page_runs([(at, at + length) for at in offsets[:count]])
        # The NIC's registrations back to back, then the tables, as create_qps does: under TCG a registration runs
        # slower with vrnicd's Python between it and the next (lab, a 32-MR reg_mrs in turns: 9.8 -> 8.5 ms; issue 14)
        reg_mr, base = self.device.reg_mr, self.memory.base
        registered: list[tuple[Any, int, int]] = []
        try:
            # A pool's pages are new to vrnicd's mapping: one madvise maps them all, where each registration
            # would fault its page in (lab: a registration after the first 0.150 -> 0.106 ms). Not for reg_mr:
            # a 1 MiB MR the guest registers again and again lies on pages already mapped here, and the
            # madvise's walk of them cost its loop 0.5 ms (issue 14, session 45).
            self.memory.map_in(runs)
            for at in offsets[:count]:
                registered.append(reg_mr(pd.obj, base + at, length, access_bits))
            # _new_mr's entries, built inline with positional fields: a Python call less per MR (issue 14)
            access = Access(access_bits)
            made = [MrEntry(MrWindow(vkey, addr, length, access, lkey, rkey, base + at - addr), pd, obj)
                    for addr, at, (obj, lkey, rkey), vkey in zip(addrs, offsets[:count], registered,
                                                                 self.state.new_vkeys(count), strict=False)]
            self.state.add_mrs(made)  # all or none
        except BaseException:
            self._destroy_quietly(obj for obj, _lkey, _rkey in registered)
            ledger.refund(Resource.MR, count)
            ledger.refund(Resource.PINNED_BYTES, count * length)
            raise
        if not self.staged:
            self.registry.publish_mrs(self.vrnic, [mr.window for mr in made])
        return {"mrs": [mr.handle for mr in made], "keys": [mr.window.vkey for mr in made]}

    def op_dereg_mr(self, args: verb_args.MrRef) -> dict[str, Any]:
        self._dereg_mr(args.mr)
        return {}

    def _dereg_mr(self, handle: int) -> None:
        mr = self.state.take_mr(handle)
        self.registry.withdraw_mr(self.vrnic, mr.window.vkey)
        self.device.destroy(mr.obj)

    def op_dereg_mrs(self, args: verb_args.DeregMrs) -> dict[str, Any]:
        """dereg_mr of each: every handle is checked before any MR goes. Each MR leaves the session even if the
        NIC refuses one of them (as dereg_mr's does); the first such error is raised once all were tried. The
        windows are withdrawn at once, before the NIC lets go of any MR, as dereg_mr's is."""
        _distinct(args.mrs, "dereg_mrs", "an MR")
        taken = self.state.take_mrs(args.mrs)  # all known, or none taken
        self.registry.withdraw_mrs(self.vrnic, [mr.window.vkey for mr in taken])
        _each_then_first_error(self.device.destroy, [mr.obj for mr in taken])
        return {"deregistered": len(args.mrs)}

    # ----- CQ ----------------------------------------------------------------------------------
    def _ring(self, address: int | None, entries: int, slot_size: int, slot: Any, what: str) -> Ring:
        if address is None:
            raise InvalidArgument(f"the shared-ring engine needs the address of the {what}")
        at = self.state.locate(address, Ring.bytes_needed(entries, slot_size), what)
        return Ring(self.memory.view, at, entries, slot, self.memory.words)

    def op_create_cq(self, args: verb_args.CreateCq, handle: int | None = None) -> dict[str, Any]:
        self.state.ledger.check_cqe(args.cqe)
        ring = self._ring(args.ring, args.cqe, CQ_SLOT.size, CQ_SLOT, "CQ ring")
        with self.state.ledger.reserve((Resource.CQ, 1)):
            cq = CqEntry(args.cqe, ring, args.ring or 0, self.device.create_cq(args.cqe))
            try:
                self.state.add_cq(cq, handle)
            except BaseException:
                self.device.destroy(cq.obj)
                raise
        if handle is None:  # a restored CQ keeps what its guest has not polled yet
            self._reset_rings([ring])
        return {"cq": cq.handle, "cqe": args.cqe}

    def op_create_cqs(self, args: verb_args.CreateCqs) -> dict[str, Any]:
        """A CQ of args.cqe entries on each ring, up to the quota (at least one, else the quota error of the
        first): the frontend's pool of CQs of that size."""
        cqs = _within_quota(lambda ring: self.op_create_cq(verb_args.CreateCq.model_construct(cqe=args.cqe,
                                                                                              ring=ring))["cq"],
                            args.rings)
        return {"cqs": cqs, "cqe": args.cqe}

    def op_destroy_cq(self, args: verb_args.CqRef) -> dict[str, Any]:
        self.device.destroy(self.state.take_cq(args.cq).obj)
        return {}

    # ----- QP ----------------------------------------------------------------------------------
    def op_create_qp(self, args: verb_args.CreateQp, handle: int | None = None,
                     vqpn: int | None = None) -> dict[str, Any]:
        plan = self._plan_qp(args)
        with self.state.ledger.reserve((Resource.QP, 1)):
            qp = self._qp_entry(plan, self._make_qp(plan), vqpn)
            try:
                self.state.add_qp(qp, handle)
            except BaseException:
                self.device.destroy(qp.obj)
                raise
        if handle is None:  # a restored QP keeps its rings
            self._note_blank([qp], self._reset_rings([qp.sq, qp.rq]))
        self._open_qp(qp)
        self._engine_wanted()
        return self._qp_reply(qp)

    def _plan_qp(self, args: verb_args.CreateQp) -> QpPlan:
        return self._placed(self._plan_shape(args), args.sq_ring, args.rq_ring)

    def _plan_shape(self, shape: verb_args.QpShape) -> QpPlan:
        """A QP's PD, CQs and sizes checked against the session (nothing made yet)."""
        state = self.state
        pd = state.pds.get(shape.pd)
        send_cq, recv_cq = state.cqs.get(shape.send_cq), state.cqs.get(shape.recv_cq)
        state.ledger.check_wr(shape.max_send_wr)
        state.ledger.check_wr(shape.max_recv_wr)
        return QpPlan(pd, send_cq, recv_cq, shape.qp_type,
                      QpCaps(shape.max_send_wr, shape.max_recv_wr, shape.max_sge))

    def _placed(self, plan: QpPlan, sq_addr: int | None, rq_addr: int | None) -> QpPlan:
        """The plan with the guest's rings at those addresses, checked to lie in its memory."""
        for address, what in ((sq_addr, "SQ ring"), (rq_addr, "RQ ring")):
            if address is None:
                raise InvalidArgument(f"the shared-ring engine needs the address of the {what}")
        assert sq_addr is not None and rq_addr is not None
        return self._placed_many(plan, [sq_addr, rq_addr], 1)[0]

    def _placed_many(self, plan: QpPlan, rings: list[int] | None, count: int) -> list[QpPlan]:
        """_placed for count QPs of one shape, their rings at rings (each QP's send ring, then its receive ring),
        with what the shape decides worked out once: a create_qps of 32 QPs placed 64 rings one call chain each,
        a fifth of vrnicd's Python for the batch (issue 14)."""
        if rings is None:
            raise InvalidArgument("the shared-ring engine needs the address of the SQ ring")
        caps, locate, view, words = plan.caps, self.state.locate, self.memory.view, self.memory.words
        sq_bytes = Ring.bytes_needed(caps.max_send_wr, SQ_SLOT.size)
        rq_bytes = Ring.bytes_needed(caps.max_recv_wr, RQ_SLOT.size)
        sq_addrs, rq_addrs = rings[0:2 * count:2], rings[1:2 * count:2]
        sqs = [Ring(view, locate(addr, sq_bytes, "SQ ring"), caps.max_send_wr, SQ_SLOT, words) for addr in sq_addrs]
        rqs = [Ring(view, locate(addr, rq_bytes, "RQ ring"), caps.max_recv_wr, RQ_SLOT, words) for addr in rq_addrs]
        pd, send_cq, recv_cq, qp_type = plan.pd, plan.send_cq, plan.recv_cq, plan.qp_type
        return [QpPlan(pd, send_cq, recv_cq, qp_type, caps, sq, rq, sq_addr, rq_addr)
                for sq, rq, sq_addr, rq_addr in zip(sqs, rqs, sq_addrs, rq_addrs, strict=True)]

    def _make_qp(self, plan: QpPlan) -> tuple[Any, int]:
        """The NIC's QP and its physical QPN."""
        return self.device.create_qp(plan.pd.obj, plan.send_cq.obj, plan.recv_cq.obj, plan.qp_type, plan.caps)

    def _qp_entry(self, plan: QpPlan, made: tuple[Any, int], vqpn: int | None = None) -> QpEntry:
        obj, phys_qpn = made
        caps = plan.caps
        return QpEntry(vqpn or self.state.new_vqpn(), plan.qp_type, phys_qpn, plan.pd, plan.send_cq, plan.recv_cq,
                       plan.sq, plan.rq, max_sge=caps.max_sge, max_send_wr=caps.max_send_wr,
                       max_recv_wr=caps.max_recv_wr, sq_addr=plan.sq_addr, rq_addr=plan.rq_addr, obj=obj)

    def _reset_rings(self, rings: Iterable[Ring | None]) -> set[Ring]:
        """Empty new rings (a zero header), but only where the guest's memory was ever written: the rest reads
        as zeros already, and a first write there would fault a page in for vrnicd, 20-50 us each under TCG, two
        per QP (issue 14). A batch's rings lie side by side in fresh memory: one look at the file for all. The
        rings left alone are returned: blank, empty for as long as no one writes their page."""
        placed = [ring for ring in rings if ring is not None]
        written = self.memory.holds_data([(ring.offset, ring.offset + HEADER_BYTES) for ring in placed])
        blank = set()
        for ring, held in zip(placed, written, strict=True):
            if held:
                ring.reset()
            else:
                blank.add(ring)
        return blank

    def _note_blank(self, qps: Iterable[QpEntry], blank: set[Ring]) -> None:
        """The QPs both of whose rings are blank: the engine leaves them unread (a read faults a page of shared
        memory in as a write does) until the guest's next doorbell (read_blank_qps), or until a verb's look at the
        file finds the guest wrote one (look_at_blank_qps)."""
        for qp in qps:
            if qp.sq in blank and qp.rq in blank:
                qp.blank = True
                self._blank_qps[qp.handle] = qp

    def look_at_blank_qps(self, qps: Iterable[QpEntry] | None = None) -> None:
        """Of the blank QPs (all of them, or those among qps), those whose guest has written a ring's page since
        are blank no more: one look at the file for all (the caller holds the lock). A verb's drain looks before
        it reads, so that connecting a batch of fresh QPs pages none of their rings in."""
        blank = self._blank_qps
        if not blank:
            return
        if qps is None:
            candidates = list(blank.values())
        else:
            candidates = [qp for qp in qps if qp.blank]
            if not candidates:
                return
        spans = []
        for qp in candidates:
            assert qp.sq is not None and qp.rq is not None  # only a QP with both rings is ever blank
            spans += [(qp.sq.offset, qp.sq.offset + HEADER_BYTES), (qp.rq.offset, qp.rq.offset + HEADER_BYTES)]
        written = self.memory.holds_data(spans)
        for n, qp in enumerate(candidates):
            if written[2 * n] or written[2 * n + 1]:
                qp.blank = False
                blank.pop(qp.handle, None)

    def read_blank_qps(self) -> None:
        """The guest rang its doorbell (or the engine's idle timeout passed, for a guest that never rings): the
        engine reads every QP's rings from now on, the blank ones' too (those never written fault their pages in
        once, then). Looking at the file for which ones were written, at every doorbell, cost 47-125 us a look under
        TCG for as long as any QP stayed blank, and a pool's spares may stay blank for the session's life: a fifth
        more on a shared-ring SEND's latency (issue 14). So a blank QP is left unread only until the guest's next
        doorbell: through its create and connect, which is what a setup of many QPs does."""
        blank = self._blank_qps
        if blank:
            for qp in blank.values():
                qp.blank = False
            blank.clear()

    def _open_qp(self, qp: QpEntry) -> None:
        self._open_qps([qp])

    def _open_qps(self, qps: list[QpEntry]) -> None:
        """QPs just entered in the state, their rings ready, made ready for their guest: their QPNs published at
        once."""
        for qp in qps:
            if qp.qp_type == "ud":  # a UD QP sends with the port it was created with, to anyone
                self._classify(qp, None)
        if not self.staged:
            self.registry.publish_qps(self.vrnic, [(qp.vqpn, qp.phys_qpn) for qp in qps])

    def _qp_reply(self, qp: QpEntry) -> dict[str, Any]:
        return {"qp": qp.handle, "qpn": qp.vqpn}

    def _qps_reply(self, qps: list[QpEntry]) -> dict[str, Any]:
        """create_qps' reply to one shape: the handles and QPNs, in the order asked."""
        return {"qps": [qp.handle for qp in qps], "qpns": [qp.vqpn for qp in qps]}

    def op_destroy_qp(self, args: verb_args.QpRef) -> dict[str, Any]:
        self._destroy_qps([args.qp])
        return {}

    def op_destroy_qps(self, args: verb_args.DestroyQps) -> dict[str, Any]:
        """destroy_qp of each, in one request."""
        _distinct(args.qps, "destroy_qps", "a QP")
        self._destroy_qps(args.qps)
        return {"destroyed": len(args.qps)}

    def _destroy_qps(self, handles: list[int]) -> None:
        """Every handle is checked before any QP goes. Program order, as for modify_qp: WRs the guest posted before
        destroying a QP reach the NIC first (a native post_send has put them there on return), rather than vanish
        with the rings, and every completion the QPs left is in their CQs' rings on return. Each QP leaves the
        session even if the NIC refuses one of them; the first such error is raised once all were tried."""
        qps = [self.state.qps.get(handle) for handle in handles]
        self.engine.drain_queues(qps)
        try:
            _each_then_first_error(lambda handle: self._destroy_qp(self.state.take_qp(handle)), handles)
        finally:
            # Only a QP with WRs on the NIC can have left completions there: polling the CQs of one that holds
            # none (most closes, a pool's spares) was a sixth of a destroy_qp in the lab (issue 14).
            self.engine.settle_cqs(cq for qp in qps if qp.send_fifo or qp.recv_fifo
                                   for cq in (qp.send_cq, qp.recv_cq))

    def _destroy_qp(self, qp: QpEntry, publish: bool = True) -> None:
        self._blank_qps.pop(qp.handle, None)
        if publish:
            self.registry.withdraw_qp(self.vrnic, qp.vqpn)
        self.device.destroy(qp.obj, *qp.ahs.values())
        if self.guard is not None:
            self.guard.drop(qp.guard_flow)
        self._unclassify(qp)

    def op_query_qp(self, args: verb_args.QpRef) -> dict[str, Any]:
        qp = self.state.qps.get(args.qp)
        answer = {"qpn": qp.vqpn, "state": self.device.query_qp_state(qp.obj), "qp_type": qp.qp_type,
                  "connected_to": qp.peer_gid}
        if qp.qp_type == "rc":  # the NIC's, which vrnicd may have raised above the guest's (rc_timeout)
            answer["timeout"] = self.device.query_rc_timeout(qp.obj)
        return answer

    def op_modify_qp(self, args: verb_args.ModifyQp, resolved: tuple[Peer, int] | None = None) -> dict[str, Any]:
        """resolved: the peer and physical QPN of an RTR, looked up beforehand without the session lock."""
        qp = self.state.qps.get(args.qp)
        # Program order: WRs the guest posted before this call reach the NIC before the transition
        # (a receive posted, then ERR, must be flushed, not lost in the ring). Only this QP's: the others' WRs
        # do not depend on its state, and draining all of them made connecting N QPs cost O(N^2).
        self.engine.drain_queues([qp])
        if args.state == "init":
            self._to_init(qp, args.access, args.qkey)
        elif args.state == "rtr" and qp.qp_type == "ud":
            self.device.qp_to_rtr(qp.obj, qp.qp_type, None)  # UD destinations come per WR
        elif args.state == "rtr":
            self._to_rtr(qp, resolved or self._resolve(args.remote_gid, args.remote_qpn), args.remote_gid,
                         args.remote_qpn, args)
        elif args.state == "rts":
            self._to_rts(qp, args)
        else:
            self.device.qp_to_state(qp.obj, args.state)
            if args.state == "reset":
                if qp.qp_type == "rc":
                    self._unclassify(qp)
                qp.peer_id = qp.peer_gid = qp.peer_vqpn = None
                if self.guard is not None:
                    self.guard.drop(qp.guard_flow)
                qp.guard_flow = None
                for ring in (qp.sq, qp.rq):
                    if ring is not None:
                        ring.reset()
                qp.pending.clear()
        qp.state = args.state
        return {"state": args.state}

    def _to_init(self, qp: QpEntry, access: int, qkey: int) -> None:
        self.device.qp_to_init(qp.obj, qp.qp_type, access, qkey)
        qp.access, qp.qkey = access, qkey

    def _to_rtr(self, qp: QpEntry, resolved: tuple[Peer, int], remote_gid: str | None, remote_qpn: int | None,
                link: verb_args.ModifyQp) -> None:
        """An RC QP to RTR towards the resolved peer QP (the guest's virtual name for it; link: path settings)."""
        peer, phys_qpn = resolved
        flow = None
        if self.guard is not None:  # the guard lets this QP's packets out to that peer QP, and nowhere else
            flow = self.guard.flow(self.vrnic_id, self.vrnic.phys_gid, qp.phys_qpn, peer.phys_gid, phys_qpn)
            if flow != qp.guard_flow:
                self.guard.allow(flow)
        try:
            self.device.qp_to_rtr(qp.obj, qp.qp_type, RtrParams(
                dgid=peer.phys_gid, sgid_index=self.vrnic.gid_index, path_mtu=link.path_mtu, dest_qpn=phys_qpn,
                rq_psn=link.rq_psn, max_dest_rd_atomic=link.max_dest_rd_atomic, min_rnr_timer=link.min_rnr_timer))
        except BaseException:
            if self.guard is not None and flow != qp.guard_flow:
                self.guard.drop(flow)
            raise
        if self.guard is not None and qp.guard_flow not in (None, flow):
            self.guard.drop(qp.guard_flow)
        qp.guard_flow = flow
        qp.dest_qpn = phys_qpn
        self._classify(qp, phys_qpn)
        qp.peer_id, qp.peer_gid, qp.peer_vqpn = peer.vrnic_id, remote_gid, remote_qpn
        qp.link.update(path_mtu=link.path_mtu, max_dest_rd_atomic=link.max_dest_rd_atomic,
                       min_rnr_timer=link.min_rnr_timer)

    def _to_rts(self, qp: QpEntry, link: verb_args.ModifyQp, batch: RcJoins | None = None) -> None:
        if batch is None and qp.qp_type == "rc":
            batch = RcJoins(self._drain_kbit())  # once for the timeout and the check: it plans the device's classes
        timeout = self.rc_timeout(qp.qp_type, qp.link.get("path_mtu", link.path_mtu), link.timeout, batch)
        if batch is not None and batch.drain is not None and self._join_may_outlast(batch.timed, batch.drain):
            self._refuse_outlasting_join(qp, batch.drain)  # the walk, which names the QPs it would outlast
        self.device.qp_to_rts(qp.obj, qp.qp_type, RtsParams(sq_psn=link.sq_psn, timeout=timeout,
                                                            retry_cnt=link.retry_cnt, rnr_retry=link.rnr_retry,
                                                            max_rd_atomic=link.max_rd_atomic))
        self._note_timeout(qp.qp_type, timeout)
        qp.rts_timeout = (qp.obj, timeout)
        qp.link.update(timeout=link.timeout, retry_cnt=link.retry_cnt, rnr_retry=link.rnr_retry,
                       max_rd_atomic=link.max_rd_atomic)
        if batch is not None and batch.timed is not None:
            batch.timed.add(timeout, qp.link.get("path_mtu", 1024))  # as rc_timeouts_outlasted sees it from now

    def rc_timeout(self, qp_type: str, path_mtu: int, asked: int, batch: RcJoins | None = None) -> int:
        """The RC timeout a physical QP gets: the guest's, raised so that its packets waiting in the QoS queue
        never make rxe retransmit (vrnic.core.qos.rc_timeout_floor: every connected RC QP of this vRNIC, this
        one included, with its packets in flight ahead, drained at the class's rate). batch: the drain rate and
        that count, when the caller keeps them (each costs a walk over every vRNIC or QP)."""
        if qp_type != "rc":
            return asked
        drain = batch.drain if batch is not None else self._drain_kbit()
        if drain is None:
            return asked
        connected = batch.connected if batch is not None else None
        if connected is None:
            # Every QP of the session is at least every connected one: if even that many cannot raise the floor
            # above the asked timeout, no count of connected QPs can, and the walk that counts them is spared.
            if asked == 0 or rc_timeout_floor(path_mtu, max(len(self.state.qps), 1), drain) <= asked:
                return asked
            connected = self._rc_connected()
        return rc_timeout(asked, rc_timeout_floor(path_mtu, max(connected, 1), drain))

    def _note_timeout(self, qp_type: str, timeout: int) -> None:
        if qp_type == "rc" and timeout and (self._least_timeout is None or timeout < self._least_timeout):
            self._least_timeout = timeout

    def _join_may_outlast(self, timed: TimedSenders | None, drain: int) -> bool:
        """Whether one more sender might make the class's queue outlast a connected QP's timeout: exactly, from
        the senders a batch keeps; else a bound, which clears most connects without a walk over every QP (the
        session's QPs are at least the senders with the joining one, none has a larger MTU than the largest, and
        none was given a timeout under the least one ever given)."""
        if timed is not None:
            return timed.outlasted_by_one_more(drain)
        least = self._least_timeout
        return least is not None and not rc_timeout_outlasts(
            least, queue_wait_s(MAX_PATH_MTU, len(self.state.qps), drain))

    def rc_timeouts_outlasted(self, drain_kbit: int, joining: QpEntry | None = None) -> list[tuple[int, int, float]]:
        """The connected RC QPs whose timeout, as the NIC holds it, a class draining at drain_kbit would outlast
        with all their packets in flight waiting in its queue: (virtual QPN, timeout, that wait in s). joining: a QP
        about to reach RTS, whose packets count in the queue (its own timeout is the floor's business)."""
        with self.lock:
            timed = self._timed_qps(leaving_out=() if joining is None else (joining,))
            senders = len(timed) + (joining is not None)
            outlasted = []
            for qp in timed:
                wait = queue_wait_s(qp.link.get("path_mtu", 1024), senders, drain_kbit)
                timeout = self._rc_timeout_held(qp)
                if not rc_timeout_outlasts(timeout, wait):
                    outlasted.append((qp.vqpn, timeout, wait))
            return outlasted

    def _rc_timeout_held(self, qp: QpEntry) -> int:
        """The RC timeout the NIC holds for the QP: the one vrnicd set at RTS on this very physical QP, else asked
        of the NIC (a QP that moved to a shadow, or reached RTS another way)."""
        held = qp.rts_timeout
        if held is not None and held[0] is qp.obj:
            return held[1]
        return self.device.query_rc_timeout(qp.obj)

    def _timed_qps(self, leaving_out: Iterable[QpEntry]) -> list[QpEntry]:
        """The connected RC QPs whose timeouts the NIC holds (RTS, SQD): the senders a join is weighed against."""
        out = {id(q) for q in leaving_out}
        return [q for q in self._connected_rc_qps() if q.state in ("rts", "sqd") and id(q) not in out]

    def _timed_senders(self, leaving_out: Iterable[QpEntry]) -> TimedSenders:
        """_timed_qps as a batch keeps them."""
        timed = TimedSenders()
        for qp in self._timed_qps(leaving_out):
            timed.add(self._rc_timeout_held(qp), qp.link.get("path_mtu", 1024))
        return timed

    def _refuse_outlasting_join(self, qp: QpEntry, drain: int) -> None:
        """Refuse to connect one more RC QP into a class whose queue, with its packets in flight too, would outlast
        the timeout of a QP already connected: RTS cannot raise that timeout, and rxe would break the QP."""
        outlasted = self.rc_timeouts_outlasted(drain, joining=qp)
        if outlasted:
            vqpn, timeout, wait_s = outlasted[0]
            raise Conflict(
                f"connecting RC QP {qp.vqpn} would make the packets in flight of vRNIC {self.vrnic_id}'s RC QPs wait "
                f"{wait_s * 1000:.0f} ms in its QoS class (draining at {drain} kbit/s), longer than the RC timeout of "
                f"{len(outlasted)} connected QP(s) (QP {vqpn}: {timeout}, {rc_timeout_s(timeout) * 1000:.0f} ms), "
                f"which RTS cannot raise; rxe would break them. Connect those with a longer timeout, keep fewer RC "
                f"QPs connected, or lift the class's rate", current_state="rc_timeout_too_short")

    def _drain_kbit(self) -> int | None:
        return self.qos_drain_kbit() if self.qos_drain_kbit is not None else None

    def _connected_rc_qps(self) -> list[QpEntry]:
        return [q for _, q in self.state.qps.items() if q.qp_type == "rc" and q.dest_qpn is not None]

    def _rc_connected(self) -> int:
        return len(self._connected_rc_qps())

    def _classify(self, qp: QpEntry, dest_qpn: int | None, obj_qpn: int | None = None) -> None:
        """Put the QP's packets (to dest_qpn; None for UD) in its vRNIC's QoS class."""
        if self.qos is None:
            return
        qpn = qp.phys_qpn if obj_qpn is None else obj_qpn
        key = self.qos.flow_key(qpn, dest_qpn)
        if qp.qos_key is not None and qp.qos_key != key:
            self.qos.unclassify(self.vrnic_id, qp.qos_key)
        self.qos.classify(self.vrnic_id, key)
        qp.qos_key = key
        if qp.qos_rx != qpn:  # and what arrives for it is counted as the vRNIC's
            if qp.qos_rx is not None:
                self.qos.uncount_received(self.vrnic_id, qp.qos_rx)
            self.qos.count_received(self.vrnic_id, qpn)
            qp.qos_rx = qpn

    def use_qos(self, qos: QosMechanism | None) -> None:
        """QoS was switched on (or off) for this vRNIC's device: classify (or unclassify) what is connected."""
        with self.lock:
            if qos is self.qos:
                return
            for _, qp in self.state.qps.items():
                self._unclassify(qp)
            self.qos = qos
            for _, qp in self.state.qps.items():
                if qp.qp_type == "ud":
                    self._classify(qp, None)
                elif qp.state in ("rtr", "rts") and qp.dest_qpn is not None:
                    self._classify(qp, qp.dest_qpn)

    def _unclassify(self, qp: QpEntry) -> None:
        if self.qos is not None and qp.qos_key is not None:
            self.qos.unclassify(self.vrnic_id, qp.qos_key)
            qp.qos_key = None
        if self.qos is not None and qp.qos_rx is not None:
            self.qos.uncount_received(self.vrnic_id, qp.qos_rx)
            qp.qos_rx = None

    def _resolve(self, remote_gid: str | None, remote_qpn: int | None) -> tuple[Peer, int]:
        """Virtual (GID, QPN) of a peer -> the peer vRNIC and its physical QPN (MasQ-style, at connect)."""
        if remote_gid is None or remote_qpn is None:
            raise InvalidArgument("RTR needs remote_gid and remote_qpn (the peer's virtual identity)")
        return self.registry.peer_qp(self.vrnic, remote_gid, remote_qpn)

    def _remote_peer(self, args: Any) -> tuple[Peer, int] | None:
        """For connect and an RC QP's RTR: the peer and its physical QPN if another host holds it (else None:
        a local peer is looked up under the lock, as the connect-time check always was)."""
        if isinstance(args, verb_args.ModifyQp) and args.state != "rtr":
            return None
        gid, vqpn = args.remote_gid, args.remote_qpn
        if gid is None or vqpn is None or self.registry.directory is None or self.registry.holds(gid):
            return None
        qp = self.state.qps.get(args.qp)
        if qp.qp_type != "rc":
            return None
        return self.registry.peer_qp(self.vrnic, gid, vqpn)

    def op_connect(self, args: verb_args.Connect, resolved: tuple[Peer, int] | None = None) -> dict[str, Any]:
        """INIT, RTR and RTS with the default path settings (CONNECT_LINK), as three modify_qp would do them; the
        guest's earlier WRs reach the NIC first. The QP's state is each step's, so a failure leaves it there."""
        qp = self.state.qps.get(args.qp)
        if qp.qp_type != "rc":
            raise InvalidArgument("connect is for RC QPs; UD QPs name their peer per work request")
        self.engine.drain_queues([qp])
        self._to_init(qp, args.access, CONNECT_LINK.qkey)
        qp.state = "init"
        self._to_rtr(qp, resolved or self._resolve(args.remote_gid, args.remote_qpn), args.remote_gid,
                     args.remote_qpn, CONNECT_LINK)
        qp.state = "rtr"
        self._to_rts(qp, CONNECT_LINK)
        qp.state = "rts"
        return {"state": "rts"}

    def op_null_rpc(self, _: verb_args.NoArgs) -> dict[str, Any]:
        """An empty round trip through the whole dispatch (checks, lock): the floor under every verb."""
        return {}

    def op_create_qps(self, args: verb_args.CreateQps) -> dict[str, Any]:
        """Several create_qp in one request: all of them, or none (the first failure is raised).

        Every QP is checked first (one shape once), then the NIC's QPs are made back to back, then entered. Under
        TCG a verb run between Python steps costs more than one run after another (lab, 64 RC QPs: pyverbs' create
        0.37 against 0.23 ms), so interleaving them cost 16 of 110 ms for two guests' 64 QPs (issue 14)."""
        if args.qps is not None:
            plans = [self._plan_qp(item) for item in args.qps]
        else:
            assert args.shape is not None and args.count is not None  # the schema holds one form or the other
            plans = self._placed_many(self._plan_shape(args.shape), args.rings, args.count)
        ledger = self.state.ledger
        ledger.charge(Resource.QP, len(plans))
        made: list[tuple[Any, int]] = []
        try:
            for plan in plans:
                made.append(self._make_qp(plan))
        except BaseException:
            self._destroy_quietly(obj for obj, _ in made)
            ledger.refund(Resource.QP, len(plans))
            raise
        entered: list[QpEntry] = []
        try:
            blank = self._reset_rings(ring for plan in plans for ring in (plan.sq, plan.rq))
            qps = [self._qp_entry(plan, one, vqpn)
                   for plan, one, vqpn in zip(plans, made, self.state.new_vqpns(len(plans)), strict=True)]
            self.state.add_qps(qps)  # all or none
            entered = qps
            self._open_qps(entered)
            self._note_blank(entered, blank)
        except BaseException:
            for qp in entered:  # taking it refunds its charge
                with contextlib.suppress(VrnicError):
                    self._destroy_qp(self.state.take_qp(qp.handle))
            self._destroy_quietly(obj for obj, _ in made[len(entered):])
            ledger.refund(Resource.QP, len(made) - len(entered))
            raise
        self._engine_wanted()
        if args.qps is not None:
            return {"qps": [self._qp_reply(qp) for qp in entered]}
        return self._qps_reply(entered)

    def _resolve_all(self, connections: list[verb_args.Connection],
                     resolved: list[tuple[Peer, int] | None] | None) -> list[tuple[Peer, int]]:
        """Each connection's peer and physical QPN (those not resolved beforehand), each peer looked up once."""
        peers: list[tuple[Peer, int] | None] = list(resolved) if resolved is not None else [None] * len(connections)
        by_gid: dict[str, list[int]] = {}
        for index, (c, peer) in enumerate(zip(connections, peers, strict=True)):
            if peer is None:
                by_gid.setdefault(c.remote_gid, []).append(index)
        for gid, indexes in by_gid.items():
            found = self.registry.peer_qps(self.vrnic, gid, [connections[i].remote_qpn for i in indexes])
            for index, one in zip(indexes, found, strict=True):
                peers[index] = one
        return [peer for peer in peers if peer is not None]

    def _destroy_quietly(self, objs: Iterable[Any]) -> None:
        for obj in objs:
            with contextlib.suppress(VrnicError):
                self.device.destroy(obj)

    def op_connect_qps(self, args: verb_args.ConnectQps,
                       resolved: list[tuple[Peer, int] | None] | None = None) -> dict[str, Any]:
        """Several connect in one request: all of them, or none (those connected go back to RESET).

        The QPs move together: every INIT, then every RTR, then every RTS, so each step's verbs run back to back
        (lab, two guests' 64 pairs: 40 -> 33 ms against one QP's three steps after another; issue 14)."""
        connections = args.each()
        _distinct([c.qp for c in connections], "connect_qps", "a QP")
        qps = [self.state.qps.get(c.qp) for c in connections]  # every QP is checked before any moves
        if any(qp.qp_type != "rc" for qp in qps):
            raise InvalidArgument("connect is for RC QPs; UD QPs name their peer per work request")
        was_reset = [qp.state == "reset" for qp in qps]
        joining = [qp.dest_qpn is None for qp in qps]  # counted once connected, as rc_timeout counts them
        drain = self._drain_kbit()
        connected = self._rc_connected() if drain is not None else 0
        batch = RcJoins(drain, connected, None if drain is None else self._timed_senders(leaving_out=qps))
        peers = self._resolve_all(connections, resolved)  # a peer that is not there moves no QP
        try:
            self.engine.drain_queues(qps)  # the guest's earlier WRs reach the NIC first, as in connect
            for c, qp in zip(connections, qps, strict=True):
                self._to_init(qp, c.access, CONNECT_LINK.qkey)
                qp.state = "init"
            for c, qp, peer in zip(connections, qps, peers, strict=True):
                self._to_rtr(qp, peer, c.remote_gid, c.remote_qpn, CONNECT_LINK)
                qp.state = "rtr"
            for qp, joins in zip(qps, joining, strict=True):
                connected += joins
                batch.connected = connected
                self._to_rts(qp, CONNECT_LINK, batch)
                qp.state = "rts"
        except BaseException:
            for qp, reset in zip(qps, was_reset, strict=True):
                if reset and qp.state != "reset":
                    with contextlib.suppress(VrnicError):
                        self.op_modify_qp(verb_args.ModifyQp(qp=qp.handle, state="reset"))
            raise
        return {"state": "rts", "connected": len(qps)}

    def op_resolve_rkey(self, _: verb_args.ResolveRkey) -> dict[str, Any]:
        raise InvalidArgument("resolve_rkey is for the direct engine; on this one vrnicd translates keys itself")

    def op_translations(self, _: verb_args.NoArgs) -> dict[str, Any]:
        raise InvalidArgument("translations are for the direct engine; on this one vrnicd translates itself")

    # ----- virtual IPs and connection requests (rdma_cm style; see vrnic.backend.cm) ----------------
    # These run without the session lock around them (UNLOCKED_OPS): they wait on other guests and hosts.
    def op_resolve_ip(self, args: verb_args.ResolveIp) -> dict[str, Any]:
        return {"gid": self.registry.resolve_ip(self.vrnic, args.ip)}

    def op_cm_listen(self, args: verb_args.CmPort) -> dict[str, Any]:
        self.cm.listen(self.vrnic_id, args.port, self)
        return {"port": args.port}

    def op_cm_unlisten(self, args: verb_args.CmPort) -> dict[str, Any]:
        self.cm.unlisten(self.vrnic_id, args.port, self)
        return {}

    def op_cm_get_request(self, args: verb_args.CmGetRequest) -> dict[str, Any]:
        request = self.cm.get_request(self.vrnic_id, args.port, self, args.timeout_ms / 1000)
        if request is None:
            return {"request": None}
        return {"request": {"id": request.id, "port": request.port, "remote_gid": request.asker.virtual_gid,
                            "private_data": request.private_data.hex()}}

    def op_cm_accept(self, args: verb_args.CmAccept) -> dict[str, Any]:
        request = self.cm.claim(self.vrnic_id, args.request, self)
        gid = request.asker.virtual_gid
        try:
            qp = self._cm_qp(args.qp)
            resolved = self.registry.peer_qp(self.vrnic, gid, request.vqpn, via="cm accept")
            with self.lock:
                self._bring_up(qp, gid, request.vqpn, args.access, resolved)
        except BaseException as exc:
            log.warning("vRNIC %s: accepting connection request %d from %s failed: %s", self.vrnic_id, request.id,
                        gid, exc)
            self.cm.answer(request, None, "the listener could not connect its QP")
            raise
        if not self.cm.answer(request, (qp.vqpn, bytes.fromhex(args.private_data))):
            raise Conflict("the connecting side stopped waiting", current_state="timeout")
        return {"remote_gid": gid, "remote_qpn": request.vqpn, "state": "rts"}

    def op_cm_reject(self, args: verb_args.CmReject) -> dict[str, Any]:
        self.cm.answer(self.cm.claim(self.vrnic_id, args.request, self), None, "rejected by the listener")
        return {}

    def op_cm_connect(self, args: verb_args.CmConnect) -> dict[str, Any]:
        qp = self._cm_qp(args.qp)
        gid = self.registry.resolve_ip(self.vrnic, args.ip)
        me, private, timeout = self.vrnic.identity, bytes.fromhex(args.private_data), args.timeout_ms / 1000
        registry = self.registry
        if registry.directory is None or registry.holds(gid):
            target = registry.local_peer(me, gid, "cm connect")
            remote_qpn, answer = self.cm.connect(me, target.spec.id, args.port, qp.vqpn, private, timeout)
        else:
            remote_qpn, answer = registry.remote(
                me, gid, lambda d: d.cm_connect(me, gid, args.port, qp.vqpn, private, timeout))
        resolved = registry.peer_qp(self.vrnic, gid, remote_qpn, via="cm connect")
        with self.lock:
            self._bring_up(qp, gid, remote_qpn, args.access, resolved)
        return {"remote_gid": gid, "remote_qpn": remote_qpn, "private_data": answer.hex(), "state": "rts"}

    def _cm_qp(self, handle: int) -> QpEntry:
        """An RC QP of this session that is not connected yet (what a connection request may connect)."""
        with self.lock:
            if self._closed:
                raise Conflict("the session is closed", current_state="detached")
            qp = self.state.qps.get(handle)
            if qp.qp_type != "rc":
                raise InvalidArgument("connection requests are for RC QPs")
            if qp.state not in ("reset", "init"):
                raise Conflict(f"QP {qp.vqpn} is already {qp.state}", current_state=qp.state)
            return qp

    def _bring_up(self, qp: QpEntry, gid: str, vqpn: int, access: int, resolved: tuple[Peer, int]) -> None:
        """INIT (unless the guest moved it there already, with its own access flags), RTR, RTS towards a peer QP
        resolved beforehand (the caller holds the lock now)."""
        if self._closed:
            raise Conflict("the session is closed", current_state="detached")
        if self.state.qps.get(qp.handle) is not qp:
            raise NotFound(f"QP {qp.vqpn} was destroyed")
        for state in ("init", "rtr", "rts") if qp.state == "reset" else ("rtr", "rts"):
            self.op_modify_qp(verb_args.ModifyQp(qp=qp.handle, state=state, access=access, remote_gid=gid,
                                                 remote_qpn=vqpn), resolved=resolved if state == "rtr" else None)

    def op_busy_poll(self, args: verb_args.BusyPoll) -> dict[str, Any]:
        self.engine.busy_poll = args.enabled
        return {"busy_poll": args.enabled}

    def op_sync(self, _: verb_args.NoArgs) -> dict[str, Any]:
        """Post everything waiting in the guest's rings now: afterwards the NIC holds those WRs."""
        return {"posted": self.engine.drain_queues()}

    def op_detach(self, _: verb_args.NoArgs) -> dict[str, Any]:
        return {}

    # ----- the engine's view (EngineHost) -------------------------------------------------------
    def ud_destination(self, qp: QpEntry, virtual_gid: str, vqpn: int) -> tuple[Any, int]:
        peer, phys_qpn = self.registry.ud_peer(self.vrnic, virtual_gid, vqpn)
        key = (peer.phys_gid, phys_qpn)
        ah = qp.ahs.get(key)
        if ah is None:
            ah = qp.ahs[key] = self.device.create_ah(qp.pd.obj, peer.phys_gid, self.vrnic.gid_index)
        return ah, phys_qpn

    def peer_mrs(self, qp: QpEntry) -> Mapping[int, MrWindow] | None:
        return None if qp.peer_id is None else self.registry.peer_mrs(qp.peer_id, self.vrnic)

    def post_peer_receives(self, qp: QpEntry, wait: float = 0.0) -> bool:
        """Before qp's SENDs go out, the receives its peer's guest already posted go to the NIC, when the peer is a
        QP of this vrnicd connected back to qp. The peer's own engine posts them too, but the two engines race: a
        SEND that arrives first is refused (RNR NAK) and rxe sends it again a timer tick later (4 ms at least),
        which held the shared-ring engine's ping-pong at 10 ms. Waits for the peer's lock only as long as `wait`,
        and only a caller that holds no lock may wait (the peer's engine may be waiting for this one's)."""
        peer = self._local_peer(qp)
        if peer is None:
            return True  # on another host (the network gives its engine time), or not attached
        taken = peer.lock.acquire(timeout=wait) if wait > 0 else peer.lock.acquire(blocking=False)
        if not taken:
            peer.engine.wake()  # whoever holds it, the peer's engine looks at its receives again soon
            return False
        try:
            target = None if peer.closed else peer.state.qp_by_vqpn.get(qp.peer_vqpn)  # type: ignore[arg-type]
            if target is not None and target.peer_id == self.vrnic_id and target.peer_vqpn == qp.vqpn:
                peer.engine.post_receives(target)
        finally:
            peer.lock.release()
        return True

    def _local_peer(self, qp: QpEntry) -> GuestSession | None:
        if qp.peer_id is None or qp.peer_vqpn is None:
            return None
        peer = self.registry.session_of(qp.peer_id)
        return peer if isinstance(peer, GuestSession) else None

    def source_vqpn(self, phys_qpn: int, phys_gid: str | None) -> int:
        return self.registry.virtual_qpn(self.vrnic, phys_qpn, phys_gid)

    def nic_writes(self, address: int, length: int) -> None:
        dirty = self.dirty
        if dirty is not None:
            dirty.mark(address, length)

    def remote_writes(self, qp: QpEntry, address: int, length: int) -> None:
        if qp.peer_id is not None:
            self.registry.note_remote_write(qp.peer_id, address, length)

    def engine_failed(self) -> None:
        """Mark every ring failed, wake the guest, end its connection (which closes this session)."""
        with self.lock:
            if self._closed:
                return
            rings = [cq.ring for _, cq in self.state.cqs.items()] + [qp.sq for _, qp in self.state.qps.items()]
            for ring in rings:
                with contextlib.suppress(Exception):  # a corrupt ring must not stop the others being marked
                    if ring is not None:
                        ring.set_flag(RingFlags.FAILED)
            if self.notify_fd is not None:
                with contextlib.suppress(OSError):
                    os.eventfd_write(self.notify_fd, 1)
        self.disconnect()

    # ----- snapshot and restore -----------------------------------------------------------------
    def snapshot(self) -> SessionSnapshot:
        with self.lock:
            self.engine.drain_queues()
            return self.state.snapshot()

    def restore(self, snapshot: SessionSnapshot) -> None:
        """Re-create a snapshot's objects here with the same handles, keys and QPNs (an empty session only).

        RC QPs whose peer is reachable are brought back to the state they were in; others stay in
        RESET and the guest reconnects them.
        """
        if snapshot.memory_bytes != self.memory.size:
            raise InvalidArgument(f"the snapshot is of {snapshot.memory_bytes} bytes of guest memory, "
                                  f"this session has {self.memory.size}")
        with self.lock:
            if any(len(t) for t in (self.state.pds, self.state.cqs, self.state.mrs, self.state.qps)):
                raise Conflict("restore needs an empty session", current_state="in_use")
            for handle in snapshot.pds:
                self.op_alloc_pd(verb_args.NoArgs(), handle=handle)
            for m in snapshot.mrs:
                self.op_reg_mr(verb_args.RegMr(pd=m.pd, addr=m.offset, length=m.length, access=m.access),
                               handle=m.handle, vkey=m.vkey)
            for c in snapshot.cqs:
                self.op_create_cq(verb_args.CreateCq(cqe=c.cqe, ring=c.ring), handle=c.handle)
            for q in snapshot.qps:
                # Validated like a guest's request: a snapshot comes from another host.
                args = verb_args.CreateQp.model_validate(
                    {"pd": q.pd, "send_cq": q.send_cq, "recv_cq": q.recv_cq, "qp_type": q.qp_type,
                     "max_send_wr": q.max_send_wr, "max_recv_wr": q.max_recv_wr, "max_sge": q.max_sge,
                     "sq_ring": q.sq_ring, "rq_ring": q.rq_ring})
                self.op_create_qp(args, handle=q.handle, vqpn=q.vqpn)
            for q in snapshot.qps:
                steps = {"init": 1, "rtr": 2, "rts": 3}.get(q.state, 0)
                if q.qp_type == "rc" and steps >= 2 and q.peer_gid is None:
                    steps = 1
                for state in ("init", "rtr", "rts")[:steps]:
                    self.op_modify_qp(verb_args.ModifyQp(qp=q.handle, state=state, access=q.access,  # type: ignore[arg-type]
                                                         qkey=q.qkey, remote_gid=q.peer_gid, remote_qpn=q.peer_vqpn))
        self.engine.wake()

    # ----- live migration (vrnic.backend.vm_migration drives these) -------------------------------
    def hold(self, qps: list[QpEntry] | None = None) -> None:
        """Stop moving the guest's WRs to these QPs (all by default); completions keep flowing."""
        with self.lock:
            for qp in qps if qps is not None else [q for _, q in self.state.qps.items()]:
                qp.held = True

    def release(self, qps: list[QpEntry] | None = None) -> None:
        with self.lock:
            for qp in qps if qps is not None else [q for _, q in self.state.qps.items()]:
                qp.held = False
        self.engine.wake()

    def outstanding_sends(self, qps: list[QpEntry] | None = None) -> int:
        """Sends on the NIC that have not completed yet."""
        with self.lock:
            return sum(len(q.send_fifo) for q in (qps if qps is not None else [q for _, q in self.state.qps.items()]))

    def qps_connected_to(self, vrnic_id: str) -> list[QpEntry]:
        with self.lock:
            return [q for _, q in self.state.qps.items() if q.peer_id == vrnic_id]

    def reconnect(self, qp: QpEntry, resolved: tuple[Peer, int] | None = None) -> tuple[int, int]:
        """Point a held RC QP at its peer's current physical QP (the peer migrated): reset, connect again with
        the same parameters, post again the receives the reset dropped and queue again the sends it dropped.
        Returns how many of each."""
        with self.lock:
            self.engine.settle()
            recvs = list(qp.recv_fifo)
            qp.recv_fifo.clear()
            # Sends still on the NIC here were never taken by the peer (see vm_migration.blocked_only):
            # the reset drops them, and they go again first.
            dropped = [wr for _, wr in qp.send_fifo]
            qp.pending = dropped + qp.pending
            qp.send_fifo.clear()
            self.device.qp_to_state(qp.obj, "reset")
            self._connect(qp, qp.peer_gid, qp.peer_vqpn, resolved=resolved)
            return self.engine.repost_recvs(qp, recvs), len(dropped)

    def _connect(self, qp: QpEntry, remote_gid: str | None, remote_qpn: int | None, steps: int = 3,
                 resolved: tuple[Peer, int] | None = None) -> None:
        """INIT, RTR, RTS (the first `steps` of them) with the parameters the guest chose when it connected."""
        link = dict(qp.link)
        for state in ("init", "rtr", "rts")[:steps]:
            self.op_modify_qp(verb_args.ModifyQp.model_validate(
                {"qp": qp.handle, "state": state, "access": qp.access, "qkey": qp.qkey, "remote_gid": remote_gid,
                 "remote_qpn": remote_qpn, **link}), resolved=resolved if state == "rtr" else None)

    def snapshot_state(self) -> SessionSnapshot:
        with self.lock:
            return self.state.snapshot()

    def converge(self, snapshot: SessionSnapshot) -> tuple[int, int]:
        """Make a staged session hold what the snapshot (of the source) names: objects that still match are
        kept (the pre-setup), the others go, the missing ones come, with the same handles, keys and virtual
        QPNs; new QPs are held, in RESET. Returns (MRs kept, MRs registered now)."""
        with self.lock:
            cqs = {c.handle: c for c in snapshot.cqs}
            kept_cqs = {h for h, cq in self.state.cqs.items()
                        if h in cqs and (cqs[h].cqe, cqs[h].ring) == (cq.cqe, cq.ring_addr)}
            qps = {q.handle: q for q in snapshot.qps}
            for handle, qp in list(self.state.qps.items()):
                q = qps.get(handle)
                if q is None or not _same_qp(qp, q) or not {qp.send_cq.handle, qp.recv_cq.handle} <= kept_cqs:
                    self._destroy_qp(self.state.take_qp(handle), publish=False)
            for handle, _ in list(self.state.cqs.items()):
                if handle not in kept_cqs:
                    self.device.destroy(self.state.take_cq(handle).obj)
            wanted = {m.handle: m for m in snapshot.mrs}
            kept = 0
            for handle, mr in list(self.state.mrs.items()):
                w = mr.window
                m = wanted.get(handle)
                if m is not None and (m.pd, m.vkey, m.offset, m.length, m.access) == (
                        mr.pd.handle, w.vkey, w.offset, w.length, int(w.access)):
                    kept += 1
                    continue
                self.device.destroy(self.state.take_mr(handle).obj)
            for handle, pd in list(self.state.pds.items()):
                if handle not in snapshot.pds and not pd.users:
                    self.device.destroy(self.state.take_pd(handle).obj)
            for handle in snapshot.pds:
                if handle not in self.state.pds:
                    self.op_alloc_pd(verb_args.NoArgs(), handle=handle)
            added = 0
            for m in snapshot.mrs:
                if m.handle not in self.state.mrs:
                    self.op_reg_mr(verb_args.RegMr(pd=m.pd, addr=m.offset, length=m.length, access=m.access),
                                   handle=m.handle, vkey=m.vkey)
                    added += 1
            for c in snapshot.cqs:
                if c.handle not in self.state.cqs:
                    self.op_create_cq(verb_args.CreateCq(cqe=c.cqe, ring=c.ring), handle=c.handle)
            for q in snapshot.qps:
                if q.handle in self.state.qps:
                    continue
                args = verb_args.CreateQp.model_validate(
                    {"pd": q.pd, "send_cq": q.send_cq, "recv_cq": q.recv_cq, "qp_type": q.qp_type,
                     "max_send_wr": q.max_send_wr, "max_recv_wr": q.max_recv_wr, "max_sge": q.max_sge,
                     "sq_ring": q.sq_ring, "rq_ring": q.rq_ring})
                self.op_create_qp(args, handle=q.handle, vqpn=q.vqpn)
                self.state.qps.get(q.handle).held = True
        return kept, added

    # MigrRDMA's pre-setup: while the VM still runs on the source, each of its connected QPs gets its
    # destination QP and its peer a second physical QP, and the two are connected to each other. At the
    # switchover the peer's QP only swaps to its second physical QP; nothing is modified then.
    def _wire(self, obj: Any, qp_type: str, access: int, qkey: int, dgid: str, dest_qpn: int,
              link: Mapping[str, int]) -> int:
        """INIT, RTR, RTS of a physical QP towards (dgid, dest_qpn), with the guest's connection parameters;
        the timeout it got."""
        defaults = verb_args.ModifyQp.model_fields

        def get(name: str) -> int:
            return int(link.get(name, defaults[name].default))

        self.device.qp_to_init(obj, qp_type, access, qkey)
        self.device.qp_to_rtr(obj, qp_type, RtrParams(
            dgid=dgid, sgid_index=self.vrnic.gid_index, path_mtu=get("path_mtu"), dest_qpn=dest_qpn,
            max_dest_rd_atomic=get("max_dest_rd_atomic"), min_rnr_timer=get("min_rnr_timer")))
        timeout = self.rc_timeout(qp_type, get("path_mtu"), get("timeout"))
        self.device.qp_to_rts(obj, qp_type, RtsParams(timeout=timeout, retry_cnt=get("retry_cnt"),
                                                      rnr_retry=get("rnr_retry"), max_rd_atomic=get("max_rd_atomic")))
        self._note_timeout(qp_type, timeout)
        return timeout

    def shadow(self, qp: QpEntry, dgid: str, dest_qpn: int) -> tuple[Any, int]:
        """A second physical QP for one of this session's RC QPs, connected to (dgid, dest_qpn) and unused
        until adopt_shadow(): the QP's future after its peer migrates."""
        with self.lock:
            obj, phys_qpn = self.device.create_qp(qp.pd.obj, qp.send_cq.obj, qp.recv_cq.obj, qp.qp_type,
                                                  QpCaps(qp.max_send_wr, qp.max_recv_wr, qp.max_sge))
            try:
                self._wire(obj, qp.qp_type, qp.access, qp.qkey, dgid, dest_qpn, qp.link)
            except BaseException:
                self.device.destroy(obj)
                raise
        return obj, phys_qpn

    def drop_shadow(self, obj: Any) -> None:
        with self.lock:
            self.device.destroy(obj)

    def adopt_shadow(self, qp: QpEntry, obj: Any, phys_qpn: int, peer_phys_gid: str,
                     peer_phys_qpn: int) -> tuple[int, int]:
        """The held QP continues on its shadow: receives posted again there, sends the old one held but the
        peer never took queued again, the old physical QP destroyed. Returns (receives, sends) moved."""
        with self.lock:
            self.engine.settle()
            recvs = list(qp.recv_fifo)
            qp.recv_fifo.clear()
            dropped = [wr for _, wr in qp.send_fifo]
            qp.send_fifo.clear()
            qp.pending = dropped + qp.pending
            old_obj, old_qpn = qp.obj, qp.phys_qpn
            self.state.qp_by_phys.pop(old_qpn, None)
            qp.obj, qp.phys_qpn, qp.dest_qpn = obj, phys_qpn, peer_phys_qpn
            self._classify(qp, peer_phys_qpn)  # the shadow sends with its own source port
            self.state.qp_by_phys[phys_qpn] = qp
            self.registry.move_qp(self.vrnic, qp.vqpn, old_qpn, phys_qpn)
            if self.guard is not None:
                flow = self.guard.flow(self.vrnic_id, self.vrnic.phys_gid, phys_qpn, peer_phys_gid, peer_phys_qpn)
                self.guard.allow(flow)
                self.guard.drop(qp.guard_flow)
                qp.guard_flow = flow
            self.device.destroy(old_obj)
            return self.engine.repost_recvs(qp, recvs), len(dropped)

    def preconnect(self, handle: int, peer_id: str, peer_gid: str, peer_vqpn: int, peer_phys_gid: str,
                   dest_qpn: int, access: int, qkey: int, link: Mapping[str, int]) -> QpEntry:
        """A staged QP is connected ahead of the switchover to its peer's shadow; it stays held."""
        with self.lock:
            qp = self.state.qps.get(handle)
            timeout = self._wire(qp.obj, qp.qp_type, access, qkey, peer_phys_gid, dest_qpn, link)
            qp.state, qp.access, qp.qkey, qp.link = "rts", access, qkey, dict(link)
            qp.rts_timeout = (qp.obj, timeout)
            qp.peer_id, qp.peer_gid, qp.peer_vqpn, qp.dest_qpn = peer_id, peer_gid, peer_vqpn, dest_qpn
            self._classify(qp, dest_qpn)
            if self.guard is not None:
                qp.guard_flow = self.guard.flow(self.vrnic_id, self.vrnic.phys_gid, qp.phys_qpn, peer_phys_gid,
                                                dest_qpn)
                self.guard.allow(qp.guard_flow)
            return qp

    def take_over(self, source: GuestSession, ready: frozenset[int] = frozenset()) -> tuple[int, int, int]:
        """Bring this session's QPs to the states the source's were in (see continue_qps)."""
        return self.continue_qps(source.carry_out(), ready)

    def carry_out(self) -> list[QpCarry]:
        """Each QP as another session must continue it: its connection, the receives the NIC holds and the sends
        the NIC has not completed or not taken (the caller made sure none will complete any more)."""
        with self.lock:
            self.engine.settle()
            return [QpCarry(handle, qp.state, qp.qp_type, qp.access, qp.qkey, qp.peer_gid, qp.peer_vqpn,
                            dict(qp.link), list(qp.recv_fifo), [wr for _, wr in qp.send_fifo] + list(qp.pending))
                    for handle, qp in self.state.qps.items()]

    def continue_qps(self, carried: list[QpCarry], ready: frozenset[int] = frozenset(),
                     resolved: Mapping[int, tuple[Peer, int]] | None = None) -> tuple[int, int, int]:
        """Bring this session's QPs to the states the carried ones were in, connected to the same peers (their
        physical QPs as the registry has them now, or as `resolved` gives them by handle), with the carried
        unposted WRs and posted receives. QPs in `ready` were pre-connected and only get their WRs. A QP whose
        peer is gone goes to ERR: its WRs flush with an error. Returns (receives posted again, sends carried,
        QPs broken)."""
        reposted = carried_sends = broken = 0
        resolved = resolved or {}
        with self.lock:
            for old in carried:
                handle = old.handle
                qp = self.state.qps.get(handle)
                gone = old.state == "err"
                if handle not in ready:
                    if qp.state != "reset":  # pre-connected, but the guest or its peer changed since
                        self.device.qp_to_state(qp.obj, "reset")
                        qp.state = "reset"
                        if self.guard is not None:
                            self.guard.drop(qp.guard_flow)
                            qp.guard_flow = None
                    qp.access, qp.qkey, qp.link = old.access, old.qkey, dict(old.link)
                    steps = {"init": 1, "rtr": 2, "rts": 3}.get(old.state, 0)
                    try:
                        if old.qp_type == "rc" and steps >= 2 and old.peer_gid is not None:
                            self._connect(qp, old.peer_gid, old.peer_vqpn, steps, resolved.get(handle))
                        else:
                            for state in ("init", "rtr", "rts")[:steps]:
                                self.op_modify_qp(verb_args.ModifyQp.model_validate(
                                    {"qp": handle, "state": state, "access": old.access, "qkey": old.qkey}))
                    except VrnicError as exc:
                        log.warning("vRNIC %s QP %d: its peer is gone (%s); the QP goes to ERR", self.vrnic_id,
                                    qp.vqpn, exc)
                        gone = True
                        broken += 1
                        if qp.state == "reset":  # receives can be posted from INIT on
                            self.device.qp_to_init(qp.obj, qp.qp_type, qp.access, qp.qkey)
                            qp.state = "init"
                reposted += self.engine.repost_recvs(qp, list(old.recvs))
                qp.pending = list(old.sends)  # never taken by the peer
                carried_sends += len(qp.pending)
                if gone:  # after the receives are on it: the move to ERR flushes them (rxe flushes only then)
                    self.device.qp_to_state(qp.obj, "err")
                    qp.state = "err"
        return reposted, carried_sends, broken

    def publications(self) -> tuple[dict[int, int], dict[int, MrWindow]]:
        """What this session would publish: virtual -> physical QPNs, and MR windows by virtual key."""
        with self.lock:
            return ({q.vqpn: q.phys_qpn for _, q in self.state.qps.items()},
                    {m.window.vkey: m.window for _, m in self.state.mrs.items()})

    # ----- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy everything: QPs, CQs, MRs, PDs, then the context. Safe to call twice.

        A session that does not serve its vRNIC (a migration's staged destination, or the source after the
        hand-over) touches nothing in the registry: what is published there is the other session's."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
        self.cm.drop(self.vrnic_id, self)  # whoever waits on its listeners hears a rejection now
        self.engine.stop()
        with self.lock:
            owns = self.vrnic.session is self or self.vrnic.session is None
            if self.dirty is not None and owns:
                self.registry.log_writes(self.vrnic_id, None)
            qps, cqs, mrs, pds = self.state.take_all()
            for qp in qps:
                self._destroy_qp(qp, publish=owns)
            self.device.destroy(*(cq.obj for cq in cqs))
            self.device.destroy(*(mr.obj for mr in mrs))
            self.device.destroy(*(pd.obj for pd in pds))
            if self.guard is not None and owns:  # whatever is left, e.g. a flow a failed destroy kept
                self.guard.revoke(self.vrnic_id)
            self.registry.detach(self.vrnic, self)
            # after the detach: a guest attaching next finds the vRNIC free when it finds the context
            if owns and self.give_back_device is not None:
                self.give_back_device(self.device)
            else:
                self.device.close()
            self.memory.close()
            for fd in (self.doorbell_fd, self.notify_fd):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        log.info("vRNIC %s: session of pid %d closed, all objects destroyed", self.vrnic_id, self.cred.pid)
