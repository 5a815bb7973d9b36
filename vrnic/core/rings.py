"""Single-producer single-consumer rings in memory shared by a guest and vrnicd.

Layout at a ring's offset in the guest arena: a 192-byte header (producer index
at 0, consumer index at 64, flags at 128, each on its own cache line) followed
by fixed-size slots. Indices run freely modulo the largest multiple of the ring's
entries that fits in 32 bits (2^32 itself for a power-of-two ring), so that slot
index % entries carries on across the wrap. Each side writes only its
own index, after the slot it produced or consumed, so x86's store ordering is
enough. Everything here works on a plain buffer: no syscalls.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

from vrnic.errors import InvalidArgument

HEADER_BYTES = 192
_PRODUCER, _CONSUMER, _FLAGS = 0, 64, 128
MAX_SGE = 4


class RingFlags(IntFlag):
    OVERFLOW = 1  # the consumer fell behind and completions were lost
    CORRUPT = 2  # the indices made no sense; the queue is dead
    FAILED = 4  # vrnicd's data path for this session failed; the session is being closed


class RingCorrupt(InvalidArgument):
    code = "ring_corrupt"


def index_words(buf: memoryview | bytearray) -> memoryview:
    """A 32-bit view of an arena for ring indices; its owner releases it before unmapping.

    Indices must be written with one aligned 32-bit store. struct.pack_into will
    not do: it zeroes the destination before writing, so the other process can
    read a transient 0. A memoryview element store is a single 4-byte memcpy.
    """
    return memoryview(buf).cast("B").cast("I")


class Ring:
    # Slots: a batch of 32 QPs makes 64 rings on each side of the channel, and under TCG every step counts (issue 14)
    __slots__ = ("buf", "offset", "entries", "slot", "words", "modulus", "_producer_word", "_consumer_word")

    def __init__(self, buf: memoryview, offset: int, entries: int, slot: struct.Struct,
                 words: memoryview | None = None) -> None:
        if entries < 1:
            raise InvalidArgument("a ring needs at least one entry")
        if entries > 1 << 31:
            raise InvalidArgument(f"a ring has at most 2^31 entries, not {entries}")
        end = offset + self.bytes_needed(entries, slot.size)
        if offset < 0 or offset % 64 or end > len(buf):
            raise InvalidArgument(f"ring [{offset}, {end}) is not 64-byte aligned inside the {len(buf)}-byte arena")
        self.buf, self.offset, self.entries, self.slot = buf, offset, entries, slot
        self.words = index_words(buf) if words is None else words
        # Wrapping at 2^32 would jump index % entries backwards unless entries divides 2^32,
        # putting two live entries in one slot; wrap at a multiple of entries instead.
        self.modulus = ((1 << 32) // entries) * entries
        self._producer_word, self._consumer_word = (offset + _PRODUCER) >> 2, (offset + _CONSUMER) >> 2

    @staticmethod
    def bytes_needed(entries: int, slot_size: int) -> int:
        return HEADER_BYTES + entries * slot_size

    def _index(self, at: int) -> int:
        return int(self.words[(self.offset + at) >> 2])

    def _set_index(self, at: int, value: int) -> None:
        self.words[(self.offset + at) >> 2] = value % self.modulus

    def count(self) -> int:
        producer, consumer = self._index(_PRODUCER), self._index(_CONSUMER)
        if producer >= self.modulus or consumer >= self.modulus:
            raise RingCorrupt(f"ring index {max(producer, consumer)} is outside the ring's 0..{self.modulus - 1}")
        used = (producer - consumer) % self.modulus
        if used > self.entries:
            raise RingCorrupt(f"ring indices claim {used} entries in a ring of {self.entries}")
        return used

    def produce(self, values: Sequence[Any]) -> bool:
        """Write one slot; False if the ring is full."""
        producer = self._index(_PRODUCER)
        if self.count() >= self.entries:
            return False
        self.slot.pack_into(self.buf, self._slot_at(producer), *values)
        self._set_index(_PRODUCER, producer + 1)
        return True

    def consume(self, limit: int) -> list[tuple[Any, ...]]:
        """Take up to limit slots, oldest first."""
        if limit < 0:  # would move the consumer index backwards
            raise InvalidArgument(f"cannot take a negative number ({limit}) of entries")
        words = self.words
        if words[self._producer_word] == words[self._consumer_word]:
            return []  # the common case, in two reads: the engine looks at every ring at every step (issue 14)
        available = min(self.count(), limit)
        consumer = self._index(_CONSUMER)
        taken = [self.slot.unpack_from(self.buf, self._slot_at(consumer + i)) for i in range(available)]
        if available:
            self._set_index(_CONSUMER, consumer + available)
        return taken

    def _slot_at(self, index: int) -> int:
        return self.offset + HEADER_BYTES + (index % self.entries) * self.slot.size

    @property
    def flags(self) -> RingFlags:
        return RingFlags(self._index(_FLAGS) & 0x7)

    def set_flag(self, flag: RingFlags) -> None:
        self._set_index(_FLAGS, self._index(_FLAGS) | flag)

    def reset(self) -> None:
        self.buf[self.offset:self.offset + HEADER_BYTES] = bytes(HEADER_BYTES)


# ----- work requests and completions ---------------------------------------------------------
# Opcode, status and access numbers are the stable ibverbs UAPI values, so the
# edge passes them to the NIC unchanged; the core does not import pyverbs.

class WrOpcode(IntEnum):
    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4
    ATOMIC_CMP_AND_SWP = 5
    ATOMIC_FETCH_AND_ADD = 6


class WcStatus(IntEnum):
    SUCCESS = 0
    LOC_QP_OP_ERR = 2
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    REM_ACCESS_ERR = 10
    GENERAL_ERR = 21


class WcOpcode(IntEnum):
    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


WC_OF_WR = {WrOpcode.RDMA_WRITE: WcOpcode.RDMA_WRITE, WrOpcode.RDMA_WRITE_WITH_IMM: WcOpcode.RDMA_WRITE,
            WrOpcode.SEND: WcOpcode.SEND, WrOpcode.SEND_WITH_IMM: WcOpcode.SEND,
            WrOpcode.RDMA_READ: WcOpcode.RDMA_READ, WrOpcode.ATOMIC_CMP_AND_SWP: WcOpcode.COMP_SWAP,
            WrOpcode.ATOMIC_FETCH_AND_ADD: WcOpcode.FETCH_ADD}


class Access(IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


SEND_SIGNALED = 2  # IBV_SEND_SIGNALED


@dataclass(frozen=True)
class Sge:
    addr: int  # an offset in the guest arena
    length: int
    lkey: int  # the MR's virtual key


@dataclass(frozen=True)
class SendRequest:
    wr_id: int
    opcode: WrOpcode
    sges: tuple[Sge, ...] = ()
    signaled: bool = True
    imm: int = 0
    remote_addr: int = 0
    rkey: int = 0
    compare_add: int = 0
    swap: int = 0
    # UD destinations are named by virtual identity; vrnicd resolves them.
    ud_gid: bytes = bytes(16)
    ud_qpn: int = 0
    ud_qkey: int = 0


@dataclass(frozen=True)
class RecvRequest:
    wr_id: int
    sges: tuple[Sge, ...] = ()


@dataclass(frozen=True)
class Completion:
    wr_id: int
    status: int
    opcode: int
    byte_len: int = 0
    imm: int = 0
    qp: int = 0  # the guest's virtual QPN
    src_qp: int = 0
    wc_flags: int = 0
    vendor_err: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


_SGES = "QII" * MAX_SGE
SQ_SLOT = struct.Struct("<QBBBxIQIIQQII16s" + _SGES)
RQ_SLOT = struct.Struct("<QBxxxI" + _SGES)
CQ_SLOT = struct.Struct("<QIIIIIIII")


def _flat_sges(sges: Sequence[Sge]) -> list[int]:
    if len(sges) > MAX_SGE:
        raise InvalidArgument(f"at most {MAX_SGE} SGEs per work request, not {len(sges)}")
    flat: list[int] = []
    for sge in sges:
        flat += [sge.addr, sge.length, sge.lkey]
    return flat + [0, 0, 0] * (MAX_SGE - len(sges))


def _sges(count: int, flat: Sequence[int]) -> tuple[Sge, ...]:
    if count > MAX_SGE:
        raise InvalidArgument(f"work request claims {count} SGEs (max {MAX_SGE})")
    return tuple(Sge(*flat[i * 3:i * 3 + 3]) for i in range(count))


def pack_send(wr: SendRequest) -> tuple[Any, ...]:
    return (wr.wr_id, int(wr.opcode), SEND_SIGNALED if wr.signaled else 0, len(wr.sges), wr.imm, wr.remote_addr,
            wr.rkey, wr.ud_qpn, wr.compare_add, wr.swap, wr.ud_qkey, 0, wr.ud_gid, *_flat_sges(wr.sges))


def unpack_send(slot: Sequence[Any]) -> SendRequest:
    wr_id, opcode, flags, count, imm, raddr, rkey, ud_qpn, cmp_add, swap, qkey, _r, gid = slot[:13]
    try:
        op = WrOpcode(opcode)
    except ValueError:
        raise InvalidArgument(f"unknown send opcode {opcode}") from None
    return SendRequest(wr_id, op, _sges(count, slot[13:]), bool(flags & SEND_SIGNALED), imm, raddr, rkey,
                       cmp_add, swap, gid, ud_qpn, qkey)


def pack_recv(wr: RecvRequest) -> tuple[Any, ...]:
    return (wr.wr_id, len(wr.sges), 0, *_flat_sges(wr.sges))


def unpack_recv(slot: Sequence[Any]) -> RecvRequest:
    return RecvRequest(slot[0], _sges(slot[1], slot[3:]))


def pack_completion(wc: Completion) -> tuple[Any, ...]:
    return (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm, wc.qp, wc.src_qp, wc.wc_flags, wc.vendor_err)


def unpack_completion(slot: Sequence[Any]) -> Completion:
    return Completion(*slot)
