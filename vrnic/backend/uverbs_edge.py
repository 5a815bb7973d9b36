"""The raw uverbs edge: a vRNIC's own ucontext whose queues vrnicd creates but never maps.

The direct engine hands a guest its vRNIC's queues. rxe maps each queue once
(see ../shared/FACTS.md), and librxe maps them inside create_qp/create_cq, so
objects made through pyverbs can never be handed on. Here vrnicd opens the
uverbs character device itself and issues the legacy write commands of
rdma/ib_user_verbs.h; responses carry the queues' mmap offsets, which the guest
maps through the fd it is given. Queries go through an ordinary pyverbs context.
Errors become vrnic errors here, and nowhere else.
"""

from __future__ import annotations

import ctypes
import errno as errnos
import ipaddress
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vrnic.backend.rnic_edge import (
    PORT,
    DeviceContext,
    PhysCompletion,
    PhysRecv,
    PhysSend,
    QpCaps,
    RtrParams,
    RtsParams,
)
from vrnic.errors import DeviceError, InvalidArgument, NotFound, NotSupported, VrnicError

log = logging.getLogger(__name__)
UVERBS_SYSFS = Path("/sys/class/infiniband_verbs")
DEV_DIR = Path("/dev/infiniband")

# enum ib_uverbs_write_cmds
GET_CONTEXT, ALLOC_PD, DEALLOC_PD, REG_MR, DEREG_MR = 0, 3, 4, 9, 13
CREATE_CQ, DESTROY_CQ, CREATE_QP, QUERY_QP, MODIFY_QP, DESTROY_QP = 18, 20, 24, 25, 26, 27

# enum ib_qp_attr_mask
STATE, ACCESS_FLAGS, PKEY_INDEX, PORT_MASK, QKEY, AV, PATH_MTU = 1, 8, 16, 32, 64, 128, 256
TIMEOUT, RETRY_CNT, RNR_RETRY, RQ_PSN, MAX_QP_RD_ATOMIC = 512, 1024, 2048, 4096, 8192
MIN_RNR_TIMER, SQ_PSN, MAX_DEST_RD_ATOMIC, DEST_QPN = 32768, 65536, 131072, 1048576

QP_STATE_NUM = {"reset": 0, "init": 1, "rtr": 2, "rts": 3, "sqd": 4, "sqe": 5, "err": 6}
QP_STATE_NAME = {v: k for k, v in QP_STATE_NUM.items()}
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
QP_TYPE = {"rc": 2, "uc": 3}  # enum ib_qp_type; UD stays on the mediated engine

_HDR = struct.Struct("<IHH")  # ib_uverbs_cmd_hdr: command, in_words, out_words
_REG_MR_CMD = struct.Struct("<IHHQQQQII")  # the header, then ib_uverbs_reg_mr: response, start, length, hca_va,
# pd_handle, access_flags
_REG_MR_RESP = struct.Struct("<III")  # ib_uverbs_reg_mr_resp: mr_handle, lkey, rkey
_MMINFO = struct.Struct("<QI4x")  # rdma_user_rxe.h struct mminfo: offset, size
_QP_DEST = struct.Struct("<16sIHHBBBBBBBB")  # ib_uverbs_qp_dest
_MODIFY_TAIL = struct.Struct("<IIIIIIIHHBBBBBBBBBBBBBB2x")  # ib_uverbs_modify_qp after the two dests
QUERY_QP_STATE_AT = 108  # ib_uverbs_query_qp_resp.qp_state
QUERY_QP_TIMEOUT_AT = 117  # ib_uverbs_query_qp_resp.timeout


@dataclass(frozen=True)
class QueueMap:
    """Where a queue is: mmap the uverbs fd at offset for size bytes (once: rxe allows one mapping)."""

    offset: int
    size: int

    def as_dict(self) -> dict[str, int]:
        return {"offset": self.offset, "size": self.size}


@dataclass
class RawPd:
    handle: int


@dataclass
class RawMr:
    handle: int


@dataclass
class RawCq:
    handle: int
    cqe: int
    queue: QueueMap


@dataclass
class RawQp:
    handle: int
    qpn: int
    caps: QpCaps
    sq: QueueMap
    rq: QueueMap
    max_inline: int = 0


def uverbs_path(device: str, sysfs: Path = UVERBS_SYSFS, dev: Path = DEV_DIR) -> Path:
    """/dev/infiniband/uverbsN of an RDMA device, by the ibdev name sysfs gives each uverbs node."""
    for node in sorted(sysfs.glob("uverbs*")):
        try:
            if (node / "ibdev").read_text().strip() == device:
                return dev / node.name
        except OSError:
            continue
    raise NotFound(f"no uverbs device node for {device}")


class UverbsFile:
    """An open uverbs device with its ucontext. vrnicd is the opener, so legacy write() commands work."""

    def __init__(self, device: str) -> None:
        self.device = device
        path = uverbs_path(device)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise DeviceError(f"open {path}: {exc.strerror}", exc.errno or 0) from exc
        self.async_fd = -1
        try:
            resp = self.command(GET_CONTEXT, b"", 8, "get context")
            self.async_fd = struct.unpack_from("<I", resp)[0]
        except BaseException:
            os.close(self.fd)
            raise

    def command(self, command: int, body: bytes, response_bytes: int, what: str) -> bytes:
        """One legacy command. Commands with a response start their body with its address (added here)."""
        response = ctypes.create_string_buffer(max(response_bytes, 1))
        if response_bytes:
            body = struct.pack("<Q", ctypes.addressof(response)) + body
        data = _HDR.pack(command, (_HDR.size + len(body)) // 4, response_bytes // 4) + body
        try:
            os.write(self.fd, data)
        except OSError as exc:
            raise _device_error(what, exc) from exc
        return response.raw[:response_bytes]

    def close(self) -> None:
        """Closing the fd destroys whatever is left in the ucontext (once the guest's copies are closed too)."""
        for fd in (self.async_fd, self.fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    continue
        self.fd = self.async_fd = -1


def reg_mr_by_write(fd: int, pd_handle: int, address: int, length: int, access: int) -> tuple[int, int, int]:
    """REG_MR of [address, +length) as one legacy write on a uverbs command fd, for the PD of that handle in its
    ucontext (whoever made the ucontext: this module or rdma-core): (MR handle, lkey, rkey)."""
    response = ctypes.create_string_buffer(_REG_MR_RESP.size)
    command = _REG_MR_CMD.pack(REG_MR, _REG_MR_CMD.size // 4, _REG_MR_RESP.size // 4, ctypes.addressof(response),
                               address, length, address, pd_handle, access)
    try:
        os.write(fd, command)
    except OSError as exc:
        raise _device_error("reg MR", exc) from exc
    handle, lkey, rkey = _REG_MR_RESP.unpack(response.raw)
    return handle, lkey, rkey


def dereg_mr_by_write(fd: int, handle: int) -> None:
    """DEREG_MR of the MR of that handle, as one legacy write on its ucontext's command fd."""
    try:
        os.write(fd, _HDR.pack(DEREG_MR, (_HDR.size + 4) // 4, 0) + struct.pack("<I", handle))
    except OSError as exc:
        raise _device_error("dereg MR", exc) from exc


def _device_error(what: str, exc: OSError) -> DeviceError | NotSupported:
    code = exc.errno or 0
    if code in (errnos.EOPNOTSUPP, errnos.ENOSYS):
        return NotSupported(f"{what}: {exc.strerror}")
    return DeviceError(f"{what}: {exc.strerror}", code)


class DirectContext(DeviceContext):
    """A vRNIC's device context for the direct engine: objects by raw command, queues left unmapped.

    Posting and polling are the guest's; this context refuses them. Queries and limits come from an
    ordinary pyverbs context on the same device (another ucontext, with no objects in it).
    """

    def __init__(self, device: str, queries: DeviceContext) -> None:
        self.queries = queries
        try:
            self.file = UverbsFile(device)
        except BaseException:
            queries.close()
            raise

    @property
    def fd(self) -> int:
        return self.file.fd

    def query_device(self) -> Any:
        return self.queries.query_device()

    def query_port(self, port: int) -> Any:
        return self.queries.query_port(port)

    def alloc_pd(self) -> RawPd:
        resp = self.file.command(ALLOC_PD, b"", 4, "alloc PD")
        return RawPd(struct.unpack("<I", resp)[0])

    def reg_mr(self, pd: RawPd, address: int, length: int, access: int) -> tuple[RawMr, int, int]:
        handle, lkey, rkey = reg_mr_by_write(self.file.fd, pd.handle, address, length, access)
        return RawMr(handle), lkey, rkey

    def create_cq(self, cqe: int) -> RawCq:
        # user_handle 0, comp_vector 0, no completion channel: a direct guest polls its CQ itself.
        resp = self.file.command(CREATE_CQ, struct.pack("<QIIiI", 0, cqe, 0, -1, 0), 24, "create CQ")
        handle, real_cqe = struct.unpack_from("<II", resp)
        return RawCq(handle, real_cqe, QueueMap(*_MMINFO.unpack_from(resp, 8)))

    def cq_event_fd(self, cq: Any) -> int | None:
        return None

    def create_qp(self, pd: RawPd, send_cq: RawCq, recv_cq: RawCq, qp_type: str, caps: QpCaps) -> tuple[RawQp, int]:
        kind = QP_TYPE.get(qp_type)
        if kind is None:
            raise InvalidArgument(f"{qp_type.upper()} QPs stay on the shared-ring engine (rxe takes a UD "
                                  f"destination from the WQE, which a guest could write)")
        body = struct.pack("<QIIIIIIIIIBBBB", 0, pd.handle, send_cq.handle, recv_cq.handle, 0, caps.max_send_wr,
                           caps.max_recv_wr, caps.max_sge, caps.max_sge, 0, 0, kind, 0, 0)
        resp = self.file.command(CREATE_QP, body, 64, "create QP")
        handle, qpn, send_wr, recv_wr, send_sge, _recv_sge, inline = struct.unpack_from("<7I", resp)
        rq, sq = QueueMap(*_MMINFO.unpack_from(resp, 32)), QueueMap(*_MMINFO.unpack_from(resp, 48))
        return RawQp(handle, qpn, QpCaps(send_wr, recv_wr, send_sge), sq, rq, inline), qpn

    def _modify(self, qp: RawQp, mask: int, state: str, dest: bytes = bytes(32), *, qkey: int = 0,
                rq_psn: int = 0, sq_psn: int = 0, dest_qpn: int = 0, access: int = 0, path_mtu: int = 0,
                max_rd_atomic: int = 0, max_dest_rd_atomic: int = 0, min_rnr_timer: int = 0, timeout: int = 0,
                retry_cnt: int = 0, rnr_retry: int = 0) -> None:
        tail = _MODIFY_TAIL.pack(qp.handle, mask, qkey, rq_psn, sq_psn, dest_qpn, access, 0, 0,
                                 QP_STATE_NUM[state], 0, path_mtu, 0, 0, max_rd_atomic, max_dest_rd_atomic,
                                 min_rnr_timer, PORT, timeout, retry_cnt, rnr_retry, 0, 0)
        self.file.command(MODIFY_QP, dest + bytes(32) + tail, 0, f"modify QP to {state}")

    def qp_to_init(self, qp: RawQp, qp_type: str, access: int, qkey: int) -> None:
        self._modify(qp, STATE | PKEY_INDEX | PORT_MASK | ACCESS_FLAGS, "init", access=access)

    def qp_to_rtr(self, qp: RawQp, qp_type: str, params: RtrParams | None) -> None:
        if params is None:
            raise InvalidArgument("a direct QP needs its peer at RTR")
        dest = _QP_DEST.pack(ipaddress.IPv6Address(params.dgid).packed, 0, 0, 0, params.sgid_index, 64, 0, 0, 0,
                             0, 1, PORT)
        self._modify(qp, STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER, "rtr",
                     dest, rq_psn=params.rq_psn, dest_qpn=params.dest_qpn, path_mtu=MTU_ENUM[params.path_mtu],
                     max_dest_rd_atomic=params.max_dest_rd_atomic, min_rnr_timer=params.min_rnr_timer)

    def qp_to_rts(self, qp: RawQp, qp_type: str, params: RtsParams) -> None:
        self._modify(qp, STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC, "rts",
                     sq_psn=params.sq_psn, timeout=params.timeout, retry_cnt=params.retry_cnt,
                     rnr_retry=params.rnr_retry, max_rd_atomic=params.max_rd_atomic)

    def qp_to_state(self, qp: RawQp, state: str) -> None:
        self._modify(qp, STATE, "err" if state == "err" else "reset")

    def query_qp_state(self, qp: RawQp) -> str:
        resp = self.file.command(QUERY_QP, struct.pack("<II", qp.handle, STATE), 128, "query QP")
        return QP_STATE_NAME.get(resp[QUERY_QP_STATE_AT], str(resp[QUERY_QP_STATE_AT]))

    def query_rc_timeout(self, qp: RawQp) -> int:
        resp = self.file.command(QUERY_QP, struct.pack("<II", qp.handle, TIMEOUT), 128, "query QP")
        return resp[QUERY_QP_TIMEOUT_AT]

    def create_ah(self, pd: Any, dgid: str, sgid_index: int) -> Any:
        raise InvalidArgument("address handles are for UD, which stays on the shared-ring engine")

    def post_send(self, qp: Any, wr: PhysSend) -> None:
        raise InvalidArgument("a direct guest posts to its own send queue")

    def post_recv(self, qp: Any, wr: PhysRecv) -> None:
        raise InvalidArgument("a direct guest posts to its own receive queue")

    def poll_cq(self, cq: Any, max_entries: int) -> list[PhysCompletion]:
        raise InvalidArgument("a direct guest polls its own CQ")

    def arm_cq(self, cq: Any) -> None:
        return None

    def ack_cq_event(self, cq: Any) -> None:
        return None

    def destroy(self, *objects: Any) -> None:
        """Destroy in the order given; keep going past failures so nothing else leaks."""
        for obj in objects:
            try:
                self._destroy(obj)
            except VrnicError as exc:  # the kernel keeps it until the ucontext closes; say so
                log.warning("%s: %s", self.file.device, exc)

    def _destroy(self, obj: Any) -> None:
        if isinstance(obj, RawQp):
            self.file.command(DESTROY_QP, struct.pack("<II", obj.handle, 0), 4, "destroy QP")
        elif isinstance(obj, RawCq):
            self.file.command(DESTROY_CQ, struct.pack("<II", obj.handle, 0), 8, "destroy CQ")
        elif isinstance(obj, RawMr):
            dereg_mr_by_write(self.file.fd, obj.handle)
        elif isinstance(obj, RawPd):
            self.file.command(DEALLOC_PD, struct.pack("<I", obj.handle), 0, "dealloc PD")

    def close(self) -> None:
        self.file.close()
        self.queries.close()
