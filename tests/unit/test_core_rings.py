"""Shared-memory SPSC rings and the slot formats of work requests and completions (vrnic.core.rings)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vrnic.core.rings import (
    CQ_SLOT,
    HEADER_BYTES,
    MAX_SGE,
    RQ_SLOT,
    SEND_SIGNALED,
    SQ_SLOT,
    WC_OF_WR,
    Completion,
    RecvRequest,
    Ring,
    RingCorrupt,
    RingFlags,
    SendRequest,
    Sge,
    WcOpcode,
    WcStatus,
    WrOpcode,
    index_words,
    pack_completion,
    pack_recv,
    pack_send,
    unpack_completion,
    unpack_recv,
    unpack_send,
)
from vrnic.errors import InvalidArgument

U32 = 1 << 32
ONE = struct.Struct("<I")


def make_ring(entries: int, offset: int = 0, slack: int = 0) -> tuple[memoryview, Ring]:
    buf = memoryview(bytearray(offset + Ring.bytes_needed(entries, ONE.size) + slack))
    return buf, Ring(buf, offset, entries, ONE)


def set_indices(buf: memoryview, offset: int, producer: int, consumer: int) -> None:
    struct.pack_into("<I", buf, offset, producer)
    struct.pack_into("<I", buf, offset + 64, consumer)


def indices(buf: memoryview, offset: int = 0) -> tuple[int, int]:
    return struct.unpack_from("<I", buf, offset)[0], struct.unpack_from("<I", buf, offset + 64)[0]


def values(slots: list[tuple[int, ...]]) -> list[int]:
    return [v for (v,) in slots]


# ----- construction -----------------------------------------------------------------------------

def test_bytes_needed() -> None:
    assert HEADER_BYTES == 192
    assert Ring.bytes_needed(8, 40) == 192 + 320


def test_ring_exactly_fills_its_buffer() -> None:
    buf = memoryview(bytearray(64 + Ring.bytes_needed(4, 4)))
    ring = Ring(buf, 64, 4, ONE)
    assert ring.count() == 0


@pytest.mark.parametrize(("offset", "size"), [(1, 4096), (32, 4096), (-64, 4096), (0, 192 + 4 * 4 - 1),
                                              (64, 64 + 192 + 4 * 4 - 1)])
def test_misaligned_or_out_of_bounds_ring_is_refused(offset: int, size: int) -> None:
    with pytest.raises(InvalidArgument, match="64-byte aligned"):
        Ring(memoryview(bytearray(size)), offset, 4, ONE)


@pytest.mark.parametrize("entries", [0, -1])
def test_a_ring_needs_an_entry(entries: int) -> None:
    with pytest.raises(InvalidArgument, match="at least one entry"):
        Ring(memoryview(bytearray(4096)), 0, entries, ONE)


# ----- produce / consume ------------------------------------------------------------------------

def test_produce_consume_in_order_and_indices_in_shared_memory() -> None:
    buf, ring = make_ring(4)
    assert ring.produce((10,)) and ring.produce((11,))
    assert ring.count() == 2
    assert indices(buf) == (2, 0)
    assert values(ring.consume(1)) == [10]
    assert indices(buf) == (2, 1)
    assert values(ring.consume(10)) == [11]
    assert ring.count() == 0
    assert ring.consume(5) == []
    assert indices(buf) == (2, 2)


def test_full_ring_refuses_and_keeps_contents() -> None:
    _, ring = make_ring(3)
    assert all(ring.produce((v,)) for v in (1, 2, 3))
    assert ring.count() == 3
    assert ring.produce((4,)) is False
    assert values(ring.consume(3)) == [1, 2, 3]
    assert ring.produce((4,)) is True


def test_consume_zero_takes_nothing() -> None:
    buf, ring = make_ring(4)
    ring.produce((1,))
    assert ring.consume(0) == []
    assert indices(buf) == (1, 0)


def test_consume_negative_limit_is_refused_and_moves_nothing() -> None:
    buf, ring = make_ring(4)
    ring.produce((1,))
    with pytest.raises(InvalidArgument):
        ring.consume(-1)
    assert indices(buf) == (1, 0)
    assert values(ring.consume(1)) == [1]


def test_slot_positions_wrap_modulo_entries() -> None:
    buf, ring = make_ring(3)
    for v in range(7):
        assert ring.produce((v,))
        assert values(ring.consume(1)) == [v]
    # index 6 lands in slot 0
    assert ONE.unpack_from(buf, HEADER_BYTES)[0] == 6


def test_a_ring_at_an_offset_leaves_neighbours_alone() -> None:
    buf, ring = make_ring(2, offset=128, slack=64)
    buf[:128] = b"\xaa" * 128
    buf[-64:] = b"\xbb" * 64
    ring.produce((0xFFFF_FFFF,))
    ring.produce((0x1234,))
    assert values(ring.consume(2)) == [0xFFFF_FFFF, 0x1234]
    ring.set_flag(RingFlags.OVERFLOW)
    ring.reset()
    assert bytes(buf[:128]) == b"\xaa" * 128
    assert bytes(buf[-64:]) == b"\xbb" * 64


@pytest.mark.parametrize("entries", [1, 2, 3, 4, 5, 7, 8, 100, 1000, 4096])
def test_fifo_across_the_32_bit_index_wrap(entries: int) -> None:
    """Start both indices just below the largest index the ring uses and run past the wrap."""
    buf, ring = make_ring(entries)
    modulus = (U32 // entries) * entries  # 2^32 for power-of-two rings
    start = modulus - entries - 1
    set_indices(buf, 0, start, start)
    assert ring.count() == 0
    expected: list[int] = []
    got: list[int] = []
    next_value = 0
    for _ in range(4):
        while ring.produce((next_value,)):
            expected.append(next_value)
            next_value += 1
        assert ring.count() == entries
        got += values(ring.consume(entries))
    assert got == expected
    assert len(got) == 4 * entries
    producer, consumer = indices(buf)
    assert producer == consumer == (start + 4 * entries) % modulus
    assert producer < start  # it really wrapped


def test_power_of_two_ring_wraps_at_2_to_the_32() -> None:
    buf, ring = make_ring(4)
    set_indices(buf, 0, U32 - 2, U32 - 2)
    for v in range(4):
        assert ring.produce((v,))
    assert indices(buf) == (2, U32 - 2)
    assert ring.count() == 4
    assert values(ring.consume(4)) == [0, 1, 2, 3]


@settings(deadline=None)
@given(entries=st.integers(1, 9), start=st.integers(0, U32 - 1) | st.integers(U32 - 40, U32 - 1),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10)), max_size=40))
def test_ring_behaves_like_a_bounded_fifo(entries: int, start: int, ops: list[tuple[bool, int]]) -> None:
    buf, ring = make_ring(entries)
    modulus = (U32 // entries) * entries
    start %= modulus
    set_indices(buf, 0, start, start)
    model: list[int] = []
    counter = 0
    for is_produce, n in ops:
        if is_produce:
            for _ in range(n):
                accepted = ring.produce((counter,))
                assert accepted == (len(model) < entries)
                if accepted:
                    model.append(counter)
                counter += 1
        else:
            got = values(ring.consume(n))
            assert got == model[:n]
            del model[:n]
        assert ring.count() == len(model)


# ----- index stores ----------------------------------------------------------------------------

class RecordingWords:
    """Stands in for the 32-bit index view and records every store, to check there is one per update."""

    def __init__(self, words: memoryview) -> None:
        self.words = words
        self.stores: list[tuple[int, int]] = []

    def __getitem__(self, i: int) -> int:
        return int(self.words[i])

    def __setitem__(self, i: int, value: int) -> None:
        self.stores.append((i, value))
        self.words[i] = value


def test_index_words_is_a_32_bit_view_of_the_same_memory() -> None:
    buf = bytearray(256)
    words = index_words(buf)
    assert (words.itemsize, len(words)) == (4, 64)
    words[16] = 0xDEADBEEF
    assert struct.unpack_from("<I", buf, 64)[0] == 0xDEADBEEF


def test_each_index_update_is_one_store_of_the_final_value() -> None:
    """A peer process must never observe an intermediate value (such as a transient 0)."""
    buf = memoryview(bytearray(Ring.bytes_needed(4, ONE.size) + 64))
    recorder = RecordingWords(index_words(buf))
    ring = Ring(buf, 64, 4, ONE, recorder)  # type: ignore[arg-type]
    set_indices(buf, 64, 255, 255)  # the next store carries into the second byte
    assert ring.produce((1,))
    assert recorder.stores == [((64 + 0) // 4, 256)]
    assert values(ring.consume(1)) == [1]
    assert recorder.stores[-1] == ((64 + 64) // 4, 256)
    ring.set_flag(RingFlags.OVERFLOW)
    assert recorder.stores[-1] == ((64 + 128) // 4, 1)
    assert len(recorder.stores) == 3


def test_rings_sharing_one_index_view_stay_independent() -> None:
    buf = memoryview(bytearray(4096))
    words = index_words(buf)
    first = Ring(buf, 0, 4, ONE, words)
    second = Ring(buf, 1024, 4, ONE, words)
    first.produce((1,))
    second.produce((2,))
    second.produce((3,))
    assert (first.count(), second.count()) == (1, 2)
    assert values(first.consume(4)) == [1]
    assert values(second.consume(4)) == [2, 3]


# ----- corruption and flags ---------------------------------------------------------------------

@pytest.mark.parametrize(("producer", "consumer"), [(5, 0), (0, 1), (100, 50), (0, U32 - 5)])
def test_indices_claiming_more_than_entries_are_corrupt(producer: int, consumer: int) -> None:
    buf, ring = make_ring(4)
    set_indices(buf, 0, producer, consumer)
    with pytest.raises(RingCorrupt, match="claim"):
        ring.count()
    with pytest.raises(RingCorrupt):
        ring.consume(1)
    with pytest.raises(RingCorrupt):
        ring.produce((1,))
    assert indices(buf) == (producer, consumer)  # nothing moved


def test_an_index_beyond_the_rings_index_space_is_corrupt() -> None:
    buf, ring = make_ring(3)  # indices run modulo 3 * floor(2^32 / 3) = 2^32 - 1
    set_indices(buf, 0, U32 - 1, U32 - 1)
    with pytest.raises(RingCorrupt, match="outside"):
        ring.count()
    set_indices(buf, 0, U32 - 2, U32 - 2)  # the last index in use
    assert ring.count() == 0


def test_a_ring_has_at_most_2_to_the_31_entries() -> None:
    with pytest.raises(InvalidArgument, match="at most 2"):
        Ring(memoryview(bytearray(64)), 0, (1 << 31) + 1, ONE)


def test_ring_corrupt_is_an_invalid_argument_with_its_code() -> None:
    assert isinstance(RingCorrupt("x"), InvalidArgument)
    assert RingCorrupt("x").to_dict()["code"] == "ring_corrupt"


def test_flags_set_read_and_reset() -> None:
    buf, ring = make_ring(2)
    assert ring.flags == RingFlags(0)
    ring.set_flag(RingFlags.OVERFLOW)
    assert ring.flags == RingFlags.OVERFLOW
    ring.set_flag(RingFlags.CORRUPT)
    assert ring.flags == RingFlags.OVERFLOW | RingFlags.CORRUPT
    assert struct.unpack_from("<I", buf, 128)[0] == 3
    ring.produce((1,))
    ring.reset()
    assert ring.flags == RingFlags(0)
    assert indices(buf) == (0, 0)
    assert ring.count() == 0


def test_unknown_flag_bits_written_by_a_guest_are_ignored() -> None:
    buf, ring = make_ring(2)
    struct.pack_into("<I", buf, 128, 0xFFFF_FFF8)
    assert ring.flags == RingFlags(0)
    ring.set_flag(RingFlags.CORRUPT)
    assert ring.flags == RingFlags.CORRUPT


# ----- work request and completion slots --------------------------------------------------------

u64 = st.integers(0, (1 << 64) - 1)
u32 = st.integers(0, U32 - 1)
sges = st.builds(Sge, addr=u64, length=u32, lkey=u32)


@settings(deadline=None)
@given(wr_id=u64, opcode=st.sampled_from(WrOpcode), sge_list=st.lists(sges, max_size=MAX_SGE),
       signaled=st.booleans(), imm=u32, remote_addr=u64, rkey=u32, compare_add=u64, swap=u64,
       ud_gid=st.binary(min_size=16, max_size=16), ud_qpn=u32, ud_qkey=u32)
def test_send_request_round_trip(wr_id: int, opcode: WrOpcode, sge_list: list[Sge], signaled: bool, imm: int,
                                 remote_addr: int, rkey: int, compare_add: int, swap: int, ud_gid: bytes,
                                 ud_qpn: int, ud_qkey: int) -> None:
    wr = SendRequest(wr_id, opcode, tuple(sge_list), signaled, imm, remote_addr, rkey, compare_add, swap,
                     ud_gid, ud_qpn, ud_qkey)
    buf = bytearray(SQ_SLOT.size)
    SQ_SLOT.pack_into(buf, 0, *pack_send(wr))
    assert unpack_send(SQ_SLOT.unpack_from(buf)) == wr


@pytest.mark.parametrize("opcode", list(WrOpcode))
def test_every_send_opcode_round_trips_with_four_sges(opcode: WrOpcode) -> None:
    wr = SendRequest(wr_id=42, opcode=opcode, sges=tuple(Sge(i * 64, 64, 100 + i) for i in range(4)),
                     signaled=False, remote_addr=4096, rkey=7)
    slot = SQ_SLOT.unpack(SQ_SLOT.pack(*pack_send(wr)))
    back = unpack_send(slot)
    assert back == wr
    assert back.opcode is opcode
    assert back.sges[3] == Sge(192, 64, 103)


def test_wr_opcodes_are_the_ibverbs_values_and_each_has_a_completion_opcode() -> None:
    assert [int(o) for o in WrOpcode] == [0, 1, 2, 3, 4, 5, 6]
    assert set(WC_OF_WR) == set(WrOpcode)
    assert WC_OF_WR[WrOpcode.SEND_WITH_IMM] is WcOpcode.SEND
    assert WC_OF_WR[WrOpcode.ATOMIC_FETCH_AND_ADD] is WcOpcode.FETCH_ADD


def test_signaled_flag_is_ibv_send_signaled() -> None:
    on = pack_send(SendRequest(1, WrOpcode.SEND, signaled=True))
    off = pack_send(SendRequest(1, WrOpcode.SEND, signaled=False))
    assert on[2] == SEND_SIGNALED == 2
    assert off[2] == 0
    # other flag bits a guest sets do not make a WR signaled
    slot = list(SQ_SLOT.unpack(SQ_SLOT.pack(*off)))
    slot[2] = 0xFD
    assert unpack_send(slot).signaled is False


def test_more_than_four_sges_are_refused_when_packing() -> None:
    five = tuple(Sge(0, 1, 1) for _ in range(5))
    with pytest.raises(InvalidArgument, match="at most 4 SGEs"):
        pack_send(SendRequest(1, WrOpcode.SEND, sges=five))
    with pytest.raises(InvalidArgument, match="at most 4 SGEs"):
        pack_recv(RecvRequest(1, sges=five))


@pytest.mark.parametrize("count", [5, 255])
def test_a_slot_claiming_more_than_four_sges_is_refused(count: int) -> None:
    send = list(SQ_SLOT.unpack(SQ_SLOT.pack(*pack_send(SendRequest(1, WrOpcode.SEND)))))
    send[3] = count
    with pytest.raises(InvalidArgument, match="claims"):
        unpack_send(send)
    recv = list(RQ_SLOT.unpack(RQ_SLOT.pack(*pack_recv(RecvRequest(1)))))
    recv[1] = count
    with pytest.raises(InvalidArgument, match="claims"):
        unpack_recv(recv)


@pytest.mark.parametrize("opcode", [7, 8, 128, 255])
def test_unknown_send_opcode_is_refused(opcode: int) -> None:
    slot = list(SQ_SLOT.unpack(SQ_SLOT.pack(*pack_send(SendRequest(1, WrOpcode.SEND)))))
    slot[1] = opcode
    with pytest.raises(InvalidArgument, match=f"unknown send opcode {opcode}"):
        unpack_send(slot)


@settings(deadline=None)
@given(wr_id=u64, sge_list=st.lists(sges, max_size=MAX_SGE))
def test_recv_request_round_trip(wr_id: int, sge_list: list[Sge]) -> None:
    wr = RecvRequest(wr_id, tuple(sge_list))
    assert unpack_recv(RQ_SLOT.unpack(RQ_SLOT.pack(*pack_recv(wr)))) == wr


@settings(deadline=None)
@given(wr_id=u64, status=st.sampled_from(WcStatus), opcode=st.sampled_from(WcOpcode), byte_len=u32, imm=u32,
       qp=u32, src_qp=u32, wc_flags=u32, vendor_err=u32)
def test_completion_round_trip(wr_id: int, status: WcStatus, opcode: WcOpcode, byte_len: int, imm: int, qp: int,
                               src_qp: int, wc_flags: int, vendor_err: int) -> None:
    wc = Completion(wr_id, status, opcode, byte_len, imm, qp, src_qp, wc_flags, vendor_err)
    back = unpack_completion(CQ_SLOT.unpack(CQ_SLOT.pack(*pack_completion(wc))))
    assert back == wc
    assert back.status == status and back.opcode == opcode


def test_completion_extra_is_not_on_the_wire_and_not_compared() -> None:
    wc = Completion(1, WcStatus.SUCCESS, WcOpcode.RECV, extra={"note": "x"})
    back = unpack_completion(CQ_SLOT.unpack(CQ_SLOT.pack(*pack_completion(wc))))
    assert back == wc
    assert back.extra == {}


def test_work_requests_travel_through_a_ring() -> None:
    buf = memoryview(bytearray(Ring.bytes_needed(4, SQ_SLOT.size)))
    sq = Ring(buf, 0, 4, SQ_SLOT)
    wrs = [SendRequest(i, WrOpcode.RDMA_WRITE, (Sge(64 * i, 64, 9),), remote_addr=i * 8, rkey=3) for i in range(4)]
    for wr in wrs:
        assert sq.produce(pack_send(wr))
    assert not sq.produce(pack_send(wrs[0]))
    assert [unpack_send(s) for s in sq.consume(8)] == wrs


def test_slot_sizes_are_stable() -> None:
    # The layout is shared memory between two processes: a change here is a protocol change.
    assert (SQ_SLOT.size, RQ_SLOT.size, CQ_SLOT.size) == (136, 80, 40)
