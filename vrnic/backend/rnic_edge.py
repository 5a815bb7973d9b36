"""The RNIC edge: every call vrnicd makes into a verbs device, behind one interface.

`PyverbsEdge` (vrnic.backend.pyverbs_edge) is the real one; `FakeEdge`
(vrnic.backend.fake_edge) is an in-memory NIC for host tests of the session,
the engine and isolation. Work requests and completions cross this edge as
plain data, already in physical terms (addresses, keys, QPNs); objects the
edge creates are opaque to its callers. Implementations raise only VrnicErrors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

from vrnic.core.queue_format.base import PhysWr
from vrnic.core.specs import DeviceInfo
from vrnic.errors import DeviceError, NotSupported

PORT = 1  # a vRNIC has one port


class SendQueueFull(DeviceError):
    """The NIC's send queue has no room: keep the WR and retry after completions."""

    code = "send_queue_full"


@dataclass(frozen=True)
class DeviceLimits:
    max_qp: int
    max_cq: int
    max_mr: int
    max_pd: int
    max_cqe: int
    max_qp_wr: int
    max_sge: int
    atomic_caps: int


@dataclass(frozen=True)
class PortAttrs:
    state: int
    active_mtu: int
    max_mtu: int


@dataclass(slots=True)
class PhysSend(PhysWr):
    """A send-queue WR in physical terms (SGEs are (address in vrnicd, length, physical lkey)), plus what the
    shared-ring engine adds for UD, whose destination vrnicd resolves per WR."""

    ah: Any = None  # UD: an address handle from create_ah
    remote_qpn: int = 0
    qkey: int = 0


@dataclass(slots=True)
class PhysRecv:
    wr_id: int
    sges: list[tuple[int, int, int]]


@dataclass(slots=True)
class PhysCompletion:
    wr_id: int
    status: int
    opcode: int
    byte_len: int = 0
    imm_data: int = 0
    qp_num: int = 0  # physical QPN of the QP the WR belonged to
    src_qp: int = 0  # UD: the sender's physical QPN
    wc_flags: int = 0
    vendor_err: int = 0


class RtrParams(NamedTuple):
    """What an RC QP needs to reach its peer, all physical: vrnicd resolved the guest's virtual names. (Named
    tuples, not frozen dataclasses: one of each per connect, and a frozen dataclass costs twice as much to make.)"""

    dgid: str
    sgid_index: int
    path_mtu: int  # bytes
    dest_qpn: int
    rq_psn: int = 0
    max_dest_rd_atomic: int = 1
    min_rnr_timer: int = 12


class RtsParams(NamedTuple):
    sq_psn: int = 0
    timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 7
    max_rd_atomic: int = 1


@dataclass(frozen=True)
class QpCaps:
    max_send_wr: int
    max_recv_wr: int
    max_sge: int


class DeviceContext(ABC):
    """One open device context: a vRNIC session owns exactly one."""

    @abstractmethod
    def query_device(self) -> DeviceLimits: ...

    @abstractmethod
    def query_port(self, port: int) -> PortAttrs: ...

    @abstractmethod
    def alloc_pd(self) -> Any: ...

    @abstractmethod
    def reg_mr(self, pd: Any, address: int, length: int, access: int) -> tuple[Any, int, int]:
        """Register [address, +length) of vrnicd's own memory: (mr, physical lkey, physical rkey)."""

    @abstractmethod
    def create_cq(self, cqe: int) -> Any:
        """A CQ with its own completion channel."""

    @abstractmethod
    def cq_event_fd(self, cq: Any) -> int | None:
        """The fd that turns readable when an armed CQ completes; None: poll it instead."""

    @abstractmethod
    def create_qp(self, pd: Any, send_cq: Any, recv_cq: Any, qp_type: str, caps: QpCaps) -> tuple[Any, int]:
        """(qp, physical QPN)."""

    @abstractmethod
    def qp_to_init(self, qp: Any, qp_type: str, access: int, qkey: int) -> None: ...

    @abstractmethod
    def qp_to_rtr(self, qp: Any, qp_type: str, params: RtrParams | None) -> None:
        """params is None for UD, whose destinations come per WR."""

    @abstractmethod
    def qp_to_rts(self, qp: Any, qp_type: str, params: RtsParams) -> None: ...

    @abstractmethod
    def qp_to_state(self, qp: Any, state: str) -> None:
        """"err" or "reset"."""

    @abstractmethod
    def query_qp_state(self, qp: Any) -> str:
        """"reset", "init", "rtr", "rts", "sqd", "sqe" or "err"."""

    @abstractmethod
    def query_rc_timeout(self, qp: Any) -> int:
        """The RC QP's timeout as the NIC holds it (the exponent: 4.096 us * 2^timeout; 0: none)."""

    @abstractmethod
    def create_ah(self, pd: Any, dgid: str, sgid_index: int) -> Any: ...

    @abstractmethod
    def post_send(self, qp: Any, wr: PhysSend) -> None:
        """SendQueueFull when the NIC has no room, DeviceError for anything else."""

    @abstractmethod
    def post_recv(self, qp: Any, wr: PhysRecv) -> None: ...

    @abstractmethod
    def poll_cq(self, cq: Any, max_entries: int) -> list[PhysCompletion]: ...

    @abstractmethod
    def arm_cq(self, cq: Any) -> None:
        """Ask for one event on the next completion."""

    @abstractmethod
    def ack_cq_event(self, cq: Any) -> None:
        """Consume the event that made cq_event_fd readable (quietly if there is none)."""

    @abstractmethod
    def destroy(self, *objects: Any) -> None:
        """Destroy in the order given, continuing past failures so nothing else leaks."""

    @abstractmethod
    def close(self) -> None:
        """Close the context (after every object in it was destroyed)."""

    def release_spares(self) -> None:
        """Let go of what it keeps for its guest's next objects (a context waiting for a guest holds only itself)."""
        return None  # most contexts keep nothing of the kind

    def reusable(self) -> bool:
        """May another guest of the same vRNIC take it over: every object in it destroyed, and no descriptor of
        it ever handed to a guest (vrnic.backend.idle_contexts)."""
        return False


class RnicEdge(ABC):
    """The devices of one host."""

    @abstractmethod
    def device_names(self) -> list[str]: ...

    @abstractmethod
    def describe(self, name: str) -> DeviceInfo:
        """NotFound for an unknown device."""

    @abstractmethod
    def open(self, name: str) -> DeviceContext: ...

    def open_described(self, name: str) -> tuple[DeviceContext, DeviceInfo]:
        """A context and the device's description, read through that context where the edge can: one device open
        where describe() and open() make two (a new vRNIC keeps the context for its first guest). NotFound for an
        unknown device."""
        info = self.describe(name)
        return self.open(name), info

    def open_direct(self, name: str) -> DeviceContext:
        """A context for the direct engine: objects whose queues the guest maps (see vrnic.backend.direct)."""
        raise NotSupported(f"{type(self).__name__} has no direct data path")
