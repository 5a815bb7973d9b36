"""Argument schemas of the frontend protocol's operations (validated before any verb runs)."""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vrnic.core.framing import MAX_BATCH
from vrnic.core.peer_wire import ACCEPT_PRIVATE_DATA, CONNECT_PRIVATE_DATA, HEX, MAX_CM_TIMEOUT_MS
from vrnic.core.rings import MAX_SGE

U32 = 1 << 32
Handle = int


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Attach(Args):
    token: str = Field(max_length=256)
    busy_poll: bool = False


class VmAttach(Args):
    """Attach over a VM's channel: vrnicd bound that channel to the vRNIC, so no token crosses it."""

    busy_poll: bool = False


class NoArgs(Args):
    pass


class QueryPort(Args):
    port: int = Field(1, ge=1, le=255)


class QueryGid(Args):
    port: int = Field(1, ge=1, le=255)
    index: int = Field(0, ge=0, le=255)


class PdRef(Args):
    pd: Handle


class RegMr(Args):
    pd: Handle
    addr: int = Field(ge=0)  # offset in the guest arena
    length: int = Field(gt=0)
    access: int = Field(ge=0, le=15)  # LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC


class MrRef(Args):
    mr: Handle


class CreateCq(Args):
    cqe: int = Field(ge=1)
    ring: int | None = Field(None, ge=0)  # arena offset of the completion ring (cqe slots); direct engine: none


class CqRef(Args):
    cq: Handle


class QpShape(Args):
    """What a QP is made of: its PD, CQs, type and sizes."""

    pd: Handle
    send_cq: Handle
    recv_cq: Handle
    qp_type: Literal["rc", "ud"] = "rc"
    max_send_wr: int = Field(ge=1)
    max_recv_wr: int = Field(ge=1)
    max_sge: int = Field(1, ge=1, le=MAX_SGE)


class CreateQp(QpShape):
    sq_ring: int | None = Field(None, ge=0)  # the shared-ring engine's rings; the direct engine has the NIC's
    rq_ring: int | None = Field(None, ge=0)


class QpRef(Args):
    qp: Handle


class ModifyQp(Args):
    """A state transition. The guest never gives physical addressing: for RTR it names the peer
    by virtual GID and virtual QPN, and vrnicd programs the physical path itself."""

    qp: Handle
    state: Literal["init", "rtr", "rts", "err", "reset"]
    access: int = Field(7, ge=0, le=15)
    qkey: int = Field(0x11111111, ge=0, lt=U32)
    remote_gid: str | None = Field(None, max_length=64)
    remote_qpn: int | None = Field(None, ge=0, lt=1 << 24)
    path_mtu: Literal[256, 512, 1024, 2048, 4096] = 1024
    rq_psn: int = Field(0, ge=0, lt=1 << 24)
    sq_psn: int = Field(0, ge=0, lt=1 << 24)
    max_dest_rd_atomic: int = Field(4, ge=0, le=16)
    max_rd_atomic: int = Field(4, ge=0, le=16)
    min_rnr_timer: int = Field(12, ge=0, le=31)
    timeout: int = Field(14, ge=0, le=31)
    retry_cnt: int = Field(7, ge=0, le=7)
    rnr_retry: int = Field(7, ge=0, le=7)


class Connect(Args):
    qp: Handle
    remote_gid: str = Field(max_length=64)
    remote_qpn: int = Field(ge=0, lt=1 << 24)
    access: int = Field(15, ge=0, le=15)




class CreateQps(Args):
    """create_qp for several QPs in one request: all are created, or none (the first failure is raised).

    Either qps, one create_qp per QP, or count QPs of one shape; on the shared-ring engine rings then holds each
    QP's send and receive ring in turn (2 * count addresses). One shape is checked once and crosses the wire
    once: for 64 QPs, 0.8 ms of encoding, decoding and checking in the lab against 4.1 for 64 items."""

    qps: list[CreateQp] | None = Field(None, min_length=1, max_length=MAX_BATCH)
    shape: QpShape | None = None
    count: int | None = Field(None, ge=1, le=MAX_BATCH)
    rings: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=2, max_length=2 * MAX_BATCH)

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        if self.qps is not None:
            if self.shape is not None or self.count is not None or self.rings is not None:
                raise ValueError("name qps, or a shape with its count (and rings), not both")
        elif self.shape is None or self.count is None:
            raise ValueError("name qps, or a shape with its count (and rings)")
        elif self.rings is not None and len(self.rings) != 2 * self.count:
            raise ValueError(f"rings holds a send and a receive ring per QP: {2 * self.count} addresses for "
                             f"{self.count} QPs, not {len(self.rings)}")
        return self


class Connection(NamedTuple):
    """One connect of a connect_qps, whichever form named it."""

    qp: Handle
    remote_gid: str
    remote_qpn: int
    access: int


class ConnectQps(Args):
    """connect for several QPs in one request: all are connected, or none (those done go back to RESET).

    Either connections, one connect per QP, or qps with the peer QPN of each in remote_qpns, all towards one
    remote_gid with one access (a pair of hosts' worth of connections, as MPI sets them up)."""

    connections: list[Connect] | None = Field(None, min_length=1, max_length=MAX_BATCH)
    remote_gid: str | None = Field(None, max_length=64)
    access: int = Field(15, ge=0, le=15)
    qps: list[Handle] | None = Field(None, min_length=1, max_length=MAX_BATCH)
    remote_qpns: list[Annotated[int, Field(ge=0, lt=1 << 24)]] | None = Field(None, min_length=1,
                                                                               max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        one_peer = (self.remote_gid, self.qps, self.remote_qpns)
        if self.connections is not None:
            if any(x is not None for x in one_peer) or "access" in self.model_fields_set:
                raise ValueError("name connections, or qps and remote_qpns towards one remote_gid, not both")
        elif any(x is None for x in one_peer):
            raise ValueError("name connections, or qps and remote_qpns towards one remote_gid")
        elif len(self.qps or ()) != len(self.remote_qpns or ()):
            raise ValueError(f"remote_qpns names one peer QP per QP: {len(self.qps or ())} QPs, "
                             f"{len(self.remote_qpns or ())} peer QPNs")
        return self

    def each(self) -> list[Connection]:
        if self.connections is not None:
            return [Connection(c.qp, c.remote_gid, c.remote_qpn, c.access) for c in self.connections]
        gid, access = self.remote_gid or "", self.access
        return [Connection(qp, gid, qpn, access) for qp, qpn in zip(self.qps or (), self.remote_qpns or (),
                                                                      strict=True)]


class AllocPds(Args):
    """Up to count PDs, as many as the quota leaves room for (at least one): the frontend's pool of PDs, so
    that its later alloc_pd is a handout without a round trip. Pooled PDs are ordinary PDs of the session:
    they count against the quota and go with the session."""

    count: int = Field(ge=1, le=MAX_BATCH)


class RegMrs(Args):
    """An MR of the same PD, length and access at each arena offset in addrs, as many as the quota leaves room
    for (at least one): the frontend's pool of MRs of that shape (pre-setup), so that its later MR of that
    shape is a handout. Pooled MRs are ordinary MRs of the session: they count against the quota (MRs and pinned
    bytes) and go with the session."""

    pd: Handle
    addrs: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BATCH)
    length: int = Field(gt=0)
    access: int = Field(ge=0, le=15)


class DeregMrs(Args):
    """dereg_mr of each MR in one request: the frontend giving back its pools' spare MRs, or a guest closing many
    MRs at once. Every handle is checked before any MR goes."""

    mrs: list[Handle] = Field(min_length=1, max_length=MAX_BATCH)


class DestroyQps(Args):
    """destroy_qp of each QP in one request: the frontend giving back its pools' spare QPs, or a guest closing
    many QPs at once. Every handle is checked before any QP goes."""

    qps: list[Handle] = Field(min_length=1, max_length=MAX_BATCH)


class CreateCqs(Args):
    """Up to len(rings) CQs of cqe entries, one per ring, as many as the quota leaves room for (at least one):
    the frontend's pool of CQs of that size (pre-setup), so that its later create_cq of that size is a handout.
    Pooled CQs are ordinary CQs of the session: they count against the quota and go with the session."""

    cqe: int = Field(ge=1)
    rings: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BATCH)


class ResolveRkey(Args):
    """Direct engine: the physical rkey (and address base) behind a virtual rkey of qp's connected peer."""

    qp: Handle
    rkey: int = Field(ge=0, lt=U32)


class BusyPoll(Args):
    enabled: bool


class ResolveIp(Args):
    """rdma_resolve_addr's job: the virtual GID of the vRNIC with this virtual IP in the caller's VPC."""

    ip: str = Field(max_length=64)


class CmPort(Args):
    port: int = Field(ge=1, le=65535)


MAX_CM_WAIT_MS = 5000  # one get_request call waits at most this long (the frontend calls again)


class CmGetRequest(Args):
    port: int = Field(ge=1, le=65535)
    timeout_ms: int = Field(1000, ge=0, le=MAX_CM_WAIT_MS)


class CmAccept(Args):
    """Connect qp (RC, not connected yet) to the requesting QP, and answer with private data."""

    request: int = Field(ge=0, lt=1 << 63)
    qp: Handle
    private_data: str = Field("", max_length=2 * ACCEPT_PRIVATE_DATA, pattern=HEX)  # hex
    access: int = Field(15, ge=0, le=15)  # for a QP in RESET; one in INIT keeps its own


class CmReject(Args):
    request: int = Field(ge=0, lt=1 << 63)


class CmConnect(Args):
    """Connect qp (RC, not connected yet) to whatever listens on (virtual IP, port); waits for the answer."""

    qp: Handle
    ip: str = Field(max_length=64)
    port: int = Field(ge=1, le=65535)
    private_data: str = Field("", max_length=2 * CONNECT_PRIVATE_DATA, pattern=HEX)  # hex
    timeout_ms: int = Field(5000, ge=1, le=MAX_CM_TIMEOUT_MS)
    access: int = Field(15, ge=0, le=15)  # for a QP in RESET; one in INIT keeps its own


OPS: dict[str, type[Args]] = {
    "query_device": NoArgs, "query_port": QueryPort, "query_gid": QueryGid,
    "alloc_pd": NoArgs, "dealloc_pd": PdRef,
    "reg_mr": RegMr, "dereg_mr": MrRef,
    "create_cq": CreateCq, "destroy_cq": CqRef,
    "create_qp": CreateQp, "destroy_qp": QpRef, "modify_qp": ModifyQp, "query_qp": QpRef,
    "connect": Connect, "resolve_rkey": ResolveRkey, "translations": NoArgs,
    "create_qps": CreateQps, "connect_qps": ConnectQps, "alloc_pds": AllocPds, "create_cqs": CreateCqs,
    "reg_mrs": RegMrs, "dereg_mrs": DeregMrs, "destroy_qps": DestroyQps,
    "null_rpc": NoArgs,
    "busy_poll": BusyPoll, "sync": NoArgs, "detach": NoArgs,
    "resolve_ip": ResolveIp, "cm_listen": CmPort, "cm_unlisten": CmPort, "cm_get_request": CmGetRequest,
    "cm_accept": CmAccept, "cm_reject": CmReject, "cm_connect": CmConnect,
}
# Ops that may wait (on another guest, or another host): they take the session lock only for what they touch.
UNLOCKED_OPS = frozenset({"resolve_ip", "cm_listen", "cm_unlisten", "cm_get_request", "cm_accept", "cm_reject",
                          "cm_connect"})
