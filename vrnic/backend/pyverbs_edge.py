"""The pyverbs edge: the RNIC edge on a real verbs device; errors become vrnic errors here, and nowhere else.

Also the two things pyverbs 44 does not give directly: a device inventory in
plain data, and the file descriptor of a completion channel (for select()).
"""

from __future__ import annotations

import errno as errnos
import functools
import ipaddress
import logging
import os
import threading
from typing import Any

import pyverbs.enums as e
from pyverbs.addr import AH, GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context, get_device_list, guid_to_hex
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

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
from vrnic.backend.uverbs_edge import dereg_mr_by_write, reg_mr_by_write
from vrnic.core.specs import DeviceInfo, GidEntry, PortInfo
from vrnic.errors import DeviceError, NotFound, NotSupported, VrnicError

log = logging.getLogger(__name__)
RXE_VENDOR_ID = 0xFFFFFF  # what rxe reports as its vendor id
PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
GID_TYPES = {0: "IB", 1: "RoCE v1", 2: "RoCE v2"}  # enum ibv_gid_type
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
CAPS = ("max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_mr_size", "max_pd",
        "max_qp_rd_atom", "max_qp_init_rd_atom", "max_ah", "atomic_caps", "phys_port_cnt")


# Each transition's attribute mask, as pyverbs' to_init/to_rtr/to_rts send it for these QP types.
TRANSITION_MASKS = {
    ("rc", "init"): e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS,
    ("ud", "init"): e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_QKEY,
    ("rc", "rtr"): e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
    | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER,
    ("ud", "rtr"): e.IBV_QP_STATE,
    ("rc", "rts"): e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN
    | e.IBV_QP_MAX_QP_RD_ATOMIC,
    ("ud", "rts"): e.IBV_QP_STATE | e.IBV_QP_SQ_PSN,
}
KEPT_ATTRS = 256  # attribute objects kept per context for QP sizes and routes (more: start over)


@functools.lru_cache(maxsize=1024)
def _display_gid(text: str) -> str:
    """Remembered: every description of a device parses each of its GIDs (issue 14)."""
    address = ipaddress.IPv6Address(text)
    return f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped else str(address)


class device_errors:  # noqa: N801 -- used as a function: `with device_errors("what"):`
    """Turn pyverbs failures into DeviceError (with errno) or NotSupported.

    A class rather than a generator: a generator-based context manager is four Python calls per use (3-5 us
    each under TCG), and every create and transition goes through one (issue 14)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        if isinstance(exc, PyverbsRDMAError):
            code = abs(exc.error_code or 0)
            if code in (errnos.EOPNOTSUPP, errnos.ENOSYS):
                raise NotSupported(f"{self.what}: not supported by the device") from exc
            raise DeviceError(f"{self.what}: {os.strerror(code) if code else exc}", code) from exc
        if isinstance(exc, PyverbsError):
            raise DeviceError(f"{self.what}: {exc}") from exc


# Kept for the calls made per QP (an instance holds nothing between uses)
_CREATE_QP = device_errors("create QP")
_MODIFY_INIT = device_errors("modify QP to init")
_MODIFY_RTR = device_errors("modify QP to rtr")
_MODIFY_RTS = device_errors("modify QP to rts")


def device_names() -> list[str]:
    with device_errors("list RDMA devices"):
        return sorted(d.name.decode() for d in get_device_list())


def describe(name: str) -> DeviceInfo:
    _check_known(name)
    with open_context(name) as ctx:
        return _describe_open(ctx, name)


def _check_known(name: str) -> None:
    if name not in device_names():
        raise NotFound(f"no RDMA device {name}")


def _describe_open(ctx: Context, name: str) -> DeviceInfo:
    with device_errors(f"query {name}"):
        attr = ctx.query_device()
        caps = {c: int(getattr(attr, c)) for c in CAPS}
        if int(attr.vendor_id) == RXE_VENDOR_ID:
            # The direct engine drives rxe's queues; traffic between QPs of one rxe device loops back inside
            # rxe, past any netfilter hook, so the packet guard cannot hold there (README, "Two engines").
            caps |= {"direct_engine": 1, "direct_guard_loopback_gap": 1}
            # Its packets leave through the netdev's egress, so tc can shape them (vrnic.backend.qos_shaper).
            caps |= {"qos_shaping": 1}
        ports = []
        # One ioctl for the valid entries; sysfs would mean reading every slot (1024 on rxe).
        table = ctx.query_gid_table(attr.phys_port_cnt * 1024)
        for port in range(1, attr.phys_port_cnt + 1):
            pattr = ctx.query_port(port)
            gids = [GidEntry(index=g.gid_index, gid=_display_gid(g.gid_str()), type=GID_TYPES.get(g.gid_type, "?"))
                    for g in table if g.port_num == port]
            ports.append(PortInfo(port=port, state=PORT_STATES.get(pattr.state, str(pattr.state)),
                                  mtu=MTU_BYTES.get(pattr.active_mtu, 0), gids=gids))
        return DeviceInfo(name=name, driver="verbs", node_guid=guid_to_hex(attr.node_guid), ports=ports,
                          caps=caps)


_fd_lock = threading.Lock()


def _open_fds() -> set[int]:
    """This process's open fds, without the one used to list them (its number is reused next)."""
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return {int(name) for name in os.listdir(listing)} - {listing}
    finally:
        os.close(listing)


def _is_event_fd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[infinibandevent]"
    except OSError:
        return False


def comp_channel_with_fd(ctx: Context) -> tuple[CompChannel, int | None]:
    """A completion channel and its fd, found as the one new [infinibandevent] fd.

    pyverbs does not expose ibv_comp_channel.fd; a global lock keeps two
    channels from being created at once so the new fd is unambiguous. None
    means the fd could not be identified and the caller must poll instead.
    """
    with _fd_lock:
        # Diff fd numbers and readlink only the new ones: a readlink per open fd is slow under TCG.
        before = _open_fds()
        with device_errors("create completion channel"):
            channel = CompChannel(ctx)
        new = [fd for fd in _open_fds() - before if _is_event_fd(fd)]
    return channel, (new[0] if len(new) == 1 else None)


def open_context(name: str) -> Context:
    """Open a device context; under the channel lock, because its async fd is an [infinibandevent] too."""
    with _fd_lock, device_errors(f"open {name}"):
        return Context(name=name)


def close_quietly(*resources: Any) -> int:
    """Close in the order given; keep going past failures so nothing else leaks. The number that failed."""
    failed = 0
    for resource in resources:
        if resource is None:
            continue
        try:
            resource.close()
        except PyverbsError:
            failed += 1
    return failed


# ----- the RNIC edge over pyverbs ---------------------------------------------------------------------

MTU_ENUM = {256: e.IBV_MTU_256, 512: e.IBV_MTU_512, 1024: e.IBV_MTU_1024, 2048: e.IBV_MTU_2048,
            4096: e.IBV_MTU_4096}
QP_STATES = {e.IBV_QPS_RESET: "reset", e.IBV_QPS_INIT: "init", e.IBV_QPS_RTR: "rtr", e.IBV_QPS_RTS: "rts",
             e.IBV_QPS_SQD: "sqd", e.IBV_QPS_SQE: "sqe", e.IBV_QPS_ERR: "err"}


@functools.lru_cache(maxsize=1024)
def _gid(text: str) -> GID:
    """pyverbs parses only the fully written-out form (8 groups of 4 hex digits). Cached: parsing it (and
    pyverbs' GID, which looks up a logger) was a tenth of connecting a QP; a route copies the GID it is given."""
    return GID(ipaddress.IPv6Address(text).exploded)


class _WrittenMr:
    """An MR registered by a legacy write on the context's command fd (PyverbsContext.reg_mr): its kernel handle,
    until it is deregistered (a handle the kernel may give the next MR is never deregistered twice)."""

    __slots__ = ("handle", "live")

    def __init__(self, handle: int) -> None:
        self.handle, self.live = handle, True


class _Cq:
    __slots__ = ("real", "channel", "fd")

    def __init__(self, real: CQ, channel: CompChannel, fd: int | None) -> None:
        self.real, self.channel, self.fd = real, channel, fd

    def close(self) -> int:
        return close_quietly(self.real, self.channel)


SPARE_CHANNELS = 64  # completion channels a context keeps from destroyed CQs, for the next create_cq


class PyverbsContext(DeviceContext):
    def __init__(self, name: str) -> None:
        self.name = name
        self.ctx = open_context(name)
        # A destroyed CQ's completion channel serves the next CQ: finding a new channel's fd lists /proc/self/fd
        # twice, which cost more than the CQ itself (issue 14). Destroying a CQ drops its pending events from
        # the channel (the kernel's ib_uverbs_release_ucq), so a reused channel carries none of the old CQ's.
        self._spare_channels: list[tuple[CompChannel, int | None]] = []
        # Attribute objects kept for the next create or transition (see qp_to_init); the lock keeps two threads
        # from filling the one QPAttr at once (a session's verbs run under its own lock, a shadow's under it too).
        self._attr = QPAttr(port_num=PORT)
        self._attr.pkey_index = 0
        self._attr_lock = threading.Lock()
        self._caps: dict[QpCaps, QPCap] = {}
        self._routes: dict[tuple[str, int], AHAttr] = {}
        self._last_init: tuple[_Cq, _Cq, tuple[str, QpCaps], QPInitAttr] | None = None  # see create_qp
        self._failed_destroys = 0  # an object that may live on in the context: it is closed, not kept for reuse
        self._written_mrs: dict[int, _WrittenMr] = {}  # by handle: MRs reg_mr made that are not deregistered yet

    def query_device(self) -> DeviceLimits:
        with device_errors("query device"):
            a = self.ctx.query_device()
        return DeviceLimits(max_qp=a.max_qp, max_cq=a.max_cq, max_mr=a.max_mr, max_pd=a.max_pd, max_cqe=a.max_cqe,
                            max_qp_wr=a.max_qp_wr, max_sge=a.max_sge, atomic_caps=int(a.atomic_caps))

    def query_port(self, port: int) -> PortAttrs:
        with device_errors("query port"):
            a = self.ctx.query_port(port)
        return PortAttrs(state=int(a.state), active_mtu=int(a.active_mtu), max_mtu=int(a.max_mtu))

    def alloc_pd(self) -> PD:
        with device_errors("alloc PD"):
            return PD(self.ctx)

    def reg_mr(self, pd: PD, address: int, length: int, access: int) -> tuple[_WrittenMr, int, int]:
        # A legacy REG_MR write on the context's own command fd, not pyverbs' MR(): the same kernel verb (rxe's
        # rxe_reg_user_mr) at about half the cost (lab, 32 registrations of fresh 4 KiB pages in a row: 1.5-1.8 ms
        # against 2.8-3.3; issue 14). The MR lives in the same ucontext and PD, so the QPs made through pyverbs
        # use its keys as any other's. rdma-core's fork protection, which ibv_reg_mr would add, has nothing to
        # guard here: vrnicd's guest memory is a shared mapping, which a fork shares rather than copies.
        handle, lkey, rkey = reg_mr_by_write(self.ctx.cmd_fd, pd.handle, address, length, access)
        mr = self._written_mrs[handle] = _WrittenMr(handle)
        return mr, lkey, rkey

    def _dereg_written(self, mr: _WrittenMr) -> int:
        """Deregister an MR reg_mr made (once): 0, or 1 if the kernel refused (it may live on in the context)."""
        if not mr.live:
            return 0
        try:
            dereg_mr_by_write(self.ctx.cmd_fd, mr.handle)
        except VrnicError as exc:
            log.warning("%s: %s", self.name, exc)
            return 1
        mr.live = False
        if self._written_mrs.get(mr.handle) is mr:  # not a later MR the kernel gave the same handle
            del self._written_mrs[mr.handle]
        return 0

    def create_cq(self, cqe: int) -> _Cq:
        channel, fd = self._spare_channels.pop() if self._spare_channels else comp_channel_with_fd(self.ctx)
        try:
            with device_errors("create CQ"):
                return _Cq(CQ(self.ctx, cqe, None, channel, 0), channel, fd)
        except BaseException:
            close_quietly(channel)
            raise

    def cq_event_fd(self, cq: _Cq) -> int | None:
        return cq.fd

    def create_qp(self, pd: PD, send_cq: _Cq, recv_cq: _Cq, qp_type: str, caps: QpCaps) -> tuple[QP, int]:
        # The last QPInitAttr serves the next QP of the same CQs, type and sizes (QP() only reads it): a batch's
        # QPs are of one shape, and a new one per QP cost 0.035 of 0.28 ms in the lab (issue 14). It is kept with
        # the CQ objects themselves, so a new CQ is never taken for an old one.
        last = self._last_init
        if last is not None and last[0] is send_cq and last[1] is recv_cq and last[2] == (qp_type, caps):
            init = last[3]
        else:
            init = self._init_attr(send_cq, recv_cq, qp_type, caps)
            self._last_init = (send_cq, recv_cq, (qp_type, caps), init)
        with _CREATE_QP:
            qp = QP(pd, init)
        return qp, qp.qp_num

    def _init_attr(self, send_cq: _Cq, recv_cq: _Cq, qp_type: str, caps: QpCaps) -> QPInitAttr:
        cap = self._caps.get(caps)
        if cap is None:
            if len(self._caps) >= KEPT_ATTRS:
                self._caps.clear()
            cap = self._caps[caps] = QPCap(max_send_wr=caps.max_send_wr, max_recv_wr=caps.max_recv_wr,
                                           max_send_sge=caps.max_sge, max_recv_sge=caps.max_sge)
        return QPInitAttr(qp_type=e.IBV_QPT_RC if qp_type == "rc" else e.IBV_QPT_UD, scq=send_cq.real,
                          rcq=recv_cq.real, cap=cap, sq_sig_all=0)

    # The transitions set the fields their mask names on one QPAttr kept per context, and send the masks below:
    # each pyverbs attribute object asks logging for a logger when made, and pyverbs' to_init/to_rtr/to_rts
    # build a dict of every QP type's masks per call (and may chain an INIT in; the edge's contract is one
    # transition per call). The fields outside a transition's mask are not read. (issue 14)
    def qp_to_init(self, qp: QP, qp_type: str, access: int, qkey: int) -> None:
        with self._attr_lock, _MODIFY_INIT:
            attr = self._attr
            attr.qp_state = e.IBV_QPS_INIT
            if qp_type == "rc":
                attr.qp_access_flags = access
            else:
                attr.qkey = qkey
            qp.modify(attr, TRANSITION_MASKS[qp_type, "init"])

    def qp_to_rtr(self, qp: QP, qp_type: str, params: RtrParams | None) -> None:
        if params is None and qp_type == "rc":
            raise DeviceError("modify QP to rtr: an RC QP needs its destination")
        with self._attr_lock, _MODIFY_RTR:
            attr = self._attr
            attr.qp_state = e.IBV_QPS_RTR
            if params is not None:
                attr.ah_attr = self._route(params.dgid, params.sgid_index)
                attr.path_mtu = MTU_ENUM[params.path_mtu]
                attr.dest_qp_num = params.dest_qpn
                attr.rq_psn = params.rq_psn
                attr.max_dest_rd_atomic = params.max_dest_rd_atomic
                attr.min_rnr_timer = params.min_rnr_timer
            qp.modify(attr, TRANSITION_MASKS[qp_type, "rtr"])

    def _route(self, dgid: str, sgid_index: int) -> AHAttr:
        """The address vector towards dgid (kept: QPAttr copies it in)."""
        route = self._routes.get((dgid, sgid_index))
        if route is None:
            if len(self._routes) >= KEPT_ATTRS:
                self._routes.clear()
            route = self._routes[dgid, sgid_index] = AHAttr(
                gr=GlobalRoute(dgid=_gid(dgid), sgid_index=sgid_index, hop_limit=64), is_global=1, port_num=PORT)
        return route

    def qp_to_rts(self, qp: QP, qp_type: str, params: RtsParams) -> None:
        with self._attr_lock, _MODIFY_RTS:
            attr = self._attr
            attr.qp_state = e.IBV_QPS_RTS
            attr.sq_psn = params.sq_psn
            if qp_type == "rc":
                attr.timeout = params.timeout
                attr.retry_cnt = params.retry_cnt
                attr.rnr_retry = params.rnr_retry
                attr.max_rd_atomic = params.max_rd_atomic
            qp.modify(attr, TRANSITION_MASKS[qp_type, "rts"])

    def qp_to_state(self, qp: QP, state: str) -> None:
        with self._attr_lock, device_errors(f"modify QP to {state}"):
            self._attr.qp_state = e.IBV_QPS_ERR if state == "err" else e.IBV_QPS_RESET
            qp.modify(self._attr, e.IBV_QP_STATE)

    def query_qp_state(self, qp: QP) -> str:
        with device_errors("query QP"):
            attr, _init = qp.query(e.IBV_QP_STATE | e.IBV_QP_CAP)
        return QP_STATES.get(attr.qp_state, str(attr.qp_state))

    def query_rc_timeout(self, qp: QP) -> int:
        with device_errors("query QP"):
            attr, _init = qp.query(e.IBV_QP_TIMEOUT)
        return int(attr.timeout)

    def create_ah(self, pd: PD, dgid: str, sgid_index: int) -> AH:
        route = GlobalRoute(dgid=_gid(dgid), sgid_index=sgid_index, hop_limit=64)
        with device_errors("create AH"):
            return AH(pd, attr=AHAttr(gr=route, is_global=1, port_num=PORT))

    def post_send(self, qp: QP, wr: PhysSend) -> None:
        try:
            real = SendWR(wr_id=wr.wr_id, opcode=wr.opcode, num_sge=len(wr.sges), sg=[SGE(*s) for s in wr.sges],
                          send_flags=e.IBV_SEND_SIGNALED if wr.signaled else 0, imm_data=wr.imm)
            if wr.ah is not None:
                real.set_wr_ud(wr.ah, wr.remote_qpn, wr.qkey)
            elif wr.opcode in (e.IBV_WR_ATOMIC_CMP_AND_SWP, e.IBV_WR_ATOMIC_FETCH_AND_ADD):
                real.set_wr_atomic(wr.rkey, wr.remote_addr, wr.compare_add, wr.swap)
            elif wr.opcode not in (e.IBV_WR_SEND, e.IBV_WR_SEND_WITH_IMM):
                real.set_wr_rdma(wr.rkey, wr.remote_addr)
            qp.post_send(real)
        except PyverbsRDMAError as exc:
            if abs(exc.error_code or 0) == errnos.ENOMEM:
                raise SendQueueFull("post send: the send queue is full", errnos.ENOMEM) from exc
            raise DeviceError(f"post send: {exc}", abs(exc.error_code or 0)) from exc
        except PyverbsError as exc:
            raise DeviceError(f"post send: {exc}") from exc

    def post_recv(self, qp: QP, wr: PhysRecv) -> None:
        with device_errors("post recv"):
            qp.post_recv(RecvWR(wr_id=wr.wr_id, num_sge=len(wr.sges), sg=[SGE(*s) for s in wr.sges]))

    def poll_cq(self, cq: _Cq, max_entries: int) -> list[PhysCompletion]:
        with device_errors("poll CQ"):
            npolled, wcs = cq.real.poll(num_entries=max_entries)
        return [PhysCompletion(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data, wc.qp_num, wc.src_qp,
                               wc.wc_flags, wc.vendor_err) for wc in wcs[:npolled]]

    def arm_cq(self, cq: _Cq) -> None:
        with device_errors("arm CQ"):
            cq.real.req_notify()

    def ack_cq_event(self, cq: _Cq) -> None:
        try:
            cq.channel.get_cq_event(cq.real)
            cq.real.ack_events(1)
        except PyverbsError:
            pass  # no event pending: a stale wake-up

    def destroy(self, *objects: Any) -> None:
        for obj in objects:
            if isinstance(obj, _WrittenMr):
                self._failed_destroys += self._dereg_written(obj)
            elif isinstance(obj, _Cq) and obj.fd is not None and len(self._spare_channels) < SPARE_CHANNELS:
                try:
                    obj.real.close()
                except PyverbsError:  # the CQ may live on: so does its channel
                    self._failed_destroys += 1
                    obj.close()
                    continue
                self._spare_channels.append((obj.channel, obj.fd))
            else:
                self._failed_destroys += obj.close() if isinstance(obj, _Cq) else close_quietly(obj)

    def reusable(self) -> bool:
        return self._failed_destroys == 0

    def release_spares(self) -> None:
        spares, self._spare_channels = self._spare_channels, []
        close_quietly(*(channel for channel, _ in spares))  # a descriptor each

    def close(self) -> None:
        self.release_spares()
        for mr in list(self._written_mrs.values()):  # before their PDs, which pyverbs closes with the context
            self._dereg_written(mr)
        close_quietly(self.ctx)


class PyverbsEdge(RnicEdge):
    def device_names(self) -> list[str]:
        return device_names()

    def describe(self, name: str) -> DeviceInfo:
        return describe(name)

    def open(self, name: str) -> PyverbsContext:
        return PyverbsContext(name)

    def open_described(self, name: str) -> tuple[DeviceContext, DeviceInfo]:
        _check_known(name)
        context = PyverbsContext(name)
        try:
            return context, _describe_open(context.ctx, name)
        except BaseException:
            context.close()
            raise

    def open_direct(self, name: str) -> DeviceContext:
        from vrnic.backend.uverbs_edge import DirectContext

        return DirectContext(name, queries=PyverbsContext(name))
