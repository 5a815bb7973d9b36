"""The rxe queue format against the kernel's UAPI layouts (rdma/rdma_user_rxe.h, ib_user_verbs.h)."""

from __future__ import annotations

import struct

import pytest

from vrnic.core.queue_format.base import PhysWr
from vrnic.core.queue_format.rxe import (
    DATA_OFFSET,
    RDMA_VERBS_IOCTL,
    RxeFormat,
    RxeQueue,
    doorbell_command,
    invoke_write,
)

pytestmark = pytest.mark.unit


def u32(buf: bytearray, at: int) -> int:
    return int(struct.unpack_from("<I", buf, at)[0])


def u64(buf: bytearray, at: int) -> int:
    return int(struct.unpack_from("<Q", buf, at)[0])


def test_send_wqe_fields_sit_where_the_kernel_reads_them() -> None:
    buf = bytearray(b"\xff" * 512)  # a slot full of an earlier WQE's leftovers
    wr = PhysWr(0x1122, 0, [(0x7000, 100, 0x11), (0x8000, 28, 0x12)], True, 0, 0xABC000, 0x99)
    RxeFormat().send_wqe(memoryview(buf), 0, wr, 7)
    assert u64(buf, 0) == 0x1122 and u32(buf, 8) == 2 and u32(buf, 12) == 0  # wr_id, num_sge, IB_WR_RDMA_WRITE
    assert u32(buf, 16) == 2 and u32(buf, 20) == 0  # IB_SEND_SIGNALED, imm
    assert u64(buf, 24) == 0xABC000 and u32(buf, 32) == 0x99  # wr.rdma.remote_addr, rkey
    assert buf[36:144] == bytes(108)  # the rest of the union is cleared
    assert u32(buf, 144) == 0 and u32(buf, 148) == 0  # status, state: posted
    assert u64(buf, 152) == 0xABC000 and u32(buf, 176) == 7  # iova, ssn
    assert [u32(buf, 184 + 4 * i) for i in range(6)] == [128, 128, 0, 2, 0, 0]  # dma: length resid cur num off
    assert (u64(buf, 208), u32(buf, 216), u32(buf, 220)) == (0x7000, 100, 0x11)
    assert (u64(buf, 224), u32(buf, 232), u32(buf, 236)) == (0x8000, 28, 0x12)


def test_atomic_wqe_uses_the_atomic_union() -> None:
    buf = bytearray(256)
    RxeFormat().send_wqe(memoryview(buf), 0, PhysWr(1, 6, [(0x10, 8, 3)], False, 0, 0x2000, 0x44, 5, 9), 0)
    assert u32(buf, 12) == 6 and u32(buf, 16) == 0  # FETCH_AND_ADD, unsignaled
    assert (u64(buf, 24), u64(buf, 32), u64(buf, 40), u32(buf, 48)) == (0x2000, 5, 9, 0x44)
    assert u64(buf, 152) == 0x2000


def test_recv_wqe_and_cqe() -> None:
    buf = bytearray(b"\xff" * 128)
    RxeFormat().recv_wqe(memoryview(buf), 0, 77, [(0x100, 64, 5)])
    assert u64(buf, 0) == 77 and u32(buf, 8) == 1
    assert [u32(buf, 16 + 4 * i) for i in range(6)] == [64, 64, 0, 1, 0, 0]
    assert (u64(buf, 40), u32(buf, 48), u32(buf, 52)) == (0x100, 64, 5)
    cqe = bytearray(64)
    struct.pack_into("<QIIIIIIII", cqe, 0, 9, 0, 128, 0, 40, 0x01020304, 0x11, 0x22, 2)
    wc = RxeFormat().parse_cqe(memoryview(cqe), 0)
    assert (wc.wr_id, wc.opcode, wc.byte_len, wc.imm_data, wc.qp_num, wc.src_qp, wc.wc_flags) == \
        (9, 128, 40, 0x01020304, 0x11, 0x22, 2)


def test_queue_indices_and_slots() -> None:
    buf = bytearray(DATA_OFFSET + 4 * 64)
    struct.pack_into("<II", buf, 0, 6, 3)  # log2_elem_size 6, index_mask 3 (four slots)
    view = memoryview(buf)
    q = RxeQueue(view, view.cast("I"))
    assert q.empty() and not q.full() and q.slot(5) == DATA_OFFSET + 64
    for _ in range(3):
        q.advance_producer()
    assert q.full() and q.producer == 3
    q.advance_consumer()
    assert not q.full() and q.consumer == 1
    with pytest.raises(ValueError, match="not an rxe queue"):
        bad = bytearray(DATA_OFFSET)
        struct.pack_into("<II", bad, 0, 6, 5)
        RxeQueue(memoryview(bad), memoryview(bad).cast("I"))


def test_the_doorbell_ioctl_buffer() -> None:
    assert doorbell_command(3) == struct.pack("<QIIII", 0, 3, 0, 0, 56)
    buf = invoke_write(28, (0x1000, 24), (0x2000, 4))
    length, obj, method, nattrs, _, driver, _ = struct.unpack_from("<HHHHQII", buf)
    assert (length, obj, method, nattrs, driver) == (24 + 3 * 16, 0, 0, 3, 14) and len(buf) == length
    attrs = [struct.unpack_from("<HHHHQ", buf, 24 + 16 * i) for i in range(3)]
    assert attrs == [(2, 8, 1, 0, 28), (0, 24, 1, 0, 0x1000), (1, 4, 1, 0, 0x2000)]
    assert RDMA_VERBS_IOCTL == 0xC0181B01
