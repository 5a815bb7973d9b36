"""The guest's end of the direct engine: the NIC's own queues, mapped here and driven without vrnicd.

vrnicd created the objects on the vRNIC's own ucontext and passed its fd with
the attach reply. Here each queue is mapped from that fd, WRs are translated
(virtual lkeys, rkeys and QPNs to physical ones, guest addresses to the
addresses the NIC registered) and written in the NIC's format, and the send
doorbell is one ioctl. Posting a receive and polling are plain memory access.
Translations come from vrnicd's replies and are kept in a table here; vrnicd
can replace an entry (live migration will need that). Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vrnic.core.queue_format.base import PhysWr
from vrnic.core.queue_format.rxe import (
    CMD_POST_SEND,
    CONSUMER_OFFSET,
    POST_SEND_IN,
    PRODUCER_OFFSET,
    RDMA_VERBS_IOCTL,
    RxeFormat,
    RxeQueue,
    doorbell_command,
    invoke_write,
)
from vrnic.core.rings import Completion, RecvRequest, SendRequest, WrOpcode
from vrnic.errors import DeviceError, NotSupported, VrnicError

FORMATS = {"rxe": RxeFormat}
REMOTE_OPS = frozenset({int(WrOpcode.RDMA_WRITE), int(WrOpcode.RDMA_WRITE_WITH_IMM), int(WrOpcode.RDMA_READ),
                        int(WrOpcode.ATOMIC_CMP_AND_SWP), int(WrOpcode.ATOMIC_FETCH_AND_ADD)})
_PRODUCER, _CONSUMER = PRODUCER_OFFSET // 4, CONSUMER_OFFSET // 4  # index words of an rxe queue


@dataclass(frozen=True)
class PhysKey:
    key: int  # the physical lkey or rkey
    iova_base: int  # the NIC knows address a of this MR (as its owner names it) as iova_base + a


class DirectDevice:
    """The vRNIC's uverbs fd and the guest's translation table."""

    def __init__(self, fd: int, generation_fd: int, queue_format: str, call: Callable[..., dict[str, Any]]) -> None:
        fmt = FORMATS.get(queue_format)
        try:
            if fmt is None:
                raise NotSupported(f"no direct queue format {queue_format!r} in this frontend")
            # vrnicd's generation of the translations (read-only here): when it moves, re-read the table.
            self._generation_map = mmap.mmap(generation_fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.close(generation_fd)
        self._generation = memoryview(self._generation_map).cast("Q")
        self.seen = int(self._generation[0])
        self.fd = fd
        self.format = fmt()
        self.call = call
        self.local: dict[int, PhysKey] = {}  # virtual lkey -> physical
        self.remote: dict[tuple[int, int], PhysKey] = {}  # (QP handle, virtual rkey) -> physical
        self.vqpn: dict[int, int] = {}  # physical QPN -> virtual
        self.mapped: list[DirectCq | DirectQp] = []  # a mapping holds the ucontext open: unmap all at close

    def map(self, queue: dict[str, int]) -> tuple[mmap.mmap, RxeQueue]:
        try:
            mapping = mmap.mmap(self.fd, queue["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                                offset=queue["offset"])
        except OSError as exc:
            raise DeviceError(f"map the NIC queue at {queue['offset']:#x}: {exc.strerror}", exc.errno or 0) from exc
        view = memoryview(mapping)
        return mapping, RxeQueue(view, view.cast("I"))

    def current(self) -> None:
        """Bring the table up to vrnicd's generation (one memory read when nothing changed)."""
        if self._generation[0] == self.seen:
            return
        reply = self.call("translations")
        self.local = {int(v): PhysKey(int(k), int(b)) for v, k, b in reply["mrs"]}
        self.remote.clear()  # resolved again on next use
        self.seen = int(reply["generation"])

    def learn_mr(self, reply: dict[str, Any]) -> None:
        self.local[int(reply["lkey"])] = PhysKey(int(reply["phys_lkey"]), int(reply["iova_base"]))

    def forget_mr(self, vkey: int) -> None:
        self.local.pop(vkey, None)

    def sges(self, sges: Iterable[Any]) -> list[tuple[int, int, int]]:
        """Guest SGEs in the NIC's terms. An unknown key goes through as it is: the kernel's PD check
        turns it into an error completion, as it would on the shared-ring engine."""
        out = []
        for sge in sges:
            key = self.local.get(sge.lkey)
            out.append((sge.addr, sge.length, sge.lkey) if key is None
                       else (key.iova_base + sge.addr, sge.length, key.key))
        return out

    def remote_key(self, qp_handle: int, rkey: int) -> PhysKey | None:
        found = self.remote.get((qp_handle, rkey))
        if found is None:
            try:
                reply = self.call("resolve_rkey", qp=qp_handle, rkey=rkey)
            except VrnicError:
                return None  # the NIC refuses it with a remote access error
            found = self.remote[(qp_handle, rkey)] = PhysKey(int(reply["rkey"]), int(reply["iova_base"]))
        return found

    def close(self) -> None:
        for queue in list(self.mapped):
            queue.close()
        if not self._generation_map.closed:
            self._generation.release()
            self._generation_map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectCq:
    def __init__(self, device: DirectDevice, reply: dict[str, Any]) -> None:
        self.device = device
        self.mapping, self.queue = device.map(reply["queue"])
        device.mapped.append(self)

    def poll(self, max_entries: int) -> list[Completion]:
        queue = self.queue
        words, mask = queue.words, queue.mask
        cons = words[_CONSUMER] & mask
        available = (words[_PRODUCER] - cons) & mask  # the kernel stores its index after the CQE
        if not available:
            return []
        parse, vqpn, buf = self.device.format.parse_cqe, self.device.vqpn, queue.buf
        done: list[Completion] = []
        for _ in range(min(available, max_entries)):
            wc = parse(buf, queue.slot(cons))
            cons = (cons + 1) & mask
            words[_CONSUMER] = cons  # the slot is free for the kernel once we have read it
            done.append(Completion(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data, vqpn.get(wc.qp_num, 0),
                                   wc.src_qp, wc.wc_flags, wc.vendor_err))
        return done

    def close(self) -> None:
        if self in self.device.mapped:
            self.device.mapped.remove(self)
        self.queue.words.release()
        self.queue.buf.release()
        self.mapping.close()


class DirectQp:
    def __init__(self, device: DirectDevice, handle: int, reply: dict[str, Any]) -> None:
        self.device = device
        self.handle = handle
        self.sq_mapping, self.sq = device.map(reply["sq"])
        try:
            self.rq_mapping, self.rq = device.map(reply["rq"])
        except BaseException:
            self.sq.words.release()
            self.sq.buf.release()
            self.sq_mapping.close()
            raise
        device.mapped.append(self)
        device.vqpn[int(reply["phys_qpn"])] = int(reply["qpn"])
        self.ssn = 0
        # The doorbell: an empty POST_SEND through the ioctl path, built once.
        self._in = ctypes.create_string_buffer(doorbell_command(int(reply["doorbell_handle"])), POST_SEND_IN.size)
        self._out = ctypes.create_string_buffer(4)
        self._doorbell = invoke_write(CMD_POST_SEND, (ctypes.addressof(self._in), POST_SEND_IN.size),
                                      (ctypes.addressof(self._out), 4))

    def post_send(self, wrs: list[SendRequest], doorbell: bool = True) -> None:
        device, sq, encode = self.device, self.sq, self.device.format.send_wqe
        device.current()
        words, mask = sq.words, sq.mask
        prod = words[_PRODUCER] & mask  # read, not cached: a QP reset rewinds the kernel's queue
        cons = words[_CONSUMER] & mask
        for wr in wrs:
            if (prod + 1 - cons) & mask == 0:
                cons = words[_CONSUMER] & mask
                if (prod + 1 - cons) & mask == 0:
                    raise DeviceError("send queue full", errno.ENOMEM)
            phys = PhysWr(wr.wr_id, int(wr.opcode), device.sges(wr.sges), wr.signaled, wr.imm, wr.remote_addr,
                          wr.rkey, wr.compare_add, wr.swap)
            if phys.opcode in REMOTE_OPS:
                key = device.remote_key(self.handle, wr.rkey)
                if key is not None:
                    phys.rkey, phys.remote_addr = key.key, key.iova_base + wr.remote_addr
            encode(sq.buf, sq.slot(prod), phys, self.ssn)
            self.ssn += 1
            prod = (prod + 1) & mask
            words[_PRODUCER] = prod  # after the WQE: the kernel reads the index, then the slot
        if doorbell:
            self.ring()

    def ring(self) -> None:
        try:
            fcntl.ioctl(self.device.fd, RDMA_VERBS_IOCTL, self._doorbell)
        except OSError as exc:
            raise DeviceError(f"send doorbell: {exc.strerror}", exc.errno or 0) from exc

    def post_recv(self, wrs: list[RecvRequest]) -> None:
        device, rq, encode = self.device, self.rq, self.device.format.recv_wqe
        device.current()
        for wr in wrs:
            if rq.full():
                raise DeviceError("receive queue full", errno.ENOMEM)
            encode(rq.buf, rq.slot(rq.producer), wr.wr_id, device.sges(wr.sges))
            rq.advance_producer()

    def close(self) -> None:
        if self in self.device.mapped:
            self.device.mapped.remove(self)
        for queue, mapping in ((self.sq, self.sq_mapping), (self.rq, self.rq_mapping)):
            queue.words.release()
            queue.buf.release()
            mapping.close()
