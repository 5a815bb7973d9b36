"""ConnectX (mlx5): send and receive WQEs, CQEs, doorbell records and the UAR doorbell's bytes.

Pure encoders and decoders, no I/O. Layouts follow the public headers: rdma-core
providers/mlx5/mlx5dv.h (structs mlx5_wqe_ctrl_seg, mlx5_wqe_raddr_seg,
mlx5_wqe_atomic_seg, mlx5_wqe_data_seg, mlx5_cqe64, mlx5_err_cqe and the
MLX5_OPCODE_* / MLX5_CQE_* / MLX5_CQE_SYNDROME_* values), the kernel's
include/linux/mlx5/qp.h (the same control segment and its field masks), and
how libmlx5 fills and reads them (providers/mlx5/qp.c post_send / post_recv,
cq.c parse_cqe). The PRM ("ConnectX Programmer's Reference Manual") names the
same structures; nothing here was checked on a ConnectX.

Every multi-byte field is big-endian, except the immediate: verbs passes
imm_data through as an opaque __be32 (libmlx5 copies it into the control
segment and out of the CQE unchanged), and vrnic's `imm` ints are the host
(little-endian) reading of that field, as pyverbs and the rxe format have them.

Queue geometry, as mlx5dv_init_obj reports it (struct mlx5dv_qp / mlx5dv_cq):

- SQ: `sq_wqe_cnt` 64-byte basic blocks (MLX5_SEND_WQE_BB). The producer counter
  counts basic blocks, not WQEs; a WQE takes ceil(ds * 16 / 64) of them, and one
  that runs past the end of the SQ continues at its start. The control segment
  carries the counter's low 16 bits as the WQE index; a requester CQE's
  wqe_counter names the first basic block of the WQE it completes.
- RQ: `rq_wqe_cnt` slots of `rq_stride` bytes, one WQE each, stride / 16 data
  segments at most (no receive signature: QPs are created without wq_sig).
- CQ: `cqe_cnt` entries (a power of two) of 64 or 128 bytes; a 128-byte entry
  holds the mlx5_cqe64 in its second half.
- Doorbell records (8 bytes each): a QP's holds the RQ counter at byte 0
  (MLX5_RCV_DBR) and the SQ counter at byte 4 (MLX5_SND_DBR); a CQ's holds its
  consumer index at byte 0 (MLX5_CQ_SET_CI).

Posting sends, in order (libmlx5's post_send_db): write the WQEs; store
fence; write the SQ doorbell record with the new producer counter; then one
aligned 64-bit store of the first 8 bytes of the last WQE's control segment to
the UAR's BlueFlame register (mlx5dv_qp.bf.reg, plus the current BlueFlame
offset, which toggles between 0 and bf.size after every doorbell when bf.size is
non-zero). Receives need no UAR store: the RQ doorbell record is the doorbell.
Polling needs none either; the consumer index goes to the CQ's doorbell record.
(Arming a CQ for an event is a store to the CQ's UAR doorbell; not covered here.)

Not handled: inline data, fences and solicited events (PhysWr has no room for
them); UD and XRC QPs (only RC is encoded: a UD WQE carries its address vector,
so UD stays on the mediated path). SEND_WITH_INV / LOCAL_INV / BIND_MW work
requests, compressed CQEs and data scattered into the CQE raise NotSupported.
The QP must be created with scatter-to-CQE off
(MLX5DV_QP_CREATE_DISABLE_SCATTER_TO_CQE, or MLX5_SCATTER_TO_CQE=0 in the
environment of the process that creates it): libmlx5 turns it on by default,
and then a small receive (or READ/atomic result) lands in the CQE instead of
the guest's buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

from vrnic.core.queue_format.base import PhysWr, QueueFormat, RawCompletion
from vrnic.core.rings import WcOpcode, WrOpcode
from vrnic.errors import InvalidArgument, NotSupported

SEND_WQE_BB = 64  # MLX5_SEND_WQE_BB: the SQ's unit of allocation and of its producer counter
DS_BYTES = 16  # MLX5_WQE_DS_UNITS: the control segment's ds counts 16-byte units
MAX_DS = 0x3F  # MLX5_WQE_CTRL_DS_MASK
INVALID_LKEY = 0x100  # MLX5_INVALID_LKEY: ends a receive WQE's scatter list early
CQE64_BYTES = 64
ATOMIC_BYTES = 8  # libmlx5 always sets an atomic's local data segment to 8 bytes


class Mlx5Opcode(IntEnum):
    """MLX5_OPCODE_*: the WQE opcode, low byte of the control segment's first word."""

    NOP = 0x00
    SEND_INVAL = 0x01
    RDMA_WRITE = 0x08
    RDMA_WRITE_IMM = 0x09
    SEND = 0x0A
    SEND_IMM = 0x0B
    RDMA_READ = 0x10
    ATOMIC_CS = 0x11
    ATOMIC_FA = 0x12


class CtrlFlags(IntEnum):
    """fm_ce_se, the control segment's byte 11 (MLX5_WQE_CTRL_*)."""

    SOLICITED = 1 << 1
    CQ_UPDATE = 2 << 2  # 0x08: write a CQE for this WQE
    FENCE = 4 << 5


class CqeOpcode(IntEnum):
    """MLX5_CQE_*: the CQE opcode, high nibble of op_own (byte 63)."""

    REQ = 0
    RESP_WR_IMM = 1
    RESP_SEND = 2
    RESP_SEND_IMM = 3
    RESP_SEND_INV = 4
    RESIZE_CQ = 5
    NO_PACKET = 6
    REQ_ERR = 13
    RESP_ERR = 14
    INVALID = 15


class Syndrome(IntEnum):
    """MLX5_CQE_SYNDROME_*: byte 55 of an error CQE (mlx5_err_cqe.syndrome)."""

    LOCAL_LENGTH_ERR = 0x01
    LOCAL_QP_OP_ERR = 0x02
    LOCAL_PROT_ERR = 0x04
    WR_FLUSH_ERR = 0x05
    MW_BIND_ERR = 0x06
    BAD_RESP_ERR = 0x10
    LOCAL_ACCESS_ERR = 0x11
    REMOTE_INVAL_REQ_ERR = 0x12
    REMOTE_ACCESS_ERR = 0x13
    REMOTE_OP_ERR = 0x14
    TRANSPORT_RETRY_EXC_ERR = 0x15
    RNR_RETRY_EXC_ERR = 0x16
    REMOTE_ABORTED_ERR = 0x22


class IbvWcStatus(IntEnum):
    """enum ibv_wc_status, all of it (vrnic.core.rings.WcStatus names only the ones the ring engine makes)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21


# enum ibv_wc_flags
WC_GRH = 1 << 0
WC_WITH_IMM = 1 << 1
WC_WITH_INV = 1 << 3

# ibv_wr_opcode -> the WQE's opcode (libmlx5's mlx5_ib_opcode table, the part vrnic posts).
MLX5_OPCODE_OF_WR: dict[int, Mlx5Opcode] = {
    WrOpcode.RDMA_WRITE: Mlx5Opcode.RDMA_WRITE,
    WrOpcode.RDMA_WRITE_WITH_IMM: Mlx5Opcode.RDMA_WRITE_IMM,
    WrOpcode.SEND: Mlx5Opcode.SEND,
    WrOpcode.SEND_WITH_IMM: Mlx5Opcode.SEND_IMM,
    WrOpcode.RDMA_READ: Mlx5Opcode.RDMA_READ,
    WrOpcode.ATOMIC_CMP_AND_SWP: Mlx5Opcode.ATOMIC_CS,
    WrOpcode.ATOMIC_FETCH_AND_ADD: Mlx5Opcode.ATOMIC_FA,
}
_RADDR_OPS = frozenset({Mlx5Opcode.RDMA_WRITE, Mlx5Opcode.RDMA_WRITE_IMM, Mlx5Opcode.RDMA_READ})
_ATOMIC_OPS = frozenset({Mlx5Opcode.ATOMIC_CS, Mlx5Opcode.ATOMIC_FA})
_IMM_OPS = frozenset({Mlx5Opcode.RDMA_WRITE_IMM, Mlx5Opcode.SEND_IMM})

# Completion tables (libmlx5 cq.c: handle_good_req, handle_responder, mlx5_handle_error_cqe).
#
# Requester CQE (opcode REQ), by the WQE opcode in sop_drop_qpn's top byte:
#   WQE opcode           ibv_wc_opcode  wc_flags    byte_len
#   RDMA_WRITE           RDMA_WRITE     -           0
#   RDMA_WRITE_IMM       RDMA_WRITE     WITH_IMM    0
#   SEND, SEND_INVAL     SEND           -           0
#   SEND_IMM             SEND           WITH_IMM    0
#   RDMA_READ            RDMA_READ      -           byte_cnt
#   ATOMIC_CS            COMP_SWAP      -           8
#   ATOMIC_FA            FETCH_ADD      -           8
# Responder CQE, by the CQE opcode (byte_len = byte_cnt; src_qp = flags_rqpn low 24 bits;
# GRH when flags_rqpn bits 28-29 are non-zero, always on RoCE):
#   RESP_WR_IMM          RECV_RDMA_WITH_IMM  WITH_IMM   imm_data = imm_inval_pkey
#   RESP_SEND            RECV                -
#   RESP_SEND_IMM        RECV                WITH_IMM   imm_data = imm_inval_pkey
#   RESP_SEND_INV        RECV                WITH_INV   imm_data = the invalidated rkey
# Error CQE (REQ_ERR, RESP_ERR): status from the syndrome (SYNDROME_STATUS below, anything else
# GENERAL_ERR), vendor_err = vendor_err_synd. Verbs leaves the opcode of a failed completion
# undefined; this gives the requester's WQE opcode mapped as above (SEND if unknown) and RECV for
# the responder.
_REQ_COMPLETION: dict[int, tuple[WcOpcode, int]] = {
    Mlx5Opcode.RDMA_WRITE: (WcOpcode.RDMA_WRITE, 0),
    Mlx5Opcode.RDMA_WRITE_IMM: (WcOpcode.RDMA_WRITE, WC_WITH_IMM),
    Mlx5Opcode.SEND: (WcOpcode.SEND, 0),
    Mlx5Opcode.SEND_INVAL: (WcOpcode.SEND, 0),
    Mlx5Opcode.SEND_IMM: (WcOpcode.SEND, WC_WITH_IMM),
    Mlx5Opcode.RDMA_READ: (WcOpcode.RDMA_READ, 0),
    Mlx5Opcode.ATOMIC_CS: (WcOpcode.COMP_SWAP, 0),
    Mlx5Opcode.ATOMIC_FA: (WcOpcode.FETCH_ADD, 0),
}
_RESP_COMPLETION: dict[int, tuple[WcOpcode, int]] = {
    CqeOpcode.RESP_WR_IMM: (WcOpcode.RECV_RDMA_WITH_IMM, WC_WITH_IMM),
    CqeOpcode.RESP_SEND: (WcOpcode.RECV, 0),
    CqeOpcode.RESP_SEND_IMM: (WcOpcode.RECV, WC_WITH_IMM),
    CqeOpcode.RESP_SEND_INV: (WcOpcode.RECV, WC_WITH_INV),
}
SYNDROME_STATUS: dict[int, IbvWcStatus] = {
    Syndrome.LOCAL_LENGTH_ERR: IbvWcStatus.LOC_LEN_ERR,
    Syndrome.LOCAL_QP_OP_ERR: IbvWcStatus.LOC_QP_OP_ERR,
    Syndrome.LOCAL_PROT_ERR: IbvWcStatus.LOC_PROT_ERR,
    Syndrome.WR_FLUSH_ERR: IbvWcStatus.WR_FLUSH_ERR,
    Syndrome.MW_BIND_ERR: IbvWcStatus.MW_BIND_ERR,
    Syndrome.BAD_RESP_ERR: IbvWcStatus.BAD_RESP_ERR,
    Syndrome.LOCAL_ACCESS_ERR: IbvWcStatus.LOC_ACCESS_ERR,
    Syndrome.REMOTE_INVAL_REQ_ERR: IbvWcStatus.REM_INV_REQ_ERR,
    Syndrome.REMOTE_ACCESS_ERR: IbvWcStatus.REM_ACCESS_ERR,
    Syndrome.REMOTE_OP_ERR: IbvWcStatus.REM_OP_ERR,
    Syndrome.TRANSPORT_RETRY_EXC_ERR: IbvWcStatus.RETRY_EXC_ERR,
    Syndrome.RNR_RETRY_EXC_ERR: IbvWcStatus.RNR_RETRY_EXC_ERR,
    Syndrome.REMOTE_ABORTED_ERR: IbvWcStatus.REM_ABORT_ERR,
}

# mlx5_wqe_ctrl_seg: opmod_idx_opcode, qpn_ds, signature, rsvd[2], fm_ce_se; imm (4 raw bytes) follows.
_CTRL = struct.Struct(">IIBxxB4s")
_RADDR = struct.Struct(">QIxxxx")  # mlx5_wqe_raddr_seg: raddr, rkey, reserved
_ATOMIC = struct.Struct(">QQ")  # mlx5_wqe_atomic_seg: swap_add, compare
_DATA = struct.Struct(">IIQ")  # mlx5_wqe_data_seg: byte_count, lkey, addr
_END_OF_SCATTER = _DATA.pack(0, INVALID_LKEY, 0)
_DBREC = struct.Struct(">I")
# mlx5_cqe64 from byte 24: flags_rqpn, (hds_ip_ext, l4_hdr_type_etc, vlan_info), srqn_uidx, imm_inval_pkey,
# (app, app_op, app_info), byte_cnt, timestamp, sop_drop_qpn, wqe_counter, signature, op_own.
_CQE_TAIL = struct.Struct(">I4xI4s4xI8xIHxB")
_CQE_TAIL_AT = 24
_ERR_SYNDROMES = struct.Struct(">BB")  # mlx5_err_cqe: vendor_err_synd, syndrome
_ERR_SYNDROMES_AT = 54
_OP_OWN_AT = 63
_QPN_WORD = struct.Struct(">I")  # sop_drop_qpn (s_wqe_opcode_qpn in an error CQE)
_QPN_WORD_AT = 56


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _data_segments(sges: list[tuple[int, int, int]], atomic: bool = False) -> list[bytes]:
    """One mlx5_wqe_data_seg per SGE, skipping empty ones as libmlx5 does (a zero byte_count is
    not 'nothing' to the device)."""
    segs = []
    for addr, length, lkey in sges:
        if not 0 <= length < 1 << 31:  # bit 31 of byte_count is MLX5_INLINE_SEG
            raise InvalidArgument(f"an SGE of {length} bytes does not fit a data segment")
        if length:
            segs.append(_DATA.pack(ATOMIC_BYTES if atomic else length, lkey, addr))
    return segs


def send_wqe_ds(wr: PhysWr) -> int:
    """The WQE's size in 16-byte units (the control segment's ds)."""
    op = _mlx5_opcode(wr.opcode)
    ds = 1 + sum(1 for _a, length, _k in wr.sges if length)
    if op in _RADDR_OPS:
        ds += 1
    elif op in _ATOMIC_OPS:
        ds += 2
    return ds


def send_wqe_bbs(wr: PhysWr) -> int:
    """How many 64-byte basic blocks the WQE takes: what the SQ producer counter advances by."""
    return -(-send_wqe_ds(wr) * DS_BYTES // SEND_WQE_BB)


def _mlx5_opcode(opcode: int) -> Mlx5Opcode:
    op = MLX5_OPCODE_OF_WR.get(opcode)
    if op is None:
        raise NotSupported(f"ibv_wr_opcode {opcode} has no direct mlx5 encoding here")
    return op


def encode_send_wqe(wr: PhysWr, qpn: int, wqe_index: int) -> bytes:
    """One RC send WQE: control segment, then a remote address segment (RDMA and atomics), an atomic
    segment (atomics), and the data segments. `wqe_index` is the SQ producer counter (in basic blocks)
    at this WQE; its low 16 bits go into the control segment. Returns exactly ds * 16 bytes."""
    op = _mlx5_opcode(wr.opcode)
    if not 0 <= qpn < 1 << 24:
        raise InvalidArgument(f"QPN {qpn:#x} is wider than 24 bits")
    atomic = op in _ATOMIC_OPS
    if atomic and (len(wr.sges) != 1 or not wr.sges[0][1]):
        raise InvalidArgument("an atomic takes exactly one non-empty SGE (for its 8-byte result)")
    segs = []
    try:
        if op in _RADDR_OPS or atomic:
            segs.append(_RADDR.pack(wr.remote_addr, wr.rkey))
        if op is Mlx5Opcode.ATOMIC_CS:
            segs.append(_ATOMIC.pack(wr.swap, wr.compare_add))
        elif op is Mlx5Opcode.ATOMIC_FA:
            segs.append(_ATOMIC.pack(wr.compare_add, 0))  # swap_add holds the addend; compare is unused
        segs += _data_segments(wr.sges, atomic)
        ds = 1 + len(segs)
        if ds > MAX_DS:
            raise InvalidArgument(f"a WQE of {ds} 16-byte units exceeds the control segment's {MAX_DS}")
        imm = wr.imm.to_bytes(4, "little") if op in _IMM_OPS else bytes(4)
        ctrl = _CTRL.pack(((wqe_index & 0xFFFF) << 8) | op, (qpn << 8) | ds, 0,
                          CtrlFlags.CQ_UPDATE if wr.signaled else 0, imm)
    except (struct.error, OverflowError) as exc:
        raise InvalidArgument(f"a work request field is out of range: {exc}") from None
    return ctrl + b"".join(segs)


def encode_recv_wqe(sges: list[tuple[int, int, int]], max_sge: int) -> bytes:
    """One receive WQE: its data segments and, when there are fewer than the RQ's slot holds, an end
    marker (byte_count 0, lkey MLX5_INVALID_LKEY, addr 0), as libmlx5's post_recv writes them."""
    try:
        segs = _data_segments(sges)
    except (struct.error, OverflowError) as exc:
        raise InvalidArgument(f"an SGE field is out of range: {exc}") from None
    if len(segs) > max_sge:
        raise InvalidArgument(f"{len(segs)} SGEs exceed the RQ slot's {max_sge}")
    if len(segs) < max_sge:
        segs.append(_END_OF_SCATTER)
    return b"".join(segs)


# ----- doorbells ------------------------------------------------------------------------------------------
RQ_DBREC_OFFSET = 0  # MLX5_RCV_DBR * 4 in the QP's doorbell record
SQ_DBREC_OFFSET = 4  # MLX5_SND_DBR * 4
CQ_SET_CI_OFFSET = 0  # MLX5_CQ_SET_CI * 4 in the CQ's doorbell record


def sq_doorbell_record(producer: int) -> bytes:
    """The 4 bytes for the QP doorbell record at SQ_DBREC_OFFSET: the SQ producer counter (basic blocks
    posted so far), low 16 bits, big-endian."""
    return _DBREC.pack(producer & 0xFFFF)


def rq_doorbell_record(head: int) -> bytes:
    """The 4 bytes for the QP doorbell record at RQ_DBREC_OFFSET: receive WQEs posted so far, low 16 bits.
    Writing it is the whole receive doorbell."""
    return _DBREC.pack(head & 0xFFFF)


def cq_doorbell_record(cons_index: int) -> bytes:
    """The 4 bytes for the CQ doorbell record at CQ_SET_CI_OFFSET: the consumer index, low 24 bits."""
    return _DBREC.pack(cons_index & 0xFFFFFF)


def uar_doorbell(wqe: bytes | memoryview) -> bytes:
    """What the UAR doorbell carries: the first 8 bytes of the last posted WQE's control segment
    (opmod_idx_opcode and qpn_ds), stored to the register as one 64-bit write in this byte order."""
    if len(wqe) < 8:
        raise InvalidArgument("a doorbell needs the control segment's first 8 bytes")
    return bytes(wqe[:8])


def uar_doorbell_word(doorbell: bytes) -> int:
    """The doorbell as a native 64-bit integer on a little-endian host, for a single aligned store through
    a memoryview cast to 'Q' (libmlx5's mmio_write64_be puts these same bytes on the bus)."""
    return int.from_bytes(doorbell, "little")


def bf_register_offset(bf_reg: int, page_size: int) -> int:
    """Where the BlueFlame register sits inside the UAR page: mlx5dv_qp.bf.reg is an address in the
    creator's mapping of the page at mlx5dv_qp.uar_mmap_offset; a mapping elsewhere uses this offset."""
    if not _pow2(page_size):
        raise InvalidArgument(f"page size {page_size} is not a power of two")
    return bf_reg & (page_size - 1)


def next_bf_offset(offset: int, bf_size: int) -> int:
    """The BlueFlame offset for the next doorbell: it alternates between the register's two halves
    (0 and mlx5dv_qp.bf.size); with bf.size 0 (no BlueFlame) it stays 0."""
    return offset ^ bf_size


# ----- CQEs -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Cqe:
    """The fields of one mlx5_cqe64 (or mlx5_err_cqe) that a completion needs."""

    opcode: int  # CqeOpcode
    qpn: int
    wqe_counter: int
    byte_cnt: int
    imm: bytes  # imm_inval_pkey, as the wire had it
    flags_rqpn: int
    wqe_opcode: int  # the top byte of sop_drop_qpn (s_wqe_opcode of an error CQE)
    syndrome: int = 0
    vendor_err: int = 0


def cqe_offset(cq_offset: int, cons_index: int, cqe_cnt: int, cqe_size: int = CQE64_BYTES) -> int:
    """Byte offset of the CQE slot the consumer index points at."""
    return cq_offset + (cons_index & (cqe_cnt - 1)) * cqe_size


def cqe_owned_by_software(buf: memoryview, at: int, cons_index: int, cqe_cnt: int,
                          cqe_size: int = CQE64_BYTES) -> bool:
    """Whether the CQE slot at `at` holds a new completion for `cons_index`: its opcode is not INVALID
    and its owner bit equals the consumer index's pass parity, (cons_index >> log2(cqe_cnt)) & 1. The
    device flips the owner bit it writes on every pass over the ring, so stale CQEs of the last pass
    read as not ours."""
    if not _pow2(cqe_cnt):
        raise InvalidArgument(f"a CQ of {cqe_cnt} entries is not a power of two")
    op_own = buf[at + cqe_size - CQE64_BYTES + _OP_OWN_AT]
    return op_own >> 4 != CqeOpcode.INVALID and op_own & 1 == (1 if cons_index & cqe_cnt else 0)


def init_cq_buffer(buf: memoryview, cq_offset: int, cqe_cnt: int, cqe_size: int = CQE64_BYTES) -> None:
    """Mark every CQE invalid with owner bit 0, as libmlx5 does when it creates a CQ."""
    for i in range(cqe_cnt):
        buf[cq_offset + i * cqe_size + cqe_size - CQE64_BYTES + _OP_OWN_AT] = CqeOpcode.INVALID << 4


def cqe_qpn(buf: memoryview, at: int, cqe_size: int = CQE64_BYTES) -> int:
    """The QPN a CQE belongs to, to pick the QP's format when a CQ serves several."""
    word: int = _QPN_WORD.unpack_from(buf, at + cqe_size - CQE64_BYTES + _QPN_WORD_AT)[0]
    return word & 0xFFFFFF


def decode_cqe(buf: memoryview, at: int) -> Cqe:
    """Decode the 64-byte mlx5_cqe64 at `at` (the second half of a 128-byte CQE)."""
    flags_rqpn, _srqn, imm, byte_cnt, sop_drop_qpn, wqe_counter, op_own = _CQE_TAIL.unpack_from(
        buf, at + _CQE_TAIL_AT)
    opcode = op_own >> 4
    if op_own & 0x0C:
        # mlx5dv_get_cqe_format (compressed CQEs) and MLX5_INLINE_SCATTER_32/64 share these bits
        raise NotSupported(f"CQE with op_own {op_own:#04x}: compressed, or data scattered into the CQE")
    syndrome = vendor_err = 0
    if opcode in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR):
        vendor_err, syndrome = _ERR_SYNDROMES.unpack_from(buf, at + _ERR_SYNDROMES_AT)
    return Cqe(opcode, sop_drop_qpn & 0xFFFFFF, wqe_counter, byte_cnt, imm, flags_rqpn, sop_drop_qpn >> 24,
               syndrome, vendor_err)


def completion(cqe: Cqe, wr_id: int) -> RawCompletion:
    """Map a decoded CQE to ibv_wc terms (the table above)."""
    op = cqe.opcode
    if op == CqeOpcode.REQ:
        entry = _REQ_COMPLETION.get(cqe.wqe_opcode)
        if entry is None:
            raise InvalidArgument(f"requester CQE for WQE opcode {cqe.wqe_opcode:#x}, which vrnic never posts")
        wc_opcode, flags = entry
        if wc_opcode == WcOpcode.RDMA_READ:
            byte_len = cqe.byte_cnt
        elif wc_opcode in (WcOpcode.COMP_SWAP, WcOpcode.FETCH_ADD):
            byte_len = ATOMIC_BYTES
        else:
            byte_len = 0
        return RawCompletion(wr_id, IbvWcStatus.SUCCESS, wc_opcode, byte_len, 0, cqe.qpn, 0, flags, 0)
    if op in _RESP_COMPLETION:
        wc_opcode, flags = _RESP_COMPLETION[op]
        if cqe.flags_rqpn >> 28 & 3:
            flags |= WC_GRH
        if op == CqeOpcode.RESP_SEND_INV:
            imm = int.from_bytes(cqe.imm, "big")  # the invalidated rkey, a real big-endian number
        elif flags & WC_WITH_IMM:
            imm = int.from_bytes(cqe.imm, "little")
        else:
            imm = 0
        return RawCompletion(wr_id, IbvWcStatus.SUCCESS, wc_opcode, cqe.byte_cnt, imm, cqe.qpn,
                             cqe.flags_rqpn & 0xFFFFFF, flags, 0)
    if op in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR):
        status = SYNDROME_STATUS.get(cqe.syndrome, IbvWcStatus.GENERAL_ERR)
        if op == CqeOpcode.REQ_ERR:
            wc_opcode = _REQ_COMPLETION.get(cqe.wqe_opcode, (WcOpcode.SEND, 0))[0]
        else:
            wc_opcode = WcOpcode.RECV
        return RawCompletion(wr_id, status, wc_opcode, 0, 0, cqe.qpn, 0, 0, cqe.vendor_err)
    if op == CqeOpcode.INVALID:
        raise InvalidArgument("the CQE is invalid (not written by the device yet)")
    raise NotSupported(f"CQE opcode {op} is not a work completion vrnic handles")


# ----- the QueueFormat --------------------------------------------------------------------------------------
class Mlx5Format(QueueFormat):
    """The mlx5 format for one RC QP whose SQ and RQ sit in `buf` (the guest's arena or RAM).

    mlx5 CQEs do not carry wr_id: like libmlx5, this keeps each posted WQE's wr_id by slot and looks it up
    by the CQE's wqe_counter. So one instance per QP; when a CQ serves several QPs, pick the instance by
    cqe_qpn() first.

    Free space, as libmlx5 keeps it: `sq_tail` is the SQ producer counter up to which the device is done
    (a requester CQE completes its WQE and every unsignaled one before it), `rq_tail` counts consumed
    receive WQEs. The SQ has room for n more basic blocks while producer + n - sq_tail <= sq_wqe_cnt.
    """

    name: ClassVar[str] = "mlx5"

    def __init__(self, qpn: int, *, sq_offset: int, sq_wqe_cnt: int, rq_offset: int = 0, rq_wqe_cnt: int = 0,
                 rq_stride: int = DS_BYTES, cqe_size: int = CQE64_BYTES) -> None:
        if not 0 <= qpn < 1 << 24:
            raise InvalidArgument(f"QPN {qpn:#x} is wider than 24 bits")
        if not _pow2(sq_wqe_cnt) or (rq_wqe_cnt and not _pow2(rq_wqe_cnt)):
            raise InvalidArgument(f"queue sizes must be powers of two (SQ {sq_wqe_cnt}, RQ {rq_wqe_cnt})")
        if not _pow2(rq_stride) or rq_stride < DS_BYTES:
            raise InvalidArgument(f"RQ stride {rq_stride} is not a power of two of at least {DS_BYTES}")
        if cqe_size not in (64, 128):
            raise InvalidArgument(f"CQE size {cqe_size} is neither 64 nor 128")
        self.qpn, self.cqe_size = qpn, cqe_size
        self.sq_offset, self.sq_wqe_cnt = sq_offset, sq_wqe_cnt
        self.rq_offset, self.rq_wqe_cnt, self.rq_stride = rq_offset, rq_wqe_cnt, rq_stride
        self.rq_max_sge = rq_stride // DS_BYTES
        self._sq_wrid = [0] * sq_wqe_cnt
        self._sq_next = [0] * sq_wqe_cnt  # the producer counter just past each posted WQE
        self._rq_wrid = [0] * rq_wqe_cnt
        self.sq_tail = self.rq_tail = 0

    def sq_slot(self, producer: int) -> int:
        """Byte offset of the basic block the SQ producer counter points at."""
        return self.sq_offset + (producer & (self.sq_wqe_cnt - 1)) * SEND_WQE_BB

    def rq_slot(self, head: int) -> int:
        return self.rq_offset + (head & (self.rq_wqe_cnt - 1)) * self.rq_stride

    def send_wqe(self, buf: memoryview, at: int, wr: PhysWr, ssn: int) -> None:
        """`ssn` is the SQ producer counter in basic blocks; advance it by send_wqe_bbs(wr) afterwards."""
        index = ssn & (self.sq_wqe_cnt - 1)
        if at != self.sq_offset + index * SEND_WQE_BB:
            raise InvalidArgument(f"offset {at} is not the SQ slot of producer counter {ssn}")
        wqe = encode_send_wqe(wr, self.qpn, ssn)
        if len(wqe) > self.sq_wqe_cnt * SEND_WQE_BB:
            raise InvalidArgument(f"a {len(wqe)}-byte WQE does not fit the {self.sq_wqe_cnt}-block SQ")
        first = min(len(wqe), self.sq_offset + self.sq_wqe_cnt * SEND_WQE_BB - at)
        buf[at:at + first] = wqe[:first]
        if first < len(wqe):  # wrapped: the rest continues at the SQ's start
            buf[self.sq_offset:self.sq_offset + len(wqe) - first] = wqe[first:]
        self._sq_wrid[index] = wr.wr_id
        self._sq_next[index] = ssn + -(-len(wqe) // SEND_WQE_BB)

    def recv_wqe(self, buf: memoryview, at: int, wr_id: int, sges: list[tuple[int, int, int]]) -> None:
        rel = at - self.rq_offset
        if not self.rq_wqe_cnt or rel < 0 or rel % self.rq_stride or rel >= self.rq_wqe_cnt * self.rq_stride:
            raise InvalidArgument(f"offset {at} is not an RQ slot")
        wqe = encode_recv_wqe(sges, self.rq_max_sge)
        buf[at:at + len(wqe)] = wqe
        self._rq_wrid[rel // self.rq_stride] = wr_id

    def parse_cqe(self, buf: memoryview, at: int) -> RawCompletion:
        cqe = decode_cqe(buf, at + self.cqe_size - CQE64_BYTES)
        if cqe.opcode != CqeOpcode.INVALID and cqe.qpn != self.qpn:
            raise InvalidArgument(f"the CQE belongs to QP {cqe.qpn:#x}, not {self.qpn:#x}")
        wc = completion(cqe, 0)  # refuses what is not a completion before any state changes
        if cqe.opcode in (CqeOpcode.REQ, CqeOpcode.REQ_ERR):
            index = cqe.wqe_counter & (self.sq_wqe_cnt - 1)
            wc.wr_id, self.sq_tail = self._sq_wrid[index], self._sq_next[index]
        elif self.rq_wqe_cnt:
            wc.wr_id = self._rq_wrid[cqe.wqe_counter & (self.rq_wqe_cnt - 1)]
            self.rq_tail += 1
        return wc
