"""Data-path engines: how posted work requests reach the NIC and completions reach the guest.

DataPathEngine is the interface. SharedRingEngine (v1) is a thread per session
that drains the guest's send/recv rings onto the real QPs and moves real
completions into the guest's CQ rings; the guest never makes a round trip for
post or poll. A later "direct" engine maps the NIC's queues into the guest and
does nothing per post; it only has to implement the same interface.

An engine sees its session only through EngineHost: the session's own tables,
its lock, the RNIC edge, and a resolver for peers (which goes through the
registry, never into another session).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from vrnic.backend.rnic_edge import DeviceContext, PhysRecv, PhysSend, SendQueueFull
from vrnic.core.rings import (
    WC_OF_WR,
    Completion,
    Ring,
    RingCorrupt,
    RingFlags,
    WcOpcode,
    WcStatus,
    WrOpcode,
    pack_completion,
    unpack_recv,
    unpack_send,
)
from vrnic.core.session_state import CqEntry, QpEntry, SessionState
from vrnic.core.translate import ATOMICS, MrWindow, WrRejected, local_sges, remote_target
from vrnic.core.vaddr import gid_text
from vrnic.errors import InvalidArgument, NotSupported, VrnicError

log = logging.getLogger(__name__)

BATCH = 32
IDLE_WAIT_S = 1.0  # with every CQ armed, a completion or a doorbell wakes us anyway
UNKNOWN_FD_WAIT_S = 0.001  # a CQ whose channel fd is unknown must be polled
# How long a SEND may wait for its local peer's lock to post the peer's receives first. rxe retries a SEND refused
# for want of a receive (RNR NAK) a timer tick later, 4 ms at least, so waiting up to that long never costs more.
PEER_WAIT_S = 0.004
WRITE_OPS = (WrOpcode.RDMA_READ, *ATOMICS)  # local buffers the NIC writes into
CONSUMES_RECV = (WrOpcode.SEND, WrOpcode.SEND_WITH_IMM, WrOpcode.RDMA_WRITE_WITH_IMM)  # a receive at the peer
WC_GRH = 1  # IBV_WC_GRH


def _status_name(status: int) -> str:
    try:
        return WcStatus(status).name
    except ValueError:
        return str(status)


def source_gid(grh: bytes) -> str:
    """The sender's GID from a received GRH. RoCE v2 over IPv4 puts an IPv4 header in its last 20 bytes."""
    if not any(grh[:20]):
        return f"::ffff:{socket.inet_ntoa(bytes(grh[32:36]))}"
    return gid_text(bytes(grh[8:24]))


# pyverbs 44 cannot build a WR without SGEs; a zero-length SGE on one's own MR does the same job.
NO_SGE = "work requests need at least one SGE (use a zero-length SGE on one of your MRs)"


class EngineHost(Protocol):
    """What an engine may touch of its session."""

    vrnic_id: str
    lock: threading.RLock
    state: SessionState  # the session's own tables; read and written under lock
    device: DeviceContext
    doorbell_fd: int
    notify_fd: int | None  # rung after new completions, so a waiting guest can sleep

    @property
    def closed(self) -> bool: ...

    def ud_destination(self, qp: QpEntry, virtual_gid: str, vqpn: int) -> tuple[Any, int]:
        """(address handle, physical QPN) of a reachable UD peer; NotFound otherwise."""

    def peer_mrs(self, qp: QpEntry) -> Mapping[int, MrWindow] | None:
        """The MRs of qp's connected peer by virtual key; None if not connected."""

    def source_vqpn(self, phys_qpn: int, phys_gid: str | None) -> int:
        """The virtual QPN of a UD sender, 0 if unknown or unreachable."""

    def engine_failed(self) -> None:
        """The engine stopped for good: tell the guest and end its connection."""

    def look_at_blank_qps(self, qps: Iterable[QpEntry] | None = None) -> None:
        """Of the QPs whose rings no one ever wrote (QpEntry.blank), all or those among qps, mark those the
        guest has written since."""

    def read_blank_qps(self) -> None:
        """The guest rang (or the engine's idle timeout passed): no QP is blank any more."""

    def nic_writes(self, address: int, length: int) -> None:
        """The NIC may write this range of the guest's own memory (logged while its VM migrates)."""

    def remote_writes(self, qp: QpEntry, address: int, length: int) -> None:
        """This QP's RDMA WRITE or atomic will write this range of its peer's memory."""

    def post_peer_receives(self, qp: QpEntry, wait: float = 0.0) -> bool:
        """qp's SENDs are about to go out: the receives its peer's guest posted should be on the NIC first. False
        when that could not be done: the peer is a session of this vrnicd whose lock another thread held
        (throughout `wait` seconds; a caller that waits must hold no session's lock)."""


class DataPathEngine(ABC):
    busy_poll: bool

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def wake(self) -> None:
        """Something changed (a queue was created or destroyed): look again."""

    @abstractmethod
    def drain_queues(self, qps: list[QpEntry] | None = None) -> int:
        """Move the WRs posted to qps (all QPs by default) to the NIC now (the caller holds the session lock);
        how many moved."""

    @abstractmethod
    def stop(self) -> None:
        """Stop and return once no verb of the session is in use any more."""

    def settle(self) -> int:
        """Move every completion the NIC has to the guest now (live migration; caller holds the lock)."""
        raise NotSupported(f"the {type(self).__name__} cannot be migrated")

    def repost_recvs(self, qp: QpEntry, recvs: list[Any]) -> int:
        """Post receives that were on another QP on qp, in order (live migration; caller holds the lock)."""
        raise NotSupported(f"the {type(self).__name__} cannot be migrated")

    def settle_cqs(self, cqs: Iterable[CqEntry]) -> None:
        """Move what the NIC has on these CQs to the guest now (the caller holds the lock). After a QP is
        destroyed: every completion it left is then in its CQs' rings when destroy_qp returns, so a CQ the
        frontend hands out again (its pool) never receives one later. Nothing to do where the guest polls the
        NIC's own CQ."""
        return None

    def post_receives(self, qp: QpEntry) -> None:
        """Move the receives the guest posted on qp to the NIC now (the caller holds the lock). Nothing to do
        where the guest posts to the NIC's own queue."""
        return None


class SharedRingEngine(DataPathEngine):
    def __init__(self, host: EngineHost, busy_poll: bool = False) -> None:
        self.host = host
        self.busy_poll = busy_poll
        self.failed = False
        # A flag, not an Event, and the thread made when it starts (with the first QP): each Event or Thread made
        # here was a Condition that Python builds through three AttributeErrors, on every attach (issue 14).
        self._stopping = False
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._peer_waits: list[tuple[QpEntry, float]] = []  # QPs whose SENDs wait for their peer: (qp, deadline)
        self.posted = 0
        self.recvs_posted = 0
        self.completed = 0
        self.waits = 0  # times the engine went to sleep: a cheap check that idle means idle
        # The guest's doorbell (or an idle timeout) since the blank QPs were last made readable: a guest rings
        # after it writes a ring, so steps woken by completions, wakes or short timeouts leave them be (a doorbell
        # rung before the thread started is still readable at its first wait)
        self._rung = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.host.vrnic_id}", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # stopped already
            os.eventfd_write(self._wake_fd, 1)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.wake()
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout=10)
        os.close(self._wake_fd)

    def drain_queues(self, qps: list[QpEntry] | None = None) -> int:
        before = self.posted + self.recvs_posted
        self.host.look_at_blank_qps(qps)
        for qp in qps if qps is not None else [q for _, q in self.host.state.qps.items()]:
            self._drain_queues(qp, patient=False)  # a verb's program order: everything on the NIC when it returns
        return self.posted + self.recvs_posted - before

    def settle(self) -> int:
        """Move every completion the NIC has into the guest's CQ rings now (the caller holds the lock)."""
        before = self.completed
        self.settle_cqs(cq for _, cq in self.host.state.cqs.items())
        return self.completed - before

    def settle_cqs(self, cqs: Iterable[CqEntry]) -> None:
        for cq in dict.fromkeys(cqs):
            while self._drain_cq(cq):
                pass

    def repost_recvs(self, qp: QpEntry, recvs: list[Any]) -> int:
        """Post receives that were on another QP (a migrated one) on qp, in their order (caller holds the lock)."""
        for wr in recvs:
            self._post_recv_wr(qp, wr)
        return len(recvs)

    def stats(self) -> dict[str, Any]:
        """What the engine did so far, and whether its thread still runs (a daemon's debug dump)."""
        thread = self._thread
        return {"posted": self.posted, "recvs_posted": self.recvs_posted, "completed": self.completed,
                "waits": self.waits, "failed": self.failed, "alive": thread is not None and thread.is_alive(),
                "busy_poll": self.busy_poll}

    # ----- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                if self._step():
                    self._await_peers()
                    continue
                if self.busy_poll:
                    continue
                self._wait()
        except Exception:  # an engine bug must not take the daemon down, nor leave the guest waiting
            log.exception("data-path engine of vRNIC %s failed; ending its session", self.host.vrnic_id)
            self.failed = True
            self.host.engine_failed()

    def _step(self) -> bool:
        host = self.host
        worked = False
        with host.lock:
            if host.closed:
                return False
            if self._rung or self.busy_poll:
                self._rung = False
                host.read_blank_qps()
            for _, qp in host.state.qps.items():
                worked |= self._drain_queues(qp)
            completed = False
            for _, cq in host.state.cqs.items():
                if cq.users:  # a CQ no QP uses gets nothing (a pool's spare): polling it costs a verb call
                    completed |= self._drain_cq(cq)
        # Rung with the lock released (the fd lives until this thread is joined): the write lets other threads
        # run, and one that finds the lock taken gives up posting this guest's receives ahead of a local SEND
        if completed and host.notify_fd is not None:
            with contextlib.suppress(OSError):  # a full counter already means "look"
                os.eventfd_write(host.notify_fd, 1)
        return worked or completed

    def _await_peers(self) -> None:
        """Holding no lock, wait for the peers some SENDs wait for (up to their deadlines) and post their
        receives: taking the peer's lock again at the next step, under this engine's own, would race the peer's
        engine for it, which takes it back at every step."""
        waits, self._peer_waits = self._peer_waits, []
        for qp, deadline in waits:
            left = deadline - time.monotonic()
            if left > 0 and self.host.post_peer_receives(qp, wait=left):
                qp.peer_primed = True

    def _wait(self) -> None:
        self.waits += 1
        host = self.host
        device = host.device
        fds = [self._wake_fd, host.doorbell_fd]
        timeout = IDLE_WAIT_S
        with host.lock:
            if host.closed:
                return
            cqs = [cq for _, cq in host.state.cqs.items() if cq.users]
            by_fd: dict[int, CqEntry] = {}
            for cq in cqs:
                fd = device.cq_event_fd(cq.obj)
                if fd is None:
                    timeout = UNKNOWN_FD_WAIT_S
                    continue
                by_fd[fd] = cq
                if not cq.armed:
                    device.arm_cq(cq.obj)
                    cq.armed = True
            # A completion may have landed between the last poll and arming: look once more.
            if any(self._drain_cq(cq) for cq in cqs):
                return
        # poll(2), not select(2): a busy vrnicd holds descriptors numbered past select's 1024
        poller = select.poll()
        for fd in (*fds, *by_fd):
            poller.register(fd, select.POLLIN)
        try:
            events = poller.poll(timeout * 1000)
        except OSError:
            return
        if any(flags & select.POLLNVAL for _, flags in events):  # an fd closed under us: the session is going away
            return
        if any(fd == host.doorbell_fd for fd, _ in events) or (not events and timeout >= IDLE_WAIT_S):
            self._rung = True
        for fd, _ in events:
            if fd in by_fd:
                cq = by_fd[fd]
                with host.lock:
                    if host.closed or cq.handle not in host.state.cqs:
                        continue
                    device.ack_cq_event(cq.obj)
                    cq.armed = False
            else:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)

    # ----- guest -> NIC ------------------------------------------------------------------------
    def _drain_queues(self, qp: QpEntry, patient: bool = True) -> bool:
        """Move qp's rings to the NIC. patient: a SEND to a local peer whose lock is taken waits for a later step
        (up to PEER_WAIT_S), so that the peer's receives go first; a verb's drain is never patient."""
        worked = False
        sq, rq = qp.sq, qp.rq
        if sq is None or rq is None or qp.held or qp.blank:  # not a shared-ring QP, held by a migration, or empty
            return False
        try:
            # Receives first: one the guest posted before a send must be on the NIC before that send goes out, or
            # the peer's answer finds none (RNR NAK and back-off). A receive posted after a send loses nothing
            # by being early: only arriving SENDs consume receives. All of them (the ring is no longer than the QP's
            # receive queue), so none posted before a send stays behind it.
            worked = self._post_ring_receives(qp, rq) > 0
            primed = qp.peer_id is None  # a local peer's receives go to the NIC before the first WR that needs one
            if qp.peer_primed:  # they went while this engine waited for the peer's lock
                primed, qp.peer_primed, qp.peer_wait_until = True, False, 0.0
            retry, qp.pending = qp.pending, []
            for wr in retry:
                primed = self._post_in_order(qp, wr, primed, patient)
            # While the NIC's send queue is full, leave WRs in the ring: that is the guest's backpressure.
            for slot in [] if qp.pending else sq.consume(BATCH):
                worked = True
                try:
                    wr = unpack_send(slot)
                except InvalidArgument:
                    self._complete(qp.send_cq, Completion(slot[0], WcStatus.LOC_QP_OP_ERR, WcOpcode.SEND,
                                                          qp=qp.vqpn))
                    continue
                primed = self._post_in_order(qp, wr, primed, patient)
        except RingCorrupt as exc:
            sq.set_flag(RingFlags.CORRUPT)
            log.warning("vRNIC %s QP %d: %s; queue marked corrupt", self.host.vrnic_id, qp.vqpn, exc)
        if qp.peer_wait_until:
            worked = True  # step again soon (after _await_peers), not asleep until a doorbell
        return worked

    def _post_in_order(self, qp: QpEntry, wr: Any, primed: bool, patient: bool) -> bool:
        """Post wr behind any WR still waiting; whether the peer's receives are known to be on the NIC now."""
        if not qp.pending and not primed and wr.opcode in CONSUMES_RECV:
            if self.host.post_peer_receives(qp) or not patient or self._out_of_patience(qp):
                qp.peer_wait_until = 0.0  # a verb's drain, or patience ran out: it goes, as if the peer were remote
                primed = True
            else:
                self._peer_waits.append((qp, qp.peer_wait_until))
                qp.pending.append(wr)
                return False
        if qp.pending:
            qp.pending.append(wr)
        else:
            self._post(qp, wr)
        return primed

    @staticmethod
    def _out_of_patience(qp: QpEntry) -> bool:
        now = time.monotonic()
        if not qp.peer_wait_until:
            qp.peer_wait_until = now + PEER_WAIT_S
        return now >= qp.peer_wait_until

    def _physical(self, qp: QpEntry, wr: Any) -> PhysSend:
        """The guest's WR in physical terms, or WrRejected: nothing unchecked reaches the NIC."""
        host = self.host
        sges = local_sges(wr.sges, host.state.mr_by_vkey, writable=wr.opcode in WRITE_OPS)
        if not sges:
            raise WrRejected(WcStatus.LOC_QP_OP_ERR, NO_SGE)
        phys = PhysSend(wr_id=wr.wr_id, opcode=int(wr.opcode), sges=sges, signaled=wr.signaled, imm=wr.imm)
        if wr.opcode in (WrOpcode.SEND, WrOpcode.SEND_WITH_IMM):
            if qp.qp_type == "ud":
                gid = gid_text(wr.ud_gid)
                phys.ah, phys.remote_qpn = host.ud_destination(qp, gid, wr.ud_qpn)
                phys.qkey = wr.ud_qkey
            return phys
        length = 8 if wr.opcode in ATOMICS else sum(s[1] for s in sges)
        phys.remote_addr, phys.rkey = remote_target(wr.opcode, wr.remote_addr, length, wr.rkey, host.peer_mrs(qp))
        if wr.opcode in WRITE_OPS:  # READ responses and atomic results land in the guest's own buffers
            for sge in wr.sges:
                host.nic_writes(sge.addr, sge.length)
        if wr.opcode is not WrOpcode.RDMA_READ:  # WRITEs and atomics land in the peer's
            host.remote_writes(qp, wr.remote_addr, length)
        if wr.opcode in ATOMICS:
            phys.compare_add, phys.swap = wr.compare_add, wr.swap
        return phys

    def _post(self, qp: QpEntry, wr: Any) -> None:
        try:
            phys = self._physical(qp, wr)
        except WrRejected as exc:
            self._reject(qp, wr, exc.status, str(exc))
            return
        except (VrnicError, ValueError) as exc:  # a UD peer vanished or out of reach, an unparsable GID
            self._reject(qp, wr, WcStatus.LOC_QP_OP_ERR, str(exc))
            return
        try:
            self.host.device.post_send(qp.obj, phys)
            self.posted += 1
            qp.send_fifo.append((phys.signaled, wr))
        except SendQueueFull:  # retry after completions
            qp.pending.append(wr)
        except VrnicError as exc:
            self._reject(qp, wr, WcStatus.LOC_QP_OP_ERR, str(exc))

    def post_receives(self, qp: QpEntry) -> None:
        """Move the receives the guest posted on qp to the NIC now, as the next step would (the caller holds the
        session's lock): a SEND from another QP of this vrnicd must find them there."""
        rq = qp.rq
        if rq is None or qp.held:
            return
        posted = self.recvs_posted
        try:
            taken = self._post_ring_receives(qp, rq)
        except RingCorrupt:
            return  # the engine's own step marks the ring
        if self.recvs_posted - posted < taken and self.host.notify_fd is not None:
            with contextlib.suppress(OSError):  # a refused receive completed in the guest's ring: tell it
                os.eventfd_write(self.host.notify_fd, 1)

    def _post_ring_receives(self, qp: QpEntry, rq: Ring) -> int:
        """Every receive in the guest's ring to the NIC (a refused one completes in error); how many were taken."""
        slots = rq.consume(rq.entries)
        for slot in slots:
            self._post_recv(qp, slot)
        return len(slots)

    def _post_recv(self, qp: QpEntry, slot: Any) -> None:
        try:
            wr = unpack_recv(slot)
        except InvalidArgument:
            self._complete(qp.recv_cq, Completion(slot[0], WcStatus.LOC_QP_OP_ERR, WcOpcode.RECV, qp=qp.vqpn))
            return
        self._post_recv_wr(qp, wr)

    def _post_recv_wr(self, qp: QpEntry, wr: Any) -> None:
        try:
            sges = local_sges(wr.sges, self.host.state.mr_by_vkey, writable=True)
            if not sges:
                raise WrRejected(WcStatus.LOC_QP_OP_ERR, NO_SGE)
            self.host.device.post_recv(qp.obj, PhysRecv(wr.wr_id, sges))
            self.recvs_posted += 1
            qp.recv_fifo.append(wr)
            if qp.qp_type == "ud":
                qp.grh_at[wr.wr_id] = sges[0][0]  # where the NIC will write the source's GRH
        except WrRejected as exc:
            self._complete(qp.recv_cq, Completion(wr.wr_id, exc.status, WcOpcode.RECV, qp=qp.vqpn))
        except VrnicError:
            self._complete(qp.recv_cq, Completion(wr.wr_id, WcStatus.LOC_QP_OP_ERR, WcOpcode.RECV, qp=qp.vqpn))

    def _reject(self, qp: QpEntry, wr: Any, status: WcStatus, reason: str) -> None:
        log.info("vRNIC %s QP %d: WR %d refused: %s", self.host.vrnic_id, qp.vqpn, wr.wr_id, reason)
        self._complete(qp.send_cq, Completion(wr.wr_id, status, WC_OF_WR[wr.opcode], qp=qp.vqpn))

    # ----- NIC -> guest ------------------------------------------------------------------------
    def _drain_cq(self, cq: CqEntry) -> bool:
        ring = cq.ring
        if ring is None or ring.flags & (RingFlags.CORRUPT | RingFlags.FAILED):
            return False
        try:
            room = ring.entries - ring.count()
        except RingCorrupt as exc:  # the guest scribbled on its own ring: that CQ is dead, nobody else's
            ring.set_flag(RingFlags.CORRUPT)
            log.warning("vRNIC %s: CQ ring corrupt (%s); CQ stopped", self.host.vrnic_id, exc)
            return False
        if room <= 0:
            return False
        host = self.host
        wcs = host.device.poll_cq(cq.obj, min(room, BATCH))
        for wc in wcs:
            qp = host.state.qp_by_phys.get(wc.qp_num)
            if qp is not None:
                self._retire(qp, wc)
            src = 0
            if qp is not None and qp.qp_type == "ud" and wc.opcode & WcOpcode.RECV:
                grh = qp.grh_at.pop(wc.wr_id, None)
                source = None if grh is None or not wc.wc_flags & WC_GRH else source_gid(ctypes.string_at(grh, 40))
                src = host.source_vqpn(wc.src_qp, source)
            self._complete(cq, Completion(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data,
                                          qp.vqpn if qp else 0, src, wc.wc_flags, wc.vendor_err))
        self.completed += len(wcs)
        return bool(wcs)

    def _retire(self, qp: QpEntry, wc: Any) -> None:
        """Take a completed WR off the QP's account of what the NIC holds."""
        if wc.opcode & WcOpcode.RECV:
            if qp.recv_fifo:  # receives complete in the order they were posted
                wr = qp.recv_fifo.popleft()
                if wc.status == WcStatus.SUCCESS:
                    for sge in wr.sges:
                        self.host.nic_writes(sge.addr, sge.length)
            return
        # Sends complete in order; a signaled one's success means every unsignaled one before it is done too.
        # An error completes one WR, signaled or not.
        if wc.status not in (WcStatus.SUCCESS, WcStatus.WR_FLUSH_ERR) and qp.send_fifo:
            self._log_failed_send(qp, wc, qp.send_fifo[0][1])
        while qp.send_fifo:
            signaled, _ = qp.send_fifo.popleft()
            if signaled or wc.status != WcStatus.SUCCESS:
                return

    def _log_failed_send(self, qp: QpEntry, wc: Any, wr: Any) -> None:
        """A send the NIC failed (not flushed), with the physical QPs and, for a remote access, the peer's window
        the key names now: what tells a stale translation from a bad work request."""
        window: MrWindow | None = None
        if wr.opcode not in (WrOpcode.SEND, WrOpcode.SEND_WITH_IMM):
            try:
                window = (self.host.peer_mrs(qp) or {}).get(wr.rkey)
            except VrnicError as exc:
                log.debug("vRNIC %s: peer windows unavailable: %s", self.host.vrnic_id, exc)
        log.warning("vRNIC %s QP %d (QPN %d -> %s of %s): WR %d (%s) failed with %s (vendor %#x); remote %#x "
                    "key %#x, the peer's window for it now: %s", self.host.vrnic_id, qp.vqpn, qp.phys_qpn,
                    qp.dest_qpn, qp.peer_id, wr.wr_id, WrOpcode(wr.opcode).name, _status_name(wc.status),
                    wc.vendor_err, wr.remote_addr, wr.rkey, window)

    @staticmethod
    def _complete(cq: CqEntry, wc: Completion) -> None:
        ring = cq.ring
        if ring is None:
            return
        try:
            if not ring.produce(pack_completion(wc)):
                ring.set_flag(RingFlags.OVERFLOW)
        except RingCorrupt:
            ring.set_flag(RingFlags.CORRUPT)
