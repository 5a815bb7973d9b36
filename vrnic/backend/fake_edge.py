"""An in-memory RNIC for host tests: the session, the engine and isolation, without a kernel.

It behaves like a small RoCE fabric inside one process: devices with RoCE v2
GIDs, QPs that move bytes with memmove (SEND/RECV, RDMA WRITE/READ, atomics),
CQs with a completion-channel eventfd. It checks what a NIC checks (QP state,
the responder's rkey and access), so the vrnic checks in front of it must be
tested by what reaches it: every work request that got here is in `posted`.
It never stands in for the kernel-tier tests on real rxe.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import os
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vrnic.backend.rnic_edge import (
    PORT,
    DeviceContext,
    DeviceLimits,
    PhysCompletion,
    PhysRecv,
    PhysSend,
    PortAttrs,
    QpCaps,
    RnicEdge,
    RtrParams,
    RtsParams,
    SendQueueFull,
)
from vrnic.core.rings import WC_OF_WR, Access, WcOpcode, WcStatus, WrOpcode
from vrnic.core.specs import DeviceInfo, GidEntry, PortInfo
from vrnic.errors import DeviceError, NotFound

WC_GRH = 1
GRH_BYTES = 40
_ATOMIC = struct.Struct("<Q")
_T = TypeVar("_T")


@dataclass(eq=False)
class FakeMr:
    ctx: FakeContext
    address: int
    length: int
    access: int
    lkey: int
    rkey: int

    def covers(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length


@dataclass(eq=False)
class FakeCq:
    cqe: int
    event_fd: int
    entries: deque[PhysCompletion] = field(default_factory=deque)
    armed: bool = False


@dataclass(eq=False)
class FakeQp:
    ctx: FakeContext
    qpn: int
    qp_type: str
    send_cq: FakeCq
    recv_cq: FakeCq
    caps: QpCaps
    state: str = "reset"
    dest: tuple[str, int] | None = None  # RC: (GID, QPN) of the peer
    recvs: deque[PhysRecv] = field(default_factory=deque)
    inbox: deque[tuple[FakeQp, PhysSend, bytes]] = field(default_factory=deque)  # sends waiting for a recv
    in_flight: int = 0  # sends not completed yet (to model a full send queue)
    timeout: int = 0  # RC: what RTS set


@dataclass(frozen=True)
class FakeAh:
    gid: str


class FakeEdge(RnicEdge):
    def __init__(self, devices: tuple[str, ...] = ("fake0", "fake1")) -> None:
        self.gids = {name: f"::ffff:10.99.0.{i + 1}" for i, name in enumerate(devices)}
        self.lock = threading.RLock()  # one lock for the whole fabric, as the engine threads race
        self.qps: dict[tuple[str, int], FakeQp] = {}
        self.mrs_by_rkey: dict[tuple[str, int], FakeMr] = {}
        self.posted: list[tuple[int, PhysSend]] = []  # (physical QPN, WR): what reached a NIC
        self.rnr_naks = 0  # SENDs that found no receive posted (an RC responder answers RNR NAK; the send waits)
        self.live: set[int] = set()  # ids of objects not destroyed yet, for leak checks
        self.open_contexts = 0
        self._numbers = itertools.count(0x100)

    def device_names(self) -> list[str]:
        return sorted(self.gids)

    def describe(self, name: str) -> DeviceInfo:
        if name not in self.gids:
            raise NotFound(f"no RDMA device {name}")
        return DeviceInfo(name=name, driver="verbs", node_guid="0200:00ff:fe00:0001",
                          ports=[PortInfo(port=PORT, state="ACTIVE", mtu=1024,
                                          gids=[GidEntry(index=1, gid=self.gids[name], type="RoCE v2")])],
                          caps={"max_qp": 1024, "max_cq": 1024, "max_mr": 4096, "max_pd": 256})

    def open(self, name: str) -> FakeContext:
        if name not in self.gids:
            raise NotFound(f"no RDMA device {name}")
        with self.lock:
            self.open_contexts += 1
        return FakeContext(self, name)

    def number(self) -> int:
        return next(self._numbers)


class FakeContext(DeviceContext):
    def __init__(self, edge: FakeEdge, name: str) -> None:
        self.edge = edge
        self.gid = edge.gids[name]
        self.closed = False

    def _new(self, obj: _T) -> _T:
        self.edge.live.add(id(obj))
        return obj

    def query_device(self) -> DeviceLimits:
        return DeviceLimits(max_qp=1024, max_cq=1024, max_mr=4096, max_pd=256, max_cqe=65536, max_qp_wr=4096,
                            max_sge=4, atomic_caps=1)

    def query_port(self, port: int) -> PortAttrs:
        return PortAttrs(state=4, active_mtu=3, max_mtu=5)

    def alloc_pd(self) -> object:
        return self._new(object())

    def reg_mr(self, pd: Any, address: int, length: int, access: int) -> tuple[FakeMr, int, int]:
        with self.edge.lock:
            key = self.edge.number()
            mr = FakeMr(self, address, length, access, lkey=key, rkey=key)
            self.edge.mrs_by_rkey[(self.gid, key)] = mr
        return self._new(mr), key, key

    def create_cq(self, cqe: int) -> FakeCq:
        return self._new(FakeCq(cqe, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)))

    def cq_event_fd(self, cq: FakeCq) -> int | None:
        return cq.event_fd

    def create_qp(self, pd: Any, send_cq: FakeCq, recv_cq: FakeCq, qp_type: str, caps: QpCaps) -> tuple[FakeQp, int]:
        with self.edge.lock:
            qp = FakeQp(self, self.edge.number(), qp_type, send_cq, recv_cq, caps)
            self.edge.qps[(self.gid, qp.qpn)] = qp
        return self._new(qp), qp.qpn

    def qp_to_init(self, qp: FakeQp, qp_type: str, access: int, qkey: int) -> None:
        self._transition(qp, ("reset", "init"), "init")

    def qp_to_rtr(self, qp: FakeQp, qp_type: str, params: RtrParams | None) -> None:
        self._transition(qp, ("init",), "rtr")
        if params is not None:
            qp.dest = (params.dgid, params.dest_qpn)

    def qp_to_rts(self, qp: FakeQp, qp_type: str, params: RtsParams) -> None:
        self._transition(qp, ("rtr",), "rts")
        qp.timeout = params.timeout

    def query_rc_timeout(self, qp: FakeQp) -> int:
        return qp.timeout

    def qp_to_state(self, qp: FakeQp, state: str) -> None:
        with self.edge.lock:
            qp.state = state
            if state == "reset":  # what was posted is dropped, without completions, as a NIC does
                qp.dest = None
                qp.recvs.clear()
                for other in self.edge.qps.values():
                    kept = [w for w in other.inbox if w[0] is not qp]
                    other.inbox.clear()
                    other.inbox.extend(kept)
                qp.in_flight = 0

    @staticmethod
    def _transition(qp: FakeQp, allowed: tuple[str, ...], to: str) -> None:
        if qp.state not in allowed:
            raise DeviceError(f"modify QP to {to}: Invalid argument (QP is in {qp.state})", 22)
        qp.state = to

    def query_qp_state(self, qp: FakeQp) -> str:
        return qp.state

    def create_ah(self, pd: Any, dgid: str, sgid_index: int) -> FakeAh:
        return self._new(FakeAh(dgid))

    # ----- the data path -------------------------------------------------------------------------
    def post_send(self, qp: FakeQp, wr: PhysSend) -> None:
        edge = self.edge
        with edge.lock:
            if qp.state != "rts":
                raise DeviceError(f"post send: QP is in {qp.state}", 22)
            if qp.in_flight >= qp.caps.max_send_wr:
                raise SendQueueFull("post send: the send queue is full", 12)
            edge.posted.append((qp.qpn, wr))
            status = self._execute(qp, wr)
            if status is not None and (wr.signaled or status != WcStatus.SUCCESS):
                self._complete(qp.send_cq, PhysCompletion(wr.wr_id, status, WC_OF_WR[WrOpcode(wr.opcode)],
                                                          qp_num=qp.qpn))

    def _execute(self, qp: FakeQp, wr: PhysSend) -> int | None:
        """Carry out one WR; its completion status, or None while a SEND waits for a receive."""
        opcode = WrOpcode(wr.opcode)
        dest_gid, dest_qpn = (wr.ah.gid, wr.remote_qpn) if wr.ah is not None else (qp.dest or ("", 0))
        dest = self.edge.qps.get((dest_gid, dest_qpn))
        if opcode in (WrOpcode.SEND, WrOpcode.SEND_WITH_IMM):
            if dest is None:
                return WcStatus.GENERAL_ERR if wr.ah is not None else WcStatus.REM_ACCESS_ERR
            if dest.inbox or not dest.recvs:
                self.edge.rnr_naks += 1
            dest.inbox.append((qp, wr, b"".join(ctypes.string_at(a, n) for a, n, _ in wr.sges)))
            qp.in_flight += 1
            self._deliver(dest)
            return None
        if dest is None:
            return WcStatus.REM_ACCESS_ERR
        length = sum(n for _, n, _ in wr.sges)
        need = {WrOpcode.RDMA_READ: Access.REMOTE_READ}.get(opcode, Access.REMOTE_WRITE)
        if opcode in (WrOpcode.ATOMIC_CMP_AND_SWP, WrOpcode.ATOMIC_FETCH_AND_ADD):
            need, length = Access.REMOTE_ATOMIC, 8
        mr = self.edge.mrs_by_rkey.get((dest_gid, wr.rkey))
        if mr is None or mr.ctx is not dest.ctx or not mr.covers(wr.remote_addr, length) or not mr.access & need:
            return WcStatus.REM_ACCESS_ERR
        if opcode in (WrOpcode.RDMA_WRITE, WrOpcode.RDMA_WRITE_WITH_IMM):
            at = wr.remote_addr
            for address, n, _ in wr.sges:
                ctypes.memmove(at, address, n)
                at += n
            if opcode == WrOpcode.RDMA_WRITE_WITH_IMM:
                if not dest.recvs:
                    return WcStatus.GENERAL_ERR  # a real NIC would RNR-retry; tests post receives first
                recv = dest.recvs.popleft()
                self._complete(dest.recv_cq, PhysCompletion(recv.wr_id, WcStatus.SUCCESS, WcOpcode.RECV_RDMA_WITH_IMM,
                                                            length, wr.imm, dest.qpn, qp.qpn))
        elif opcode == WrOpcode.RDMA_READ:
            at = wr.remote_addr
            for address, n, _ in wr.sges:
                ctypes.memmove(address, at, n)
                at += n
        else:
            (old,) = _ATOMIC.unpack(ctypes.string_at(wr.remote_addr, 8))
            if opcode == WrOpcode.ATOMIC_FETCH_AND_ADD:
                new = (old + wr.compare_add) % (1 << 64)
            else:
                new = wr.swap if old == wr.compare_add else old
            ctypes.memmove(wr.remote_addr, _ATOMIC.pack(new), 8)
            ctypes.memmove(wr.sges[0][0], _ATOMIC.pack(old), 8)
        return WcStatus.SUCCESS

    def _deliver(self, dest: FakeQp) -> None:
        """Match waiting sends with posted receives, in order."""
        while dest.inbox and dest.recvs:
            sender, wr, data = dest.inbox.popleft()
            recv = dest.recvs.popleft()
            sender.in_flight -= 1
            payload = data
            flags = 0
            if dest.qp_type == "ud":  # the NIC writes a GRH first; RoCE v2 over IPv4: source IPv4 at byte 32
                source = ipaddress.IPv6Address(sender.ctx.gid).ipv4_mapped
                grh = bytes(20) + bytes(12) + (source.packed if source else bytes(4)) + bytes(4)
                payload, flags = grh + data, WC_GRH
            room = sum(n for _, n, _ in recv.sges)
            status = WcStatus.SUCCESS if len(payload) <= room else WcStatus.LOC_PROT_ERR  # IBV_WC_LOC_LEN_ERR
            if status == WcStatus.SUCCESS:
                at = 0
                for address, n, _ in recv.sges:
                    chunk = payload[at:at + n]
                    ctypes.memmove(address, chunk, len(chunk))
                    at += n
            self._complete(dest.recv_cq, PhysCompletion(recv.wr_id, status, WcOpcode.RECV, len(data), wr.imm,
                                                        dest.qpn, sender.qpn, flags))
            if wr.signaled:
                self._complete(sender.send_cq, PhysCompletion(wr.wr_id, WcStatus.SUCCESS, WcOpcode.SEND,
                                                              qp_num=sender.qpn))

    def post_recv(self, qp: FakeQp, wr: PhysRecv) -> None:
        with self.edge.lock:
            if qp.state == "reset":
                raise DeviceError("post recv: QP is in reset", 22)
            qp.recvs.append(wr)
            self._deliver(qp)

    def _complete(self, cq: FakeCq, wc: PhysCompletion) -> None:
        cq.entries.append(wc)
        if cq.armed:
            cq.armed = False
            os.eventfd_write(cq.event_fd, 1)

    def poll_cq(self, cq: FakeCq, max_entries: int) -> list[PhysCompletion]:
        with self.edge.lock:
            return [cq.entries.popleft() for _ in range(min(max_entries, len(cq.entries)))]

    def arm_cq(self, cq: FakeCq) -> None:
        with self.edge.lock:
            cq.armed = True
            if cq.entries:
                cq.armed = False
                os.eventfd_write(cq.event_fd, 1)

    def ack_cq_event(self, cq: FakeCq) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(cq.event_fd)

    # ----- teardown --------------------------------------------------------------------------------
    def destroy(self, *objects: Any) -> None:
        with self.edge.lock:
            for obj in objects:
                if obj is None:
                    continue
                self.edge.live.discard(id(obj))
                if isinstance(obj, FakeQp):
                    self.edge.qps.pop((self.gid, obj.qpn), None)
                elif isinstance(obj, FakeMr):
                    self.edge.mrs_by_rkey.pop((self.gid, obj.rkey), None)
                elif isinstance(obj, FakeCq):
                    with contextlib.suppress(OSError):
                        os.close(obj.event_fd)

    def reusable(self) -> bool:
        return not self.closed  # nothing it destroys can fail

    def close(self) -> None:
        with self.edge.lock:
            if not self.closed:
                self.closed = True
                self.edge.open_contexts -= 1
