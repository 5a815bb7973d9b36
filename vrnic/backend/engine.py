"""Data-path engines: how posted work requests reach the NIC and completions reach the guest.

DataPathEngine is the interface. SharedRingEngine (v1) is a thread per session
that drains the guest's send/recv rings onto the real QPs and moves real
completions into the guest's CQ rings; the guest never makes a round trip for
post or poll. A later "direct" engine maps the NIC's queues into the guest and
does nothing per post; it only has to implement the same interface.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import select
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import pyverbs.enums as e
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.wr import SGE, RecvWR, SendWR

from vrnic.core.rings import (
    WC_OF_WR,
    Completion,
    RingCorrupt,
    RingFlags,
    WcOpcode,
    WcStatus,
    WrOpcode,
    pack_completion,
    unpack_recv,
    unpack_send,
)
from vrnic.core.translate import ATOMICS, WrRejected, local_sges, remote_target
from vrnic.errors import InvalidArgument

if TYPE_CHECKING:
    from vrnic.backend.session import CqState, GuestSession, QpState

log = logging.getLogger(__name__)

BATCH = 32
IDLE_WAIT_S = 1.0  # with every CQ armed, a completion or a doorbell wakes us anyway
UNKNOWN_FD_WAIT_S = 0.001  # a CQ whose channel fd is unknown must be polled
WRITE_OPS = (WrOpcode.RDMA_READ, *ATOMICS)  # local buffers the NIC writes into
WC_GRH = 1  # IBV_WC_GRH


def source_gid(grh: bytes) -> str:
    """The sender's GID from a received GRH. RoCE v2 over IPv4 puts an IPv4 header in its last 20 bytes."""
    if not any(grh[:20]):
        return f"::ffff:{ipaddress.IPv4Address(grh[32:36])}"
    return str(ipaddress.IPv6Address(grh[8:24]))


# pyverbs 44 cannot build a WR without SGEs; a zero-length SGE on one's own MR does the same job.
NO_SGE = "work requests need at least one SGE (use a zero-length SGE on one of your MRs)"


class DataPathEngine(ABC):
    busy_poll: bool

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def wake(self) -> None:
        """Something changed (a queue was created or destroyed): look again."""

    @abstractmethod
    def drain_queues(self) -> int:
        """Move every posted WR to the NIC now (the caller holds the session lock); how many moved."""

    @abstractmethod
    def stop(self) -> None:
        """Stop and return once no verb of the session is in use any more."""


class SharedRingEngine(DataPathEngine):
    def __init__(self, session: GuestSession, busy_poll: bool = False) -> None:
        self.session = session
        self.busy_poll = busy_poll
        self._stop = threading.Event()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=f"engine-{session.vrnic.spec.id}", daemon=True)
        self.posted = 0
        self.recvs_posted = 0
        self.completed = 0
        self.waits = 0  # times the engine went to sleep: a cheap check that idle means idle

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        os.eventfd_write(self._wake_fd, 1)

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        os.close(self._wake_fd)

    def drain_queues(self) -> int:
        before = self.posted + self.recvs_posted
        for _, qp in self.session.qps.items():
            self._drain_queues(qp)
        return self.posted + self.recvs_posted - before

    # ----- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._step():
                    continue
                if self.busy_poll:
                    continue
                self._wait()
        except Exception:  # an engine bug must not take the daemon down; the session goes dead
            log.exception("data-path engine of vRNIC %s failed", self.session.vrnic.spec.id)

    def _step(self) -> bool:
        session = self.session
        worked = False
        with session.lock:
            if session.closed:
                return False
            for _, qp in session.qps.items():
                worked |= self._drain_queues(qp)
            completed = False
            for _, cq in session.cqs.items():
                completed |= self._drain_cq(cq)
            if completed and session.notify_fd is not None:
                with contextlib.suppress(OSError):  # a full counter already means "look"
                    os.eventfd_write(session.notify_fd, 1)
        return worked or completed

    def _wait(self) -> None:
        self.waits += 1
        session = self.session
        fds = [self._wake_fd, session.doorbell_fd]
        timeout = IDLE_WAIT_S
        with session.lock:
            if session.closed:
                return
            cqs = [cq for _, cq in session.cqs.items()]
            for cq in cqs:
                if cq.channel_fd is None:
                    timeout = UNKNOWN_FD_WAIT_S
                elif not cq.armed:
                    cq.real.req_notify()
                    cq.armed = True
            # A completion may have landed between the last poll and arming: look once more.
            if any(self._drain_cq(cq) for cq in cqs):
                return
        by_fd = {cq.channel_fd: cq for cq in cqs if cq.channel_fd is not None}
        try:
            readable, _, _ = select.select(fds + list(by_fd), [], [], timeout)
        except (OSError, ValueError):  # an fd closed under us: the session is going away
            return
        for fd in readable:
            if fd in by_fd:
                cq = by_fd[fd]
                with session.lock:
                    if session.closed or cq not in [c for _, c in session.cqs.items()]:
                        continue
                    try:
                        cq.channel.get_cq_event(cq.real)
                        cq.real.ack_events(1)
                    except PyverbsError:
                        pass
                    cq.armed = False
            else:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)

    # ----- guest -> NIC ------------------------------------------------------------------------
    def _drain_queues(self, qp: QpState) -> bool:
        worked = False
        try:
            retry, qp.pending = qp.pending, []
            for wr in retry:
                self._post(qp, wr)
            # While the NIC's send queue is full, leave WRs in the ring: that is the guest's backpressure.
            for slot in [] if qp.pending else qp.sq.consume(BATCH):
                worked = True
                try:
                    wr = unpack_send(slot)
                except InvalidArgument:
                    self._complete(qp.send_cq, Completion(slot[0], WcStatus.LOC_QP_OP_ERR, WcOpcode.SEND,
                                                          qp=qp.vqpn))
                    continue
                if qp.pending:
                    qp.pending.append(wr)
                else:
                    self._post(qp, wr)
            for slot in qp.rq.consume(BATCH):
                worked = True
                self._post_recv(qp, slot)
        except RingCorrupt as exc:
            qp.sq.set_flag(RingFlags.CORRUPT)
            log.warning("vRNIC %s QP %d: %s; queue marked corrupt", self.session.vrnic.spec.id, qp.vqpn, exc)
        return worked

    def _post(self, qp: QpState, wr: Any) -> None:
        session = self.session
        try:
            sges = local_sges(wr.sges, session.mr_by_vkey, writable=wr.opcode in WRITE_OPS)
            if not sges:
                raise WrRejected(WcStatus.LOC_QP_OP_ERR, NO_SGE)
            real = SendWR(wr_id=wr.wr_id, opcode=int(wr.opcode), num_sge=len(sges),
                          sg=[SGE(*s) for s in sges],
                          send_flags=e.IBV_SEND_SIGNALED if wr.signaled else 0, imm_data=wr.imm)
            if wr.opcode in (WrOpcode.SEND, WrOpcode.SEND_WITH_IMM) and qp.qp_type == "ud":
                gid = str(ipaddress.IPv6Address(wr.ud_gid))
                ah, phys_qpn = session.ud_address(qp, gid, wr.ud_qpn)
                real.set_wr_ud(ah, phys_qpn, wr.ud_qkey)
            elif wr.opcode not in (WrOpcode.SEND, WrOpcode.SEND_WITH_IMM):
                length = 8 if wr.opcode in ATOMICS else sum(s[1] for s in sges)
                peer = qp.peer.session if qp.peer is not None else None
                addr, rkey = remote_target(wr.opcode, wr.remote_addr, length, wr.rkey,
                                           None if peer is None else peer.mr_by_vkey)
                if wr.opcode in ATOMICS:
                    real.set_wr_atomic(rkey, addr, wr.compare_add, wr.swap)
                else:
                    real.set_wr_rdma(rkey, addr)
        except WrRejected as exc:
            self._reject(qp, wr, exc.status, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a UD peer that vanished, a bad GID: the WR fails alone
            self._reject(qp, wr, WcStatus.LOC_QP_OP_ERR, str(exc))
            return
        try:
            qp.real.post_send(real)
            self.posted += 1
        except PyverbsRDMAError as exc:
            if abs(exc.error_code or 0) == errno.ENOMEM:  # send queue full: retry after completions
                qp.pending.append(wr)
            else:
                self._reject(qp, wr, WcStatus.LOC_QP_OP_ERR, str(exc))
        except PyverbsError as exc:
            self._reject(qp, wr, WcStatus.LOC_QP_OP_ERR, str(exc))

    def _post_recv(self, qp: QpState, slot: Any) -> None:
        try:
            wr = unpack_recv(slot)
            sges = local_sges(wr.sges, self.session.mr_by_vkey, writable=True)
            if not sges:
                raise WrRejected(WcStatus.LOC_QP_OP_ERR, NO_SGE)
            qp.real.post_recv(RecvWR(wr_id=wr.wr_id, num_sge=len(sges), sg=[SGE(*s) for s in sges]))
            self.recvs_posted += 1
            if qp.qp_type == "ud":
                qp.grh_at[wr.wr_id] = sges[0][0]  # where the NIC will write the source's GRH
        except WrRejected as exc:
            self._complete(qp.recv_cq, Completion(slot[0], exc.status, WcOpcode.RECV, qp=qp.vqpn))
        except (InvalidArgument, PyverbsError):
            self._complete(qp.recv_cq, Completion(slot[0], WcStatus.LOC_QP_OP_ERR, WcOpcode.RECV, qp=qp.vqpn))

    def _reject(self, qp: QpState, wr: Any, status: WcStatus, reason: str) -> None:
        log.info("vRNIC %s QP %d: WR %d refused: %s", self.session.vrnic.spec.id, qp.vqpn, wr.wr_id, reason)
        self._complete(qp.send_cq, Completion(wr.wr_id, status, WC_OF_WR[wr.opcode], qp=qp.vqpn))

    # ----- NIC -> guest ------------------------------------------------------------------------
    def _drain_cq(self, cq: CqState) -> bool:
        if cq.ring.flags & RingFlags.CORRUPT:
            return False
        try:
            room = cq.ring.entries - cq.ring.count()
        except RingCorrupt as exc:  # the guest scribbled on its own ring: that CQ is dead, nobody else's
            cq.ring.set_flag(RingFlags.CORRUPT)
            log.warning("vRNIC %s: CQ ring corrupt (%s); CQ stopped", self.session.vrnic.spec.id, exc)
            return False
        if room <= 0:
            return False
        npolled, wcs = cq.real.poll(num_entries=min(room, BATCH))
        session = self.session
        for wc in wcs[:npolled]:
            qp = session.qp_by_phys.get(wc.qp_num)
            src = 0
            if qp is not None and qp.qp_type == "ud" and wc.opcode & WcOpcode.RECV:
                grh = qp.grh_at.pop(wc.wr_id, None)
                source = None if grh is None or not wc.wc_flags & WC_GRH else source_gid(ctypes.string_at(grh, 40))
                src = session.registry.virtual_qpn(session.vrnic, wc.src_qp, source)
            self._complete(cq, Completion(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data,
                                          qp.vqpn if qp else 0, src, wc.wc_flags, wc.vendor_err))
        self.completed += npolled
        return npolled > 0

    @staticmethod
    def _complete(cq: CqState, wc: Completion) -> None:
        try:
            if not cq.ring.produce(pack_completion(wc)):
                cq.ring.set_flag(RingFlags.OVERFLOW)
        except RingCorrupt:
            cq.ring.set_flag(RingFlags.CORRUPT)
