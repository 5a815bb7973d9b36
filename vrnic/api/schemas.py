"""What the REST API accepts and returns (pydantic); the OpenAPI schema is generated from these."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from vrnic.core.lifecycle import VrnicState
from vrnic.core.peering import RuleAction
from vrnic.core.specs import (
    HOST_NAME_PATTERN,
    AttachInfo,
    DataEngine,
    Integer,
    PortInfo,
    QosPolicy,
    Quota,
    VmBinding,
    VrnicMode,
    check_engine,
)
from vrnic.core.vaddr import DEFAULT_VPC_CIDR, vpc_network
from vrnic.errors import InvalidArgument

T = TypeVar("T")

TenantName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", examples=["acme"])]


class Page(BaseModel, Generic[T]):
    """One page of a list; pass next_cursor as `cursor` for the next page (null: this was the last)."""

    items: list[T]
    next_cursor: str | None = None


class Problem(BaseModel):
    """An RFC 9457 problem detail (application/problem+json)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(examples=["urn:vrnic:problem:conflict"])
    title: str
    status: int
    detail: str
    code: str
    instance: str | None = None
    current_state: str | None = None  # conflict: the state the object is in
    errors: list[dict[str, Any]] | None = None  # request validation failures


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: TenantName
    vpc_id: Integer | None = Field(None, ge=1, lt=1 << 32, description="default: the next free VPC id")
    default_quota: Quota = Quota()
    max_vrnics: Integer | None = Field(None, ge=0, le=1 << 20, description="live vRNICs at most (null: no limit)")
    vpc_cidr: str = Field(DEFAULT_VPC_CIDR, max_length=43, pattern=r"^[0-9./]+$", examples=["10.0.0.0/16"],
                          description="the IPv4 range its vRNICs' virtual IPs come from")

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_cidr(cls, value: str) -> str:
        try:
            return str(vpc_network(value))
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from exc


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_quota: Quota | None = None
    max_vrnics: Integer | None = Field(None, ge=0, le=1 << 20)
    unlimited: StrictBool = Field(False, description="true: remove the max_vrnics limit")


class TenantOut(BaseModel):
    name: str
    vpc_id: int
    vpc_cidr: str
    default_quota: Quota
    max_vrnics: int | None
    live_vrnics: int
    created_at: datetime


class TokenOut(BaseModel):
    id: int
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None


class TokenIssued(TokenOut):
    token: str = Field(description="the bearer token; shown only in this response")


class TenantCreated(TenantOut):
    token: str = Field(description="the tenant's first bearer token; shown only in this response")


class VrnicCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: VrnicMode = VrnicMode.PARAVIRTUAL
    tenant: TenantName | None = Field(None, description="operator only: the tenant to allocate for")
    device: str | None = Field(None, max_length=64, description="a physical device; default: the least loaded")
    quota: Quota | None = Field(None, description="default: the tenant's default quota")
    qos: QosPolicy = QosPolicy()
    engine: DataEngine = Field(DataEngine.RING, description="ring (vrnicd moves posts and completions) or direct "
                                                            "(the guest drives the NIC's queues; mode paravirtual "
                                                            "only, and not for VMs)")
    host: str | None = Field(None, max_length=253, pattern=HOST_NAME_PATTERN,
                             description="the host to place it on; default: the least loaded device of the up hosts")
    virtual_ip: str | None = Field(None, max_length=15, pattern=r"^[0-9.]+$", examples=["10.0.0.7"],
                                   description="its address in the tenant's VPC; default: the next free one")

    @model_validator(mode="after")
    def _engine_fits_the_mode(self) -> VrnicCreate:
        check_engine(self.mode, self.engine)
        return self


class VrnicOut(BaseModel):
    id: str
    tenant: str
    mode: VrnicMode
    engine: DataEngine = Field(description="the data-path engine (paravirtual; SR-IOV vRNICs show ring)")
    state: VrnicState
    host: str
    reachable: bool = Field(True, description="false while its host is down (it is kept, never reallocated)")
    device: str
    virtual_gid: str
    virtual_ip: str | None = Field(None, description="its address in the tenant's VPC (rdma_cm-style resolve)")
    quota: Quota
    qos: QosPolicy
    attach: AttachInfo = Field(description="what a guest frontend needs; token only in the allocation response")
    vm_domain: str | None = Field(None, description="the libvirt domain it is attached to (`vrnic vm attach`)")
    created_at: datetime
    updated_at: datetime
    released_at: datetime | None = None


DomainName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$", examples=["vm1"])]


class VmAttach(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domain: DomainName


class VmAdmission(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vrnic_ids: list[str] = Field(min_length=1, max_length=16)


class VmAdmitted(BaseModel):
    domain: str
    vrnic_ids: list[str]


class VmUnbound(BaseModel):
    domain: str
    unbound: list[str]


class VrnicQosChange(BaseModel):
    """PATCH /vrnics/{id}: a live vRNIC's new QoS, applied without disconnecting its QPs."""

    model_config = ConfigDict(extra="forbid")

    qos: QosPolicy


class VrnicCounters(BaseModel):
    """What a vRNIC sent and received, as the kernel's QoS mechanism counted it; zero while its device has no
    QoS on."""

    vrnic_id: str
    shaped: bool  # counted by a QoS mechanism (its device has QoS on)
    tx_bytes: int
    tx_packets: int
    tx_rate_bps: float  # bits per second since the previous reading (0 at the first)
    rx_bytes: int = 0
    rx_packets: int = 0
    rx_rate_bps: float = 0.0


class VmMigrationPrepared(BaseModel):
    domain: str
    phase: str
    moving: list[str]  # vRNICs whose guest program is attached: their state moves
    presetup_mrs: int
    prepare_ms: float


class VmMigrationSwitched(BaseModel):
    """What the switchover did (vrnic.core.migration.SwitchoverReport), times in milliseconds."""

    vrnics: list[str]
    qps: int
    peers_repointed: int
    preconnected: int
    mrs_presetup: int
    mrs_registered: int
    dirty_pages: int
    copied_bytes: int
    recvs_reposted: int
    sends_carried: int
    broken_qps: int
    hold_ms: float
    drain_ms: float
    copy_ms: float
    rebuild_ms: float
    connect_ms: float
    release_ms: float
    total_ms: float


class VmHandoverRequest(BaseModel):
    """Where a bound VM goes: another host, and the VM's binding there (its destination QEMU's RAM and channels)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(max_length=253, pattern=HOST_NAME_PATTERN)
    binding: VmBinding


class VmMigrationAborted(BaseModel):
    domain: str
    aborted: bool


class DeviceOut(BaseModel):
    id: int
    host: str
    name: str
    driver: str
    node_guid: str
    ports: list[PortInfo]
    caps: dict[str, int]
    present: bool
    live_vrnics: int
    max_vrnics: int | None = None
    discovered_at: datetime


class HostOut(BaseModel):
    name: str
    api_url: str | None
    version: str
    state: Literal["up", "down"] = Field(description="down: its agent stopped beating (its vRNICs are unreachable)")
    registered_at: datetime
    last_seen_at: datetime


class SecurityRuleCreate(BaseModel):
    """A rule of a VPC's security group: allow or deny peers of another tenant's VPC ("*": any other)."""

    model_config = ConfigDict(extra="forbid")

    tenant: TenantName | None = Field(None, description="operator only: whose VPC the rule belongs to")
    action: RuleAction
    peer_tenant: Annotated[str, Field(pattern=r"^(\*|[a-z0-9][a-z0-9_-]{0,62})$", examples=["globex", "*"])]


class SecurityRuleOut(BaseModel):
    id: int
    tenant: str
    action: RuleAction
    peer_tenant: str
    created_at: datetime


class EventOut(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    subject: str
    tenant: str | None
    detail: dict[str, Any]


# -- SR-IOV ---------------------------------------------------------------------------------------

class VfSettings(BaseModel):
    """A VF's netlink configuration (rates in Mbit/s, 0 = none)."""

    mac: str
    vlan: int
    qos: int = Field(description="802.1p priority with the VLAN")
    max_tx_rate: int = Field(description="cap, Mbit/s")
    min_tx_rate: int = Field(description="guarantee, Mbit/s")
    spoofchk: bool
    trust: bool
    link_state: Literal["auto", "enable", "disable"]


class VfAllocationOut(BaseModel):
    vrnic_id: str
    tenant: str
    desired: VfSettings = Field(description="what vrnic keeps on the VF (reconcile restores it)")
    in_sync: bool = Field(description="the kernel's settings equal the desired ones")
    netns: str | None = Field(None, description="the container network namespace its netdev is in")
    vanished: bool = Field(False, description="the VF went away in a forced VF count change; release the vRNIC")


class SriovVfOut(BaseModel):
    pf: str
    index: int
    pci_address: str | None = None
    netdev: str | None = None
    rdma_device: str | None = None
    settings: VfSettings | None = Field(description="as the kernel reports them (null: the VF is gone)")
    allocation: VfAllocationOut | None = None


class ContainerAttach(BaseModel):
    model_config = ConfigDict(extra="forbid")

    netns: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", examples=["ctr1"],
                       description="a named network namespace of this host (`ip netns add NAME`)")
    require_rdma: StrictBool = Field(True, description="refuse unless the VF's RDMA device moves along (needs "
                                                       "`rdma system set netns exclusive`); false: Ethernet only "
                                                       "is fine, the reason is in notes")


class ContainerAttached(BaseModel):
    vrnic_id: str
    netns: str
    netdev: str = Field(description="the VF netdev, now inside netns")
    rdma_device: str | None = Field(description="the VF's RDMA device, moved along (null: Ethernet only)")
    notes: list[str] = Field(description="why the RDMA device did not move, when require_rdma was false")


class SriovPfOut(BaseModel):
    name: str
    kind: str = Field(examples=["pci", "netdevsim"])
    bus_id: str
    driver: str
    num_vfs: int
    total_vfs: int | None
    eswitch_mode: str | None = None
    rdma_device: str | None = None
    allocated_vfs: int
    free_vfs: int
    vanished_vrnics: list[str] = Field(description="vRNICs whose VF went away in a forced count change")


class NumVfsChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_vfs: Integer = Field(ge=0, le=4096)
    force: StrictBool = Field(False, description="change it even though VFs are allocated (goes through zero; "
                                           "surviving VFs are re-configured, vanished ones are marked)")


class SriovEventOut(BaseModel):
    kind: str = Field(examples=["vf_drift_corrected"])
    pf: str
    vf: int | None = None
    vrnic_id: str | None = None
    detail: dict[str, str]


class NumVfsChanged(BaseModel):
    pf: str
    previous: int
    num_vfs: int
    steps: list[int] = Field(description="values written to sriov_numvfs, in order")
    events: list[SriovEventOut]


class ReconcileOut(BaseModel):
    events: list[SriovEventOut] = Field(description="the corrections (and failures) of this pass")
