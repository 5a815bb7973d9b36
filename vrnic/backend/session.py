"""One attached guest: its own verbs context, its object tables, its quota, its data-path engine.

Every control verb a guest sends lands in GuestSession.handle(), which checks
handles, ranges and quotas, then runs the verb through pyverbs in the vRNIC's
own context. Closing the session destroys everything in dependency order:
QPs, CQs, MRs, PDs, then the context.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import pyverbs.enums as e
from pydantic import ValidationError
from pyverbs.addr import AH, GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

from vrnic.backend.pyverbs_edge import close_quietly, comp_channel_with_fd, device_errors, open_context
from vrnic.backend.registry import Registry, VirtualRnic
from vrnic.core import verb_args
from vrnic.core.handles import HandleTable
from vrnic.core.quota import QuotaLedger, Resource
from vrnic.core.rings import CQ_SLOT, RQ_SLOT, SQ_SLOT, Access, Ring, index_words
from vrnic.core.translate import MrWindow, validate_region
from vrnic.errors import Conflict, InvalidArgument, NotFound

log = logging.getLogger(__name__)

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK  # a guest that shrinks its arena would SIGBUS the daemon
PORT = 1
MTU_ENUM = {256: e.IBV_MTU_256, 512: e.IBV_MTU_512, 1024: e.IBV_MTU_1024, 2048: e.IBV_MTU_2048,
            4096: e.IBV_MTU_4096}
QP_STATES = {e.IBV_QPS_RESET: "reset", e.IBV_QPS_INIT: "init", e.IBV_QPS_RTR: "rtr", e.IBV_QPS_RTS: "rts",
             e.IBV_QPS_SQD: "sqd", e.IBV_QPS_SQE: "sqe", e.IBV_QPS_ERR: "err"}


def _gid(text: str) -> GID:
    """pyverbs parses only the fully written-out form (8 groups of 4 hex digits)."""
    return GID(ipaddress.IPv6Address(text).exploded)


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass(eq=False)
class PdState:
    real: PD
    users: int = 0  # MRs and QPs on it: a PD in use cannot be deallocated


@dataclass(eq=False)
class CqState:
    real: CQ
    channel: CompChannel
    channel_fd: int | None
    ring: Ring
    users: int = 0
    armed: bool = False


@dataclass(eq=False)
class MrState:
    real: MR
    pd: PdState
    window: MrWindow


@dataclass(eq=False)
class QpState:
    real: QP
    vqpn: int
    qp_type: str
    pd: PdState
    send_cq: CqState
    recv_cq: CqState
    sq: Ring
    rq: Ring
    peer: VirtualRnic | None = None
    ahs: dict[tuple[str, int], AH] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)  # WRs the NIC refused for lack of room
    grh_at: dict[int, int] = field(default_factory=dict)  # UD recv wr_id -> address of its GRH


class GuestSession:
    def __init__(self, vrnic: VirtualRnic, registry: Registry, arena_fd: int, doorbell_fd: int,
                 cred: PeerCred, busy_poll: bool = False, notify_fd: int | None = None) -> None:
        self.vrnic = vrnic
        self.registry = registry
        self.cred = cred
        self.lock = threading.RLock()
        self.ledger = QuotaLedger(vrnic.spec.quota)
        self.pds: HandleTable[PdState] = HandleTable("PD")
        self.cqs: HandleTable[CqState] = HandleTable("CQ")
        self.mrs: HandleTable[MrState] = HandleTable("MR")
        self.qps: HandleTable[QpState] = HandleTable("QP")
        self.mr_by_vkey: dict[int, MrWindow] = {}
        self.qp_by_vqpn: dict[int, QpState] = {}
        self.qp_by_phys: dict[int, QpState] = {}
        self.doorbell_fd = doorbell_fd
        self.notify_fd = notify_fd  # rung after new completions, so a waiting guest can sleep
        self.arena_fd = arena_fd
        self.closed = False
        seals = fcntl.fcntl(arena_fd, fcntl.F_GET_SEALS)
        if not seals & REQUIRED_SEALS:
            raise InvalidArgument("the arena memfd must be sealed against shrinking (F_SEAL_SHRINK)")
        self.arena_size = os.fstat(arena_fd).st_size
        if self.arena_size <= 0 or self.arena_size % mmap.PAGESIZE:
            raise InvalidArgument(f"the arena must be a positive number of pages, not {self.arena_size} bytes")
        self.arena = mmap.mmap(arena_fd, self.arena_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(self.arena)
        self.arena_base = ctypes.addressof(anchor)
        del anchor  # an exported buffer would keep the mapping from ever closing
        self.view = memoryview(self.arena)
        self.words = index_words(self.view)
        self.ctx = open_context(vrnic.device)
        from vrnic.backend.engine import SharedRingEngine  # the engine needs the session's types

        self.engine = SharedRingEngine(self, busy_poll=busy_poll)
        self.engine.start()

    # ----- dispatch ----------------------------------------------------------------------------
    def handle(self, op: str, raw_args: dict[str, Any]) -> dict[str, Any]:
        schema = verb_args.OPS.get(op)
        if schema is None or op == "attach":
            raise InvalidArgument(f"unknown operation {op!r}")
        try:
            args = schema.model_validate(raw_args)
        except ValidationError as exc:  # reported as one line: the first problem
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise InvalidArgument(f"{op}: {where}: {first['msg']}") from None
        with self.lock:
            if self.closed:
                raise Conflict("the session is closed", current_state="detached")
            result: dict[str, Any] = getattr(self, f"op_{op}")(args)
        if op in ("create_qp", "create_cq", "destroy_qp", "destroy_cq", "busy_poll"):
            self.engine.wake()
        return result

    # ----- queries -----------------------------------------------------------------------------
    def op_query_device(self, _: verb_args.NoArgs) -> dict[str, Any]:
        with device_errors("query device"):
            attr = self.ctx.query_device()
        quota = self.vrnic.spec.quota
        # The guest sees the device's limits clipped to its quota, and no physical identifiers.
        return {"max_qp": min(attr.max_qp, quota.max_qps), "max_cq": min(attr.max_cq, quota.max_cqs),
                "max_mr": min(attr.max_mr, quota.max_mrs), "max_pd": min(attr.max_pd, quota.max_pds),
                "max_cqe": min(attr.max_cqe, quota.max_cqe), "max_qp_wr": min(attr.max_qp_wr, quota.max_wr),
                "max_sge": min(attr.max_sge, 4), "max_pinned_bytes": quota.max_pinned_bytes,
                "arena_bytes": self.arena_size, "atomic_caps": attr.atomic_caps, "phys_port_cnt": 1,
                "quota_used": self.ledger.used()}

    def op_query_port(self, args: verb_args.QueryPort) -> dict[str, Any]:
        if args.port != PORT:
            raise InvalidArgument(f"a vRNIC has one port (1), not {args.port}")
        with device_errors("query port"):
            attr = self.ctx.query_port(PORT)
        return {"state": int(attr.state), "active_mtu": int(attr.active_mtu), "max_mtu": int(attr.max_mtu),
                "gid_tbl_len": 1}

    def op_query_gid(self, args: verb_args.QueryGid) -> dict[str, Any]:
        if args.port != PORT or args.index != 0:
            raise InvalidArgument("a vRNIC has one GID: port 1, index 0")
        return {"gid": self.vrnic.spec.virtual_gid}

    # ----- PD ----------------------------------------------------------------------------------
    def op_alloc_pd(self, _: verb_args.NoArgs) -> dict[str, Any]:
        self.ledger.charge(Resource.PD)
        try:
            with device_errors("alloc PD"):
                pd = PdState(PD(self.ctx))
        except BaseException:
            self.ledger.refund(Resource.PD)
            raise
        return {"pd": self.pds.add(pd)}

    def op_dealloc_pd(self, args: verb_args.PdRef) -> dict[str, Any]:
        pd = self.pds.get(args.pd)
        if pd.users:
            raise Conflict(f"PD {args.pd} still has {pd.users} MR(s)/QP(s)", current_state="in_use")
        self.pds.pop(args.pd)
        close_quietly(pd.real)
        self.ledger.refund(Resource.PD)
        return {}

    # ----- MR ----------------------------------------------------------------------------------
    def op_reg_mr(self, args: verb_args.RegMr) -> dict[str, Any]:
        pd = self.pds.get(args.pd)
        validate_region(args.addr, args.length, self.arena_size, "MR")
        access = Access(args.access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
            raise InvalidArgument("remote write or atomic access needs LOCAL_WRITE too")
        self.ledger.charge(Resource.MR)
        try:
            self.ledger.charge(Resource.PINNED_BYTES, args.length)
        except BaseException:
            self.ledger.refund(Resource.MR)
            raise
        try:
            with device_errors("reg MR"):
                real = MR(pd.real, args.length, int(access), address=self.arena_base + args.addr)
        except BaseException:
            self.ledger.refund(Resource.MR)
            self.ledger.refund(Resource.PINNED_BYTES, args.length)
            raise
        vkey = self._new_vkey()
        window = MrWindow(vkey=vkey, offset=args.addr, length=args.length, access=access,
                          phys_lkey=real.lkey, phys_rkey=real.rkey, base=self.arena_base)
        pd.users += 1
        handle = self.mrs.add(MrState(real, pd, window))
        self.mr_by_vkey[vkey] = window
        return {"mr": handle, "lkey": vkey, "rkey": vkey, "addr": args.addr, "length": args.length}

    def _new_vkey(self) -> int:
        while True:
            key = secrets.randbits(32) or 1
            if key not in self.mr_by_vkey:
                return key

    def op_dereg_mr(self, args: verb_args.MrRef) -> dict[str, Any]:
        mr = self.mrs.pop(args.mr)
        self.mr_by_vkey.pop(mr.window.vkey, None)
        close_quietly(mr.real)
        mr.pd.users -= 1
        self.ledger.refund(Resource.MR)
        self.ledger.refund(Resource.PINNED_BYTES, mr.window.length)
        return {}

    # ----- CQ ----------------------------------------------------------------------------------
    def op_create_cq(self, args: verb_args.CreateCq) -> dict[str, Any]:
        self.ledger.check_cqe(args.cqe)
        validate_region(args.ring, Ring.bytes_needed(args.cqe, CQ_SLOT.size), self.arena_size, "CQ ring")
        ring = Ring(self.view, args.ring, args.cqe, CQ_SLOT, self.words)
        self.ledger.charge(Resource.CQ)
        channel = real = None
        try:
            channel, fd = comp_channel_with_fd(self.ctx)
            with device_errors("create CQ"):
                real = CQ(self.ctx, args.cqe, None, channel, 0)
        except BaseException:
            close_quietly(real, channel)
            self.ledger.refund(Resource.CQ)
            raise
        ring.reset()
        return {"cq": self.cqs.add(CqState(real, channel, fd, ring)), "cqe": args.cqe}

    def op_destroy_cq(self, args: verb_args.CqRef) -> dict[str, Any]:
        cq = self.cqs.get(args.cq)
        if cq.users:
            raise Conflict(f"CQ {args.cq} is still used by {cq.users} QP(s)", current_state="in_use")
        self.cqs.pop(args.cq)
        close_quietly(cq.real, cq.channel)
        self.ledger.refund(Resource.CQ)
        return {}

    # ----- QP ----------------------------------------------------------------------------------
    def op_create_qp(self, args: verb_args.CreateQp) -> dict[str, Any]:
        pd = self.pds.get(args.pd)
        send_cq, recv_cq = self.cqs.get(args.send_cq), self.cqs.get(args.recv_cq)
        self.ledger.check_wr(args.max_send_wr)
        self.ledger.check_wr(args.max_recv_wr)
        validate_region(args.sq_ring, Ring.bytes_needed(args.max_send_wr, SQ_SLOT.size), self.arena_size, "SQ ring")
        validate_region(args.rq_ring, Ring.bytes_needed(args.max_recv_wr, RQ_SLOT.size), self.arena_size, "RQ ring")
        sq = Ring(self.view, args.sq_ring, args.max_send_wr, SQ_SLOT, self.words)
        rq = Ring(self.view, args.rq_ring, args.max_recv_wr, RQ_SLOT, self.words)
        self.ledger.charge(Resource.QP)
        qp_type = e.IBV_QPT_RC if args.qp_type == "rc" else e.IBV_QPT_UD
        cap = QPCap(max_send_wr=args.max_send_wr, max_recv_wr=args.max_recv_wr, max_send_sge=args.max_sge,
                    max_recv_sge=args.max_sge)
        try:
            with device_errors("create QP"):
                real = QP(pd.real, QPInitAttr(qp_type=qp_type, scq=send_cq.real, rcq=recv_cq.real, cap=cap,
                                              sq_sig_all=0))
        except BaseException:
            self.ledger.refund(Resource.QP)
            raise
        sq.reset()
        rq.reset()
        vqpn = self._new_vqpn()
        qp = QpState(real, vqpn, args.qp_type, pd, send_cq, recv_cq, sq, rq)
        pd.users += 1
        send_cq.users += 1
        recv_cq.users += 1
        handle = self.qps.add(qp)
        self.qp_by_vqpn[vqpn] = qp
        self.qp_by_phys[real.qp_num] = qp
        return {"qp": handle, "qpn": vqpn}

    def _new_vqpn(self) -> int:
        while True:
            vqpn = secrets.randbelow((1 << 24) - 2) + 2  # 0 and 1 are special QPNs in verbs
            if vqpn not in self.qp_by_vqpn:
                return vqpn

    def op_destroy_qp(self, args: verb_args.QpRef) -> dict[str, Any]:
        qp = self.qps.pop(args.qp)
        self._destroy_qp(qp)
        return {}

    def _destroy_qp(self, qp: QpState) -> None:
        self.qp_by_vqpn.pop(qp.vqpn, None)
        self.qp_by_phys.pop(qp.real.qp_num, None)
        close_quietly(qp.real, *qp.ahs.values())
        qp.pd.users -= 1
        qp.send_cq.users -= 1
        qp.recv_cq.users -= 1
        self.ledger.refund(Resource.QP)

    def op_query_qp(self, args: verb_args.QpRef) -> dict[str, Any]:
        qp = self.qps.get(args.qp)
        with device_errors("query QP"):
            attr, _init = qp.real.query(e.IBV_QP_STATE | e.IBV_QP_CAP)
        return {"qpn": qp.vqpn, "state": QP_STATES.get(attr.qp_state, str(attr.qp_state)), "qp_type": qp.qp_type,
                "connected_to": None if qp.peer is None else qp.peer.spec.virtual_gid}

    def op_modify_qp(self, args: verb_args.ModifyQp) -> dict[str, Any]:
        qp = self.qps.get(args.qp)
        real = qp.real
        # Program order: WRs the guest posted before this call reach the NIC before the transition
        # (a receive posted, then ERR, must be flushed, not lost in the ring).
        self.engine.drain_queues()
        with device_errors(f"modify QP to {args.state}"):
            if args.state == "init":
                attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=PORT)
                attr.pkey_index = 0
                if qp.qp_type == "rc":
                    attr.qp_access_flags = args.access
                else:
                    attr.qkey = args.qkey
                real.to_init(attr)
            elif args.state == "rtr":
                attr = QPAttr(port_num=PORT)
                if qp.qp_type == "rc":
                    peer, phys_qpn = self._resolve(args.remote_gid, args.remote_qpn)
                    route = GlobalRoute(dgid=_gid(peer.phys_gid), sgid_index=self.vrnic.gid_index, hop_limit=64)
                    attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=PORT)
                    attr.path_mtu = MTU_ENUM[args.path_mtu]
                    attr.dest_qp_num = phys_qpn
                    attr.rq_psn = args.rq_psn
                    attr.max_dest_rd_atomic = args.max_dest_rd_atomic
                    attr.min_rnr_timer = args.min_rnr_timer
                    qp.peer = peer
                real.to_rtr(attr)
            elif args.state == "rts":
                attr = QPAttr(port_num=PORT)
                attr.sq_psn = args.sq_psn
                if qp.qp_type == "rc":
                    attr.timeout = args.timeout
                    attr.retry_cnt = args.retry_cnt
                    attr.rnr_retry = args.rnr_retry
                    attr.max_rd_atomic = args.max_rd_atomic
                real.to_rts(attr)
            else:
                target = e.IBV_QPS_ERR if args.state == "err" else e.IBV_QPS_RESET
                real.modify(QPAttr(qp_state=target), e.IBV_QP_STATE)
                if args.state == "reset":
                    qp.peer = None
                    qp.sq.reset()
                    qp.rq.reset()
                    qp.pending.clear()
        return {"state": args.state}

    def _resolve(self, remote_gid: str | None, remote_qpn: int | None) -> tuple[VirtualRnic, int]:
        """Virtual (GID, QPN) of a peer -> the peer vRNIC and its physical QPN (MasQ-style, at connect)."""
        if remote_gid is None or remote_qpn is None:
            raise InvalidArgument("RTR needs remote_gid and remote_qpn (the peer's virtual identity)")
        peer = self.registry.peer(self.vrnic, remote_gid)
        session = peer.session
        target = None if session is None else session.qp_by_vqpn.get(remote_qpn)
        if target is None:
            raise NotFound(f"no QP {remote_qpn} on {remote_gid}")
        return peer, target.real.qp_num

    def op_connect(self, args: verb_args.Connect) -> dict[str, Any]:
        qp = self.qps.get(args.qp)
        if qp.qp_type != "rc":
            raise InvalidArgument("connect is for RC QPs; UD QPs name their peer per work request")
        for state in ("init", "rtr", "rts"):
            self.op_modify_qp(verb_args.ModifyQp(qp=args.qp, state=state, access=args.access,  # type: ignore[arg-type]
                                           remote_gid=args.remote_gid, remote_qpn=args.remote_qpn))
        return {"state": "rts"}

    def ud_address(self, qp: QpState, virtual_gid: str, vqpn: int) -> tuple[AH, int]:
        """Resolve a UD destination named by virtual identity to an address handle and physical QPN."""
        peer, phys_qpn = self._resolve(virtual_gid, vqpn)
        key = (peer.phys_gid, phys_qpn)
        ah = qp.ahs.get(key)
        if ah is None:
            route = GlobalRoute(dgid=_gid(peer.phys_gid), sgid_index=self.vrnic.gid_index, hop_limit=64)
            with device_errors("create AH"):
                ah = AH(qp.pd.real, attr=AHAttr(gr=route, is_global=1, port_num=PORT))
            qp.ahs[key] = ah
        return ah, phys_qpn

    def op_busy_poll(self, args: verb_args.BusyPoll) -> dict[str, Any]:
        self.engine.busy_poll = args.enabled
        return {"busy_poll": args.enabled}

    def op_sync(self, _: verb_args.NoArgs) -> dict[str, Any]:
        """Post everything waiting in the guest's rings now: afterwards the NIC holds those WRs."""
        return {"posted": self.engine.drain_queues()}

    def op_detach(self, _: verb_args.NoArgs) -> dict[str, Any]:
        return {}

    # ----- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy everything: QPs, CQs, MRs, PDs, then the context. Safe to call twice."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.engine.stop()
        with self.lock:
            for _, qp in self.qps.items():
                self._destroy_qp(qp)
            for _, cq in self.cqs.items():
                close_quietly(cq.real, cq.channel)
            for _, mr in self.mrs.items():
                close_quietly(mr.real)
            for _, pd in self.pds.items():
                close_quietly(pd.real)
            close_quietly(self.ctx)
            self.mr_by_vkey.clear()
            self.qp_by_vqpn.clear()
            self.qp_by_phys.clear()
            self.words.release()
            self.view.release()
            self.arena.close()
            for fd in (self.arena_fd, self.doorbell_fd, self.notify_fd):
                if fd is None:
                    continue
                with contextlib.suppress(OSError):
                    os.close(fd)
        log.info("vRNIC %s: session of pid %d closed, all objects destroyed", self.vrnic.spec.id, self.cred.pid)
