"""What agents tell each other about peers (/agent/v1/peers/..., /agent/v1/cm/...): plain data, both ends.

The asking agent names the vRNIC that asks (its Identity); the owner agent checks reachability itself
(vrnic.core.peering.decide) before it answers with anything physical. Private data travels as hex.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from vrnic.core.peering import Identity
from vrnic.core.rings import Access
from vrnic.core.translate import MrWindow

GID = Field(min_length=2, max_length=64, pattern=r"^[0-9a-fA-F:.]+$")
QPN = Field(ge=0, lt=1 << 24)
HEX = r"^([0-9a-f]{2})*$"
# rdma_cm's limits on an RC connection's private data (IB CM REQ, REP and REJ carry at most this much).
CONNECT_PRIVATE_DATA = 56
ACCEPT_PRIVATE_DATA = 196
REJECT_PRIVATE_DATA = 148
MAX_CM_TIMEOUT_MS = 60_000


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IdentityWire(Wire):
    vrnic_id: str = Field(min_length=1, max_length=128)
    tenant: str = Field(min_length=1, max_length=128)
    vpc_id: int = Field(ge=0, lt=1 << 32)
    virtual_gid: str = GID

    @classmethod
    def of(cls, identity: Identity) -> IdentityWire:
        return cls(vrnic_id=identity.vrnic_id, tenant=identity.tenant, vpc_id=identity.vpc_id,
                   virtual_gid=identity.virtual_gid)

    def identity(self) -> Identity:
        return Identity(self.vrnic_id, self.tenant, self.vpc_id, self.virtual_gid)


class QpQuery(Wire):
    """Which physical QP is behind virtual (GID, QPN), asked on behalf of `asker`."""

    asker: IdentityWire
    virtual_gid: str = GID
    vqpn: int = QPN


class QpAnswer(Wire):
    target: IdentityWire  # whom the GID names (the asker's agent checks reachability on its side too)
    phys_gid: str = GID
    phys_qpn: int = QPN


class MrQuery(Wire):
    asker: IdentityWire
    virtual_gid: str = GID


class MrWindowWire(Wire):
    """A published MR as a remote writer needs it: its virtual key and range, and the physical rkey and base."""

    vkey: int = Field(ge=0, lt=1 << 32)
    offset: int = Field(ge=0, lt=1 << 64)
    length: int = Field(gt=0, lt=1 << 64)
    access: int = Field(ge=0, le=15)
    phys_rkey: int = Field(ge=0, lt=1 << 32)
    base: int = Field(ge=0, lt=1 << 64)

    @classmethod
    def of(cls, window: MrWindow) -> MrWindowWire:
        return cls(vkey=window.vkey, offset=window.offset, length=window.length, access=int(window.access),
                   phys_rkey=window.phys_rkey, base=window.base)

    def window(self) -> MrWindow:
        # phys_lkey is the owner's own business: a remote writer only ever uses the rkey.
        return MrWindow(vkey=self.vkey, offset=self.offset, length=self.length, access=Access(self.access),
                        phys_lkey=0, phys_rkey=self.phys_rkey, base=self.base)


class MrAnswer(Wire):
    windows: list[MrWindowWire]


class ReverseQuery(Wire):
    """Which virtual QPN a physical (GID, QPN) is: a UD receiver names its sender."""

    asker: IdentityWire
    phys_gid: str = GID
    phys_qpn: int = QPN


class ReverseAnswer(Wire):
    vqpn: int = QPN  # 0: unknown or not the asker's business


class CmConnectQuery(Wire):
    """A connection request for the listener on `port` of the vRNIC `virtual_gid`, from asker's QP vqpn."""

    asker: IdentityWire
    virtual_gid: str = GID
    port: int = Field(ge=1, le=65535)
    vqpn: int = QPN
    private_data: str = Field("", max_length=2 * CONNECT_PRIVATE_DATA, pattern=HEX)
    timeout_ms: int = Field(5000, ge=1, le=MAX_CM_TIMEOUT_MS)


class CmConnectAnswer(Wire):
    """The listener accepted: its QP (already connected to the asker's) and its private data."""

    vqpn: int = QPN
    private_data: str = Field("", max_length=2 * ACCEPT_PRIVATE_DATA, pattern=HEX)
