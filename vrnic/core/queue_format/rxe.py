"""Soft-RoCE (rxe): queue layout, WQE and CQE formats, and the doorbell command.

Layouts follow the kernel's UAPI header rdma/rdma_user_rxe.h (struct rxe_queue_buf,
rxe_send_wqe, rxe_recv_wqe) and ib_user_verbs.h (struct ib_uverbs_wc), as
librxe fills them (rdma-core providers/rxe). rxe's queues are kernel memory that
the guest maps through the uverbs fd; indices are kept masked to index_mask.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from vrnic.core.queue_format.base import PhysWr, QueueFormat, RawCompletion

# struct rxe_queue_buf: log2_elem_size, index_mask, then producer and consumer indices on their own lines.
_LOG2_ELEM, _INDEX_MASK, PRODUCER_OFFSET, CONSUMER_OFFSET, DATA_OFFSET = 0, 4, 128, 256, 384
_PRODUCER, _CONSUMER = PRODUCER_OFFSET, CONSUMER_OFFSET

SEND_WQE_HEADER = 208  # sizeof(struct rxe_send_wqe) before its SGEs
RECV_WQE_HEADER = 40  # sizeof(struct rxe_recv_wqe) before its SGEs
SGE_BYTES = 16  # struct rxe_sge: addr u64, length u32, lkey u32
CQE_BYTES = 48  # struct ib_uverbs_wc, how rxe writes a completion for a user CQ

IB_SEND_SIGNALED = 2
ATOMIC_OPCODES = (5, 6)  # IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD

# A whole rxe_send_wqe header in one pack (pad bytes are written as zeros, which also clears what the
# slot's previous WQE and the kernel's bookkeeping for it left there):
#   rxe_send_wr: wr_id, num_sge (librxe's name for the reserved word), opcode, send_flags, imm, then the
#   wr union (120 bytes) as wr.rdma (remote_addr, rkey) or wr.atomic (remote_addr, compare_add, swap, rkey);
#   status, state (zero: posted), iova at 152, mask, first_psn, last_psn, ack_length, ssn at 176, has_rd_atomic;
#   dma at 184: length, resid, cur_sge, num_sge, sge_offset, reserved.
_SEND_RDMA = struct.Struct("<QIIIIQI108xIIQIIIIII" + "IIIIII")
_SEND_ATOMIC = struct.Struct("<QIIIIQQQI92xIIQIIIIII" + "IIIIII")
_SGE = struct.Struct("<QII")
_RECV = struct.Struct("<QII" + "IIIIII")  # rxe_recv_wqe: wr_id, num_sge, padding, then rxe_dma_info
_WC = struct.Struct("<QIIIIIIII")  # wr_id status opcode vendor_err byte_len imm qp_num src_qp wc_flags


class RxeFormat(QueueFormat):
    name: ClassVar[str] = "rxe"

    def send_wqe(self, buf: memoryview, at: int, wr: PhysWr, ssn: int) -> None:
        sges = wr.sges
        count = len(sges)
        length = sges[0][1] if count == 1 else sum(s[1] for s in sges)
        flags = IB_SEND_SIGNALED if wr.signaled else 0
        if wr.opcode in ATOMIC_OPCODES:
            _SEND_ATOMIC.pack_into(buf, at, wr.wr_id, count, wr.opcode, flags, wr.imm, wr.remote_addr,
                                   wr.compare_add, wr.swap, wr.rkey, 0, 0, wr.remote_addr, 0, 0, 0, 0,
                                   ssn & 0xFFFFFFFF, 0, length, length, 0, count, 0, 0)
        else:
            _SEND_RDMA.pack_into(buf, at, wr.wr_id, count, wr.opcode, flags, wr.imm, wr.remote_addr, wr.rkey,
                                 0, 0, wr.remote_addr, 0, 0, 0, 0, ssn & 0xFFFFFFFF, 0, length, length, 0, count, 0, 0)
        for i, (addr, sge_len, lkey) in enumerate(sges):
            _SGE.pack_into(buf, at + SEND_WQE_HEADER + i * SGE_BYTES, addr, sge_len, lkey)

    def recv_wqe(self, buf: memoryview, at: int, wr_id: int, sges: list[tuple[int, int, int]]) -> None:
        count = len(sges)
        length = sges[0][1] if count == 1 else sum(s[1] for s in sges)
        _RECV.pack_into(buf, at, wr_id, count, 0, length, length, 0, count, 0, 0)
        for i, (addr, sge_len, lkey) in enumerate(sges):
            _SGE.pack_into(buf, at + RECV_WQE_HEADER + i * SGE_BYTES, addr, sge_len, lkey)

    def parse_cqe(self, buf: memoryview, at: int) -> RawCompletion:
        wr_id, status, opcode, vendor_err, byte_len, imm, qp_num, src_qp, wc_flags = _WC.unpack_from(buf, at)
        return RawCompletion(wr_id, status, opcode, byte_len, imm, qp_num, src_qp, wc_flags, vendor_err)


@dataclass
class RxeQueue:
    """One mapped rxe queue (SQ, RQ or CQ). `words` is a 32-bit view of the same mapping: indices are
    written with one aligned 32-bit store each (see vrnic.core.rings.index_words for why)."""

    buf: memoryview
    words: memoryview

    def __post_init__(self) -> None:
        self.log2_elem = self.words[_LOG2_ELEM // 4]
        self.mask = self.words[_INDEX_MASK // 4]
        slots = self.mask + 1
        if self.log2_elem > 16 or slots & self.mask or DATA_OFFSET + (slots << self.log2_elem) > len(self.buf):
            raise ValueError(f"not an rxe queue: log2_elem_size {self.log2_elem}, index_mask {self.mask:#x}, "
                             f"{len(self.buf)} bytes mapped")
        self.elem_size = 1 << self.log2_elem

    @property
    def producer(self) -> int:
        return self.words[_PRODUCER // 4] & self.mask

    @property
    def consumer(self) -> int:
        return self.words[_CONSUMER // 4] & self.mask

    def slot(self, index: int) -> int:
        return DATA_OFFSET + ((index & self.mask) << self.log2_elem)

    def full(self) -> bool:
        return (self.producer + 1 - self.consumer) & self.mask == 0

    def empty(self) -> bool:
        return (self.producer - self.consumer) & self.mask == 0

    def advance_producer(self) -> None:
        self.words[_PRODUCER // 4] = (self.producer + 1) & self.mask

    def advance_consumer(self) -> None:
        self.words[_CONSUMER // 4] = (self.consumer + 1) & self.mask


# ----- the send doorbell: INVOKE_WRITE(POST_SEND) through the uverbs ioctl ------------------------------
# write() on the uverbs fd checks the opener's credentials; the ioctl path does not (see ../shared/FACTS.md).
RDMA_VERBS_IOCTL = 0xC0181B01
RDMA_DRIVER_RXE = 14
CMD_POST_SEND = 28  # IB_USER_VERBS_CMD_POST_SEND
ATTR_CORE_IN, ATTR_CORE_OUT, ATTR_WRITE_CMD = 0, 1, 2
ATTR_MANDATORY = 1
SEND_WR_BYTES = 56  # sizeof(struct ib_uverbs_send_wr): the kernel insists on at least this as wqe_size
_IOCTL_HDR = struct.Struct("<HHHHQII")
_IOCTL_ATTR = struct.Struct("<HHHHQ")
POST_SEND_IN = struct.Struct("<QIIII")  # response, qp_handle, wr_count 0, sge_count 0, wqe_size


def doorbell_command(qp_handle: int) -> bytes:
    """The CORE_IN body of an empty POST_SEND: 'look at the send queue' (what librxe's doorbell writes)."""
    return POST_SEND_IN.pack(0, qp_handle, 0, 0, SEND_WR_BYTES)


def invoke_write(command: int, core_in: tuple[int, int], core_out: tuple[int, int]) -> bytearray:
    """An ioctl buffer for one legacy write command: (address, length) of its input and output bodies."""
    attrs = [(ATTR_WRITE_CMD, 8, command), (ATTR_CORE_IN, core_in[1], core_in[0]),
             (ATTR_CORE_OUT, core_out[1], core_out[0])]
    buf = bytearray(_IOCTL_HDR.pack(_IOCTL_HDR.size + _IOCTL_ATTR.size * len(attrs), 0, 0, len(attrs), 0,
                                    RDMA_DRIVER_RXE, 0))
    for attr_id, length, data in attrs:
        buf += _IOCTL_ATTR.pack(attr_id, length, ATTR_MANDATORY, 0, data)
    return buf
