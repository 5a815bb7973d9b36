"""The mlx5 queue format (vrnic.core.queue_format.mlx5) against hand-computed bytes.

Every expected byte string below was written out by hand from the layouts in
mlx5dv.h (ctrl 16 B, raddr 16 B, atomic 16 B, data 16 B; mlx5_cqe64 and
mlx5_err_cqe), not produced by the code under test.
"""

from __future__ import annotations

import struct

import pytest

from vrnic.core.queue_format import mlx5 as m
from vrnic.core.queue_format.base import PhysWr
from vrnic.core.rings import WcOpcode, WrOpcode
from vrnic.errors import InvalidArgument, NotSupported

pytestmark = pytest.mark.unit


def hx(text: str) -> bytes:
    return bytes.fromhex(text.replace("|", " "))


# ----- send WQEs ---------------------------------------------------------------------------------------------
SEND_1SGE = hx(
    "00 00 05 0a | 00 01 23 02 | 00 00 00 08 | 00 00 00 00"  # ctrl: idx 5, SEND; qpn 0x123, ds 2; CQ_UPDATE
    "00 00 00 40 | aa bb cc dd | 11 22 33 44 55 66 77 88"  # data: 0x40 bytes, lkey, addr
)


def test_send_with_one_sge() -> None:
    wr = PhysWr(wr_id=1, opcode=WrOpcode.SEND, sges=[(0x1122334455667788, 0x40, 0xAABBCCDD)], signaled=True)
    assert m.encode_send_wqe(wr, qpn=0x123, wqe_index=5) == SEND_1SGE
    assert m.send_wqe_ds(wr) == 2 and m.send_wqe_bbs(wr) == 1


def test_rdma_write_with_two_sges_unsignaled_and_index_wrapping_at_16_bits() -> None:
    wr = PhysWr(wr_id=2, opcode=WrOpcode.RDMA_WRITE, sges=[(0x1000, 0x10, 0x11), (0x2000, 0x20, 0x22)],
                signaled=False, remote_addr=0x7F0000001000, rkey=0x01020304)
    expected = hx(
        "00 ff ff 08 | ab cd ef 04 | 00 00 00 00 | 00 00 00 00"  # idx 0x1ffff -> 0xffff, WRITE; ds 4; no CQE
        "00 00 7f 00 00 00 10 00 | 01 02 03 04 | 00 00 00 00"  # raddr, rkey, reserved
        "00 00 00 10 | 00 00 00 11 | 00 00 00 00 00 00 10 00"
        "00 00 00 20 | 00 00 00 22 | 00 00 00 00 00 00 20 00"
    )
    assert m.encode_send_wqe(wr, qpn=0xABCDEF, wqe_index=0x1FFFF) == expected
    assert m.send_wqe_bbs(wr) == 1


def test_rdma_read() -> None:
    wr = PhysWr(wr_id=3, opcode=WrOpcode.RDMA_READ, sges=[(0x3000, 0x100, 0x66)], remote_addr=0xDEADBEEF00,
                rkey=0x55)
    expected = hx(
        "00 00 07 10 | 00 00 10 03 | 00 00 00 08 | 00 00 00 00"
        "00 00 00 de ad be ef 00 | 00 00 00 55 | 00 00 00 00"
        "00 00 01 00 | 00 00 00 66 | 00 00 00 00 00 00 30 00"
    )
    assert m.encode_send_wqe(wr, qpn=0x10, wqe_index=7) == expected


def test_atomic_compare_and_swap() -> None:
    wr = PhysWr(wr_id=4, opcode=WrOpcode.ATOMIC_CMP_AND_SWP, sges=[(0x4000, 8, 0x88)], remote_addr=0x8000,
                rkey=0x77, compare_add=0x1111, swap=0x2222)
    expected = hx(
        "00 00 10 11 | 00 00 20 04 | 00 00 00 08 | 00 00 00 00"
        "00 00 00 00 00 00 80 00 | 00 00 00 77 | 00 00 00 00"
        "00 00 00 00 00 00 22 22 | 00 00 00 00 00 00 11 11"  # swap_add = swap, compare
        "00 00 00 08 | 00 00 00 88 | 00 00 00 00 00 00 40 00"
    )
    assert m.encode_send_wqe(wr, qpn=0x20, wqe_index=0x10) == expected


def test_fetch_and_add_puts_the_addend_in_swap_add_and_forces_an_8_byte_result() -> None:
    wr = PhysWr(wr_id=5, opcode=WrOpcode.ATOMIC_FETCH_AND_ADD, sges=[(0x4000, 64, 0x88)], remote_addr=0x8000,
                rkey=0x77, compare_add=0x5)
    wqe = m.encode_send_wqe(wr, qpn=0x20, wqe_index=0)
    assert wqe[3] == 0x12
    assert wqe[32:48] == hx("00 00 00 00 00 00 00 05 | 00 00 00 00 00 00 00 00")
    assert wqe[48:52] == hx("00 00 00 08")


def test_immediate_is_the_verbs_field_passed_through() -> None:
    wr = PhysWr(wr_id=6, opcode=WrOpcode.SEND_WITH_IMM, sges=[], imm=0x12345678)
    wqe = m.encode_send_wqe(wr, qpn=1, wqe_index=0)
    assert wqe == hx("00 00 00 0b | 00 00 01 01 | 00 00 00 08 | 78 56 34 12")  # zero-length send: ds 1


def test_empty_sges_are_skipped_and_oversized_wqes_refused() -> None:
    wr = PhysWr(wr_id=7, opcode=WrOpcode.SEND, sges=[(0x1000, 0, 1), (0x2000, 4, 2)])
    assert m.send_wqe_ds(wr) == 2 and len(m.encode_send_wqe(wr, 1, 0)) == 32
    with pytest.raises(InvalidArgument):
        m.encode_send_wqe(PhysWr(8, WrOpcode.SEND, sges=[(0, 1, 1)] * 63), 1, 0)  # ds 64 > 63
    with pytest.raises(NotSupported):
        m.encode_send_wqe(PhysWr(9, 9), 1, 0)  # IBV_WR_SEND_WITH_INV
    with pytest.raises(InvalidArgument):
        m.encode_send_wqe(PhysWr(10, WrOpcode.SEND), 1 << 24, 0)
    with pytest.raises(InvalidArgument):
        m.encode_send_wqe(PhysWr(11, WrOpcode.RDMA_WRITE, rkey=1 << 32), 1, 0)
    with pytest.raises(InvalidArgument):
        m.encode_send_wqe(PhysWr(12, WrOpcode.ATOMIC_FETCH_AND_ADD, sges=[(0x1000, 0, 1)]), 1, 0)


def test_format_places_wqes_by_producer_counter_and_wraps_at_the_sq_end() -> None:
    buf = memoryview(bytearray(b"\xee" * 512))
    fmt = m.Mlx5Format(0x123, sq_offset=128, sq_wqe_cnt=4)
    fmt.send_wqe(buf, fmt.sq_slot(5), PhysWr(1, WrOpcode.SEND, sges=[(0x1122334455667788, 0x40, 0xAABBCCDD)]), 5)
    assert fmt.sq_slot(5) == 192 and bytes(buf[192:224]) == SEND_1SGE and bytes(buf[224:256]) == b"\xee" * 32
    # 4 SGEs: ds 5, 80 bytes, two basic blocks; from the last block the second one is the SQ's first.
    wr = PhysWr(2, WrOpcode.SEND, sges=[(0x10 * i, 1, i) for i in range(1, 5)])
    assert m.send_wqe_bbs(wr) == 2
    fmt.send_wqe(buf, fmt.sq_slot(7), wr, 7)
    wqe = m.encode_send_wqe(wr, 0x123, 7)
    assert bytes(buf[320:384]) == wqe[:64] and bytes(buf[128:144]) == wqe[64:]
    with pytest.raises(InvalidArgument):
        fmt.send_wqe(buf, fmt.sq_slot(8), wr, 9)
    fmt.parse_cqe(memoryview(cqe(op=0, qpn_word=0x0A000123, wqe_counter=7)), 0)
    assert fmt.sq_tail == 9  # a two-block WQE frees two blocks


# ----- receive WQEs ------------------------------------------------------------------------------------------
def test_recv_with_end_marker() -> None:
    expected = hx(
        "00 00 02 00 | 00 00 00 99 | 00 00 00 00 00 00 50 00"
        "00 00 00 00 | 00 00 01 00 | 00 00 00 00 00 00 00 00"  # byte_count 0, MLX5_INVALID_LKEY, addr 0
    )
    assert m.encode_recv_wqe([(0x5000, 0x200, 0x99)], max_sge=4) == expected
    assert m.encode_recv_wqe([(0x5000, 0x200, 0x99)], max_sge=1) == expected[:16]  # a full slot has no marker
    with pytest.raises(InvalidArgument):
        m.encode_recv_wqe([(0x5000, 1, 1)] * 2, max_sge=1)


def test_format_writes_recv_wqes_into_rq_slots_only() -> None:
    buf = memoryview(bytearray(b"\xee" * 1024))
    fmt = m.Mlx5Format(7, sq_offset=512, sq_wqe_cnt=4, rq_offset=0, rq_wqe_cnt=8, rq_stride=64)
    fmt.recv_wqe(buf, fmt.rq_slot(9), 0xAB, [(0x5000, 0x200, 0x99)])
    assert fmt.rq_slot(9) == 64
    assert bytes(buf[64:96]) == m.encode_recv_wqe([(0x5000, 0x200, 0x99)], 4)
    assert bytes(buf[96:128]) == b"\xee" * 32
    for bad in (32, 512, -64):
        with pytest.raises(InvalidArgument):
            fmt.recv_wqe(buf, bad, 1, [])


# ----- doorbells ---------------------------------------------------------------------------------------------
def test_doorbell_records() -> None:
    assert m.sq_doorbell_record(0x12345) == hx("00 00 23 45")
    assert m.rq_doorbell_record(0x10001) == hx("00 00 00 01")
    assert m.cq_doorbell_record(0x1234567) == hx("00 23 45 67")
    assert (m.RQ_DBREC_OFFSET, m.SQ_DBREC_OFFSET, m.CQ_SET_CI_OFFSET) == (0, 4, 0)


def test_uar_doorbell_is_the_first_8_bytes_of_the_control_segment() -> None:
    db = m.uar_doorbell(SEND_1SGE)
    assert db == hx("00 00 05 0a 00 01 23 02")
    assert struct.pack("<Q", m.uar_doorbell_word(db)) == db  # one native 64-bit store puts these bytes out
    assert m.bf_register_offset(0x7F1234567900, 4096) == 0x900
    assert m.next_bf_offset(0, 256) == 256 and m.next_bf_offset(256, 256) == 0 and m.next_bf_offset(0, 0) == 0


# ----- CQEs --------------------------------------------------------------------------------------------------
def cqe(*, op: int, owner: int = 0, qpn_word: int = 0, wqe_counter: int = 0, byte_cnt: int = 0,
        imm: bytes = bytes(4), flags_rqpn: int = 0, syndrome: int = 0, vendor: int = 0) -> bytearray:
    """A 64-byte CQE, field by field at the offsets of mlx5_cqe64 / mlx5_err_cqe."""
    c = bytearray(64)
    c[24:28] = flags_rqpn.to_bytes(4, "big")
    c[36:40] = imm
    c[44:48] = byte_cnt.to_bytes(4, "big")
    c[54], c[55] = vendor, syndrome
    c[56:60] = qpn_word.to_bytes(4, "big")
    c[60:62] = wqe_counter.to_bytes(2, "big")
    c[63] = op << 4 | owner
    return c


def qp_format() -> tuple[memoryview, m.Mlx5Format]:
    buf = memoryview(bytearray(4096))
    fmt = m.Mlx5Format(0x123, sq_offset=0, sq_wqe_cnt=16, rq_offset=1024, rq_wqe_cnt=8, rq_stride=32)
    return buf, fmt


def test_success_cqes() -> None:
    buf, fmt = qp_format()
    fmt.send_wqe(buf, fmt.sq_slot(5), PhysWr(0xCAFE, WrOpcode.SEND, sges=[(0x1000, 0x40, 1)]), 5)
    fmt.send_wqe(buf, fmt.sq_slot(6), PhysWr(0xBEEF, WrOpcode.RDMA_READ, sges=[(0x1000, 0x40, 1)]), 6)
    fmt.recv_wqe(buf, fmt.rq_slot(3), 0xF00D, [(0x2000, 0x400, 2)])

    sent = cqe(op=0, qpn_word=0x0A000123, wqe_counter=5, byte_cnt=0x40)
    wc = fmt.parse_cqe(memoryview(sent), 0)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num, wc.wc_flags) == (0xCAFE, 0, WcOpcode.SEND, 0,
                                                                                      0x123, 0)
    assert fmt.sq_tail == 6  # the device is done with the SQ up to the block after this WQE
    read = fmt.parse_cqe(memoryview(cqe(op=0, qpn_word=0x10000123, wqe_counter=0x16, byte_cnt=0x40)), 0)
    assert (read.wr_id, read.opcode, read.byte_len) == (0xBEEF, WcOpcode.RDMA_READ, 0x40)
    assert fmt.sq_tail == 7 and fmt.rq_tail == 0

    recv = cqe(op=3, owner=1, qpn_word=0x00000123, wqe_counter=3, byte_cnt=0x200, imm=hx("78 56 34 12"),
               flags_rqpn=0x20000456)
    wc = fmt.parse_cqe(memoryview(recv), 0)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data, wc.src_qp) == (
        0xF00D, 0, WcOpcode.RECV, 0x200, 0x12345678, 0x456)
    assert wc.wc_flags == m.WC_WITH_IMM | m.WC_GRH
    assert fmt.rq_tail == 1


def test_error_cqes() -> None:
    buf, fmt = qp_format()
    fmt.send_wqe(buf, fmt.sq_slot(2), PhysWr(0x77, WrOpcode.RDMA_WRITE, sges=[(0x1000, 8, 1)]), 2)
    fmt.recv_wqe(buf, fmt.rq_slot(1), 0x99, [(0x2000, 8, 2)])

    bad = cqe(op=13, qpn_word=0x08000123, wqe_counter=2, syndrome=0x13, vendor=0x88)
    wc = fmt.parse_cqe(memoryview(bad), 0)
    assert (wc.wr_id, wc.status, wc.opcode, wc.vendor_err, wc.qp_num) == (
        0x77, m.IbvWcStatus.REM_ACCESS_ERR, WcOpcode.RDMA_WRITE, 0x88, 0x123)

    flushed = fmt.parse_cqe(memoryview(cqe(op=14, qpn_word=0x123, wqe_counter=1, syndrome=0x05)), 0)
    assert (flushed.wr_id, flushed.status, flushed.opcode) == (0x99, m.IbvWcStatus.WR_FLUSH_ERR, WcOpcode.RECV)

    unknown = fmt.parse_cqe(memoryview(cqe(op=13, qpn_word=0x08000123, wqe_counter=2, syndrome=0x7F)), 0)
    assert unknown.status == m.IbvWcStatus.GENERAL_ERR == 21


def test_syndrome_table_matches_ibv_numbering() -> None:
    assert {int(k): int(v) for k, v in m.SYNDROME_STATUS.items()} == {
        0x01: 1, 0x02: 2, 0x04: 4, 0x05: 5, 0x06: 6, 0x10: 7, 0x11: 8, 0x12: 9, 0x13: 10, 0x14: 11, 0x15: 12,
        0x16: 13, 0x22: 16}


def test_cqes_the_format_refuses() -> None:
    _buf, fmt = qp_format()
    with pytest.raises(InvalidArgument):
        fmt.parse_cqe(memoryview(cqe(op=0, qpn_word=0x0A000124)), 0)  # another QP's
    with pytest.raises(InvalidArgument):
        fmt.parse_cqe(memoryview(cqe(op=15, qpn_word=0x123)), 0)  # not written yet
    scattered = cqe(op=2, qpn_word=0x123)
    scattered[63] |= 0x04  # MLX5_INLINE_SCATTER_32
    with pytest.raises(NotSupported):
        fmt.parse_cqe(memoryview(scattered), 0)
    with pytest.raises(NotSupported):
        fmt.parse_cqe(memoryview(cqe(op=5, qpn_word=0x123)), 0)  # RESIZE_CQ
    assert m.cqe_qpn(memoryview(cqe(op=0, qpn_word=0x0AABCDEF)), 0) == 0xABCDEF


def test_128_byte_cqes_keep_the_cqe64_in_their_second_half() -> None:
    buf, _ = qp_format()
    fmt = m.Mlx5Format(0x123, sq_offset=0, sq_wqe_cnt=16, cqe_size=128)
    fmt.send_wqe(buf, 0, PhysWr(0x42, WrOpcode.SEND), 0)
    slot = memoryview(bytearray(64) + cqe(op=0, owner=1, qpn_word=0x0A000123))
    assert fmt.parse_cqe(slot, 0).wr_id == 0x42
    assert m.cqe_owned_by_software(slot, 0, cons_index=2, cqe_cnt=2, cqe_size=128)


def test_owner_bit_across_a_wrap() -> None:
    cnt = 4
    ring = memoryview(bytearray(cnt * 64))
    m.init_cq_buffer(ring, 0, cnt)

    def owned(ci: int) -> bool:
        return m.cqe_owned_by_software(ring, m.cqe_offset(0, ci, cnt), ci, cnt)

    assert not any(owned(ci) for ci in range(2 * cnt))  # all INVALID, whatever the parity
    for slot in range(cnt):  # first pass: the device writes owner 0
        ring[slot * 64:(slot + 1) * 64] = cqe(op=0, owner=0, qpn_word=0x0A000123)
    assert all(owned(ci) for ci in range(cnt))
    assert not owned(cnt)  # consumer index 4 is slot 0 on the second pass: the stale CQE is not new
    ring[0:64] = cqe(op=0, owner=1, qpn_word=0x0A000123)  # second pass: owner 1
    assert owned(cnt) and not owned(0) and not owned(2 * cnt)
    assert m.cqe_offset(0x100, 6, cnt) == 0x100 + 2 * 64
