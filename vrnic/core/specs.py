"""Plain data that crosses the service boundary between the control plane and vrnicd."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from vrnic.core.vaddr import ipv4_mapped
from vrnic.errors import DeviceError, NotFound

MiB = 1 << 20
# How a host names itself to the control plane: an RFC 1123 host name (underscores allowed, as gethostname()
# may return them). It excludes '%', '/', '?' and '#', so a name is the same string in a URL path as in JSON.
HOST_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$"


def _not_a_bool(value: object) -> object:
    # JSON true/false are not numbers: without this, pydantic's lax mode reads them as 1 and 0.
    if isinstance(value, bool):
        raise ValueError("expected an integer, not a boolean")
    return value


Integer = Annotated[int, BeforeValidator(_not_a_bool)]  # an int of a request: a JSON boolean is refused


class VrnicMode(StrEnum):
    PARAVIRTUAL = "paravirtual"  # control verbs mediated by vrnicd, data zero-copy
    SRIOV = "sriov"  # a whole VF, hardware-isolated


class DataEngine(StrEnum):
    """How a paravirtual vRNIC's posts and completions move (the control path is mediated either way)."""

    RING = "ring"  # vrnicd's engine thread moves WRs between rings shared with the guest and the NIC
    DIRECT = "direct"  # the guest drives the NIC's own queues and doorbell; vrnicd does nothing per post


class Quota(BaseModel):
    """Per-vRNIC limits vrnicd enforces on the control path."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_pds: Integer = Field(16, ge=0, le=1 << 16)
    max_cqs: Integer = Field(64, ge=0, le=1 << 16)
    max_qps: Integer = Field(64, ge=0, le=1 << 16)
    max_mrs: Integer = Field(256, ge=0, le=1 << 20)
    max_cqe: Integer = Field(4096, ge=1, le=1 << 22)  # per CQ
    max_wr: Integer = Field(1024, ge=1, le=1 << 16)  # per queue
    max_pinned_bytes: Integer = Field(256 * MiB, ge=0, le=1 << 44)


class QosPolicy(BaseModel):
    """Rate cap and guarantee in Mbit/s (None: no cap, no guarantee), and the weight of the vRNIC's fair share of
    what no guarantee holds (vrnic.core.qos)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate_cap_mbps: Integer | None = Field(None, ge=1, le=10_000_000)
    guarantee_mbps: Integer | None = Field(None, ge=1, le=10_000_000)
    weight: Integer = Field(1, ge=1, le=1000)

    @property
    def limits(self) -> bool:
        """Does it ask for anything a mechanism must enforce (a cap, a guarantee, a weight other than 1)?"""
        return self.rate_cap_mbps is not None or self.guarantee_mbps is not None or self.weight != 1

    @model_validator(mode="after")
    def _guarantee_below_cap(self) -> QosPolicy:
        if self.rate_cap_mbps is not None and self.guarantee_mbps is not None \
                and self.guarantee_mbps > self.rate_cap_mbps:
            raise ValueError(f"guarantee {self.guarantee_mbps} Mbit/s exceeds the cap {self.rate_cap_mbps} Mbit/s")
        return self


class GidEntry(BaseModel):
    index: int
    gid: str
    type: str  # "RoCE v2", "RoCE v1", "IB"


class PortInfo(BaseModel):
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    mtu: int
    gids: list[GidEntry] = []


class DeviceInfo(BaseModel):
    """A physical RNIC (or, for the fake driver, a pretend one) as its driver discovered it."""

    name: str
    driver: str  # the RnicDriver that owns it: "verbs", "sriov", "fake"
    node_guid: str
    ports: list[PortInfo] = []
    caps: dict[str, int] = {}  # max_qp, max_cq, max_mr, max_cqe, max_qp_wr, max_pd, ...


class VrnicSpec(BaseModel):
    """What the control plane asks vrnicd to create."""

    model_config = ConfigDict(frozen=True)

    id: str
    tenant: str
    mode: VrnicMode = VrnicMode.PARAVIRTUAL
    device: str | None = None  # None: the backend picks
    quota: Quota = Quota()
    qos: QosPolicy = QosPolicy()
    vpc_id: int = 0
    virtual_gid: str  # the identity peers name; physical GIDs never reach guests
    engine: DataEngine = DataEngine.RING
    virtual_ip: str | None = None  # its address in the VPC (rdma_cm-style resolve and connect), if it has one

    @model_validator(mode="after")
    def _direct_is_paravirtual(self) -> VrnicSpec:
        check_engine(self.mode, self.engine)
        return self


def check_engine(mode: VrnicMode, engine: DataEngine) -> None:
    """The one rule for which mode an engine serves (VrnicSpec and the REST request both apply it)."""
    if engine is DataEngine.DIRECT and mode is not VrnicMode.PARAVIRTUAL:
        raise ValueError("the direct engine is for paravirtual vRNICs (an SR-IOV VF is direct already)")


class AttachInfo(BaseModel):
    """What a guest frontend needs to attach to its vRNIC."""

    vrnic_id: str
    mode: VrnicMode
    device: str  # physical device (operator information; guests do not use it)
    virtual_gid: str
    socket_path: str | None = None  # paravirtual: vrnicd's frontend socket
    token: str | None = None  # paravirtual: one-time attach secret
    extra: dict[str, str] = {}  # mode-specific (sriov: vf index, pci address, mac...)


class VmVrnic(BaseModel):
    """One paravirtual vRNIC of a VM and the host end of its virtio-serial channel (QEMU listens there)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vrnic_id: str = Field(min_length=1, max_length=128)
    channel_socket: str = Field(pattern=r"^/", max_length=1024)


class VmBinding(BaseModel):
    """What vrnicd needs to serve a running VM: its RAM file, its machine type (the GPA layout) and,
    per vRNIC, the channel socket. The libvirt hook sends it at `started` (and `reconnect`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: str = Field(min_length=1, max_length=64)
    uuid: str | None = None
    machine: str = "q35"
    ram_path: str = Field(pattern=r"^/", max_length=1024)
    vrnics: list[VmVrnic] = Field(min_length=1, max_length=16)


def roce_v2_ipv4_gid(info: DeviceInfo, port: int = 1) -> tuple[int, str]:
    """(index, GID) of the port's RoCE v2 IPv4-mapped GID: the one routable between hosts."""
    for entry in next((p.gids for p in info.ports if p.port == port), []):
        if entry.type == "RoCE v2" and ipv4_mapped(entry.gid) is not None:
            return entry.index, entry.gid
    raise NotFound(f"{info.name} port {port} has no RoCE v2 IPv4 GID (is an address set on its netdev?)")


def active_roce_v2_gid(info: DeviceInfo, port: int = 1) -> tuple[int, str]:
    """What makes a device usable for paravirtual vRNICs: an ACTIVE port with a routable GID."""
    if not any(p.port == port and p.state == "ACTIVE" for p in info.ports):
        raise DeviceError(f"{info.name} port {port} is not ACTIVE")
    return roce_v2_ipv4_gid(info, port)
