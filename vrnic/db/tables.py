"""The control plane's state: SQLAlchemy 2 typed tables (SQLite by default, PostgreSQL supported).

Schema changes go through Alembic (migrations/); a test fails when these tables and the
migrations drift apart.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    false,
    literal_column,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeDecorator

from vrnic.core.vaddr import DEFAULT_VPC_CIDR

# Named constraints, so migrations can drop and alter them on every backend (SQLite batch mode too).
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY, so 64-bit keys are INTEGER there.
Id = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Timestamps always come back aware, in UTC (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.astimezone(UTC) if value is not None and value.tzinfo is not None else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, datetime: UtcDateTime()}


class Host(Base):
    """A host running `vrnic daemon`; it registers itself at startup."""

    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    api_url: Mapped[str | None] = mapped_column(String(512))
    version: Mapped[str] = mapped_column(String(64))
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    # 'up' | 'down': an agent that stops beating is marked down by the others' sweep (never reallocated)
    state: Mapped[str] = mapped_column(String(8), default="up", server_default="up")

    devices: Mapped[list[Device]] = relationship(back_populates="host")


class Device(Base):
    """A physical RNIC a driver discovered on a host, with its ports and capabilities."""

    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("host_id", "driver", "name"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    driver: Mapped[str] = mapped_column(String(32))
    node_guid: Mapped[str] = mapped_column(String(64))
    ports: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    caps: Mapped[dict[str, Any]] = mapped_column(default=dict)
    present: Mapped[bool] = mapped_column(Boolean, default=True)  # false: gone at the last discovery
    max_vrnics: Mapped[int | None] = mapped_column(Integer)  # live vRNICs placed here at most (None: no limit)
    discovered_at: Mapped[datetime] = mapped_column(default=utcnow)

    host: Mapped[Host] = relationship(back_populates="devices")


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    vpc_id: Mapped[int] = mapped_column(BigInteger, unique=True)  # the VPC part of its virtual GIDs
    default_quota: Mapped[dict[str, Any]] = mapped_column(default=dict)  # a vrnic.core.specs.Quota
    max_vrnics: Mapped[int | None] = mapped_column(Integer)  # None: no limit
    vpc_cidr: Mapped[str] = mapped_column(String(43), default=DEFAULT_VPC_CIDR, server_default=DEFAULT_VPC_CIDR)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """A tenant's bearer token, stored as its SHA-256 (tokens are 32 random bytes, so no slow hash)."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the first characters, to tell tokens apart
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()

    tenant: Mapped[Tenant] = relationship()


# A live vRNIC's row (not released), as the partial index below says it. Queries compare with the literal, never
# a bound 'released': SQLite prepares a statement again at every execution when a bound value in its WHERE could
# decide whether a partial index applies, which cost 12 us of a 15 us query (issue 14).
_RELEASED_SQL = "'released'"  # VrnicState.RELEASED as a SQL literal
LIVE_VRNIC = f"state != {_RELEASED_SQL}"


def vrnic_is_live(state: Any) -> ColumnElement[bool]:
    """state (a vrnics.state column, Core or ORM) is not 'released', with the value inline (see LIVE_VRNIC)."""
    return cast(ColumnElement[bool], state != literal_column(_RELEASED_SQL))


class Vrnic(Base):
    __tablename__ = "vrnics"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_vrnics_tenant_id_serial", "tenant_id", "serial"),
        Index("ix_vrnics_device_id_state", "device_id", "state"),  # placement counts a device's live vRNICs
        # A virtual IP names one live vRNIC in its tenant's VPC; a released one gives it back.
        Index("uq_vrnics_live_virtual_ip", "tenant_id", "virtual_ip", unique=True,
              sqlite_where=text(LIVE_VRNIC), postgresql_where=text(LIVE_VRNIC)),
        {"sqlite_autoincrement": True},  # serials (and so virtual GIDs) are never reused
    )

    serial: Mapped[int] = mapped_column(Id, primary_key=True)  # feeds the virtual GID
    public_id: Mapped[str] = mapped_column(String(40), unique=True)  # "vr-<hex>", what the API shows
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    mode: Mapped[str] = mapped_column(String(16))  # vrnic.core.specs.VrnicMode
    engine: Mapped[str] = mapped_column(String(16), default="ring", server_default="ring")  # specs.DataEngine
    state: Mapped[str] = mapped_column(String(16), index=True)  # vrnic.core.lifecycle.VrnicState
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="RESTRICT"), index=True)
    device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id", ondelete="SET NULL"))
    device_name: Mapped[str] = mapped_column(String(64))
    quota: Mapped[dict[str, Any]] = mapped_column()
    qos: Mapped[dict[str, Any]] = mapped_column()  # QosPolicy; enforced by the backend (README "QoS")
    virtual_gid: Mapped[str] = mapped_column(String(45), unique=True)
    virtual_ip: Mapped[str | None] = mapped_column(String(45))  # in its tenant's vpc_cidr
    socket_path: Mapped[str | None] = mapped_column(String(255))
    attach_extra: Mapped[dict[str, Any]] = mapped_column(default=dict)  # AttachInfo.extra; the token is never kept
    # sha256 of the attach token (vrnic.core.recovery.token_digest): a restarted vrnicd accepts the same token
    attach_token_hash: Mapped[str | None] = mapped_column(String(64))
    vm_domain: Mapped[str | None] = mapped_column(String(64))  # the libvirt domain it is attached to (`vm attach`)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))  # the request the idempotency key first carried
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    released_at: Mapped[datetime | None] = mapped_column()

    tenant: Mapped[Tenant] = relationship()
    host: Mapped[Host] = relationship()
    device: Mapped[Device | None] = relationship()


class SriovVf(Base):
    """Desired state of an SR-IOV virtual function held by a vRNIC (vrnic.db.vf_store writes these; free VFs
    are discovered live, not stored). Reconcile compares these rows with what netlink reports."""

    __tablename__ = "sriov_vfs"
    __table_args__ = (
        # One live holder per VF; a vanished allocation keeps its old index until released, so it is exempt.
        Index("uq_sriov_vfs_held_vf", "host_id", "pf", "vf_index", unique=True,
              sqlite_where=text("NOT vanished"), postgresql_where=text("NOT vanished")),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    pf: Mapped[str] = mapped_column(String(64))  # PF netdev name
    vf_index: Mapped[int] = mapped_column(Integer)
    pci_address: Mapped[str | None] = mapped_column(String(32))
    mac: Mapped[str | None] = mapped_column(String(17))
    vlan: Mapped[int | None] = mapped_column(Integer)
    qos: Mapped[int | None] = mapped_column(Integer)  # 802.1p priority with the VLAN
    min_tx_rate_mbps: Mapped[int | None] = mapped_column(Integer)
    max_tx_rate_mbps: Mapped[int | None] = mapped_column(Integer)
    trust: Mapped[bool | None] = mapped_column(Boolean)
    spoofchk: Mapped[bool | None] = mapped_column(Boolean)
    link_state: Mapped[str | None] = mapped_column(String(16))  # auto | enable | disable
    vrnic_serial: Mapped[int | None] = mapped_column(ForeignKey("vrnics.serial", ondelete="SET NULL"),
                                                     unique=True)
    netns: Mapped[str | None] = mapped_column(String(255))  # the container netns its netdev was moved into
    vanished: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # gone in a VF count change
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class SecurityRule(Base):
    """A rule of a tenant's VPC security group about peers of another tenant's VPC (vrnic.core.peering)."""

    __tablename__ = "security_rules"
    __table_args__ = (UniqueConstraint("tenant_id", "action", "peer_tenant"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)  # the owner
    action: Mapped[str] = mapped_column(String(8))  # allow | deny
    peer_tenant: Mapped[str] = mapped_column(String(64))  # a tenant name, or "*"
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    tenant: Mapped[Tenant] = relationship()


class Event(Base):
    """The audit log: who did what to which object, and when."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(80))  # "operator", "tenant:<name>", "daemon"
    action: Mapped[str] = mapped_column(String(40))  # "vrnic.allocate", "tenant.create", ...
    subject: Mapped[str] = mapped_column(String(80))  # "vrnic/vr-...", "tenant/acme", "host/..."
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="SET NULL"), index=True)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
