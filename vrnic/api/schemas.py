"""What the REST API accepts and returns (pydantic); the OpenAPI schema is generated from these."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from vrnic.core.lifecycle import VrnicState
from vrnic.core.model import AttachInfo, PortInfo, QosPolicy, Quota, VrnicMode

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
    vpc_id: int | None = Field(None, ge=1, lt=1 << 32, description="default: the next free VPC id")
    default_quota: Quota = Quota()
    max_vrnics: int | None = Field(None, ge=0, le=1 << 20, description="live vRNICs at most (null: no limit)")


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_quota: Quota | None = None
    max_vrnics: int | None = Field(None, ge=0, le=1 << 20)
    unlimited: bool = Field(False, description="true: remove the max_vrnics limit")


class TenantOut(BaseModel):
    name: str
    vpc_id: int
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


class VrnicOut(BaseModel):
    id: str
    tenant: str
    mode: VrnicMode
    state: VrnicState
    host: str
    device: str
    virtual_gid: str
    quota: Quota
    qos: QosPolicy
    attach: AttachInfo = Field(description="what a guest frontend needs; token only in the allocation response")
    created_at: datetime
    updated_at: datetime
    released_at: datetime | None = None


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
    discovered_at: datetime


class HostOut(BaseModel):
    name: str
    api_url: str | None
    version: str
    registered_at: datetime
    last_seen_at: datetime


class EventOut(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    subject: str
    tenant: str | None
    detail: dict[str, Any]
