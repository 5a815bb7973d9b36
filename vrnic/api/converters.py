"""ORM rows and SR-IOV records -> API schemas. Pure: the callers read whatever a conversion needs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, cast

from vrnic.api.schemas import (
    DeviceOut,
    EventOut,
    HostOut,
    SecurityRuleOut,
    SriovEventOut,
    SriovPfOut,
    SriovVfOut,
    TenantOut,
    TokenOut,
    VfAllocationOut,
    VfSettings,
    VrnicOut,
)
from vrnic.core.lifecycle import VrnicState
from vrnic.core.peering import RuleAction
from vrnic.core.specs import AttachInfo, DataEngine, PortInfo, QosPolicy, Quota, VrnicMode
from vrnic.db.tables import ApiToken, Device, Event, Host, SecurityRule, Tenant, Vrnic
from vrnic.sriov.manager import PfInventory
from vrnic.sriov.vf_types import Allocation, VfConfig, VfEvent, VfInfo


def tenant_out(tenant: Tenant, live_vrnics: int) -> TenantOut:
    return TenantOut(name=tenant.name, vpc_id=tenant.vpc_id, vpc_cidr=tenant.vpc_cidr,
                     default_quota=Quota.model_validate(tenant.default_quota),
                     max_vrnics=tenant.max_vrnics, live_vrnics=live_vrnics, created_at=tenant.created_at)


def token_out(token: ApiToken) -> TokenOut:
    return TokenOut(id=token.id, prefix=token.prefix, created_at=token.created_at, revoked_at=token.revoked_at)


@dataclass(frozen=True, slots=True)
class VrnicRecord:
    """The columns vrnic_out reads, for a row just written with Core (no ORM instance to read them from)."""

    public_id: str
    mode: str
    engine: str
    state: str
    device_name: str
    virtual_gid: str
    virtual_ip: str | None
    quota: dict[str, Any]
    qos: dict[str, Any]
    socket_path: str | None
    attach_extra: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    released_at: datetime | None
    vm_domain: str | None = None


def vrnic_out(row: Vrnic | VrnicRecord, *, tenant: str, host: str, state: VrnicState | None = None,
              reachable: bool = True, attach_token: str | None = None) -> VrnicOut:
    """state: the observed state when it differs from the stored one (not persisted yet); reachable: its host
    is up; attach_token: only for the response that issues it (the database keeps its digest)."""
    mode = VrnicMode(row.mode)
    return VrnicOut(
        id=row.public_id, tenant=tenant, mode=mode, engine=DataEngine(row.engine),
        state=state or VrnicState(row.state), host=host, reachable=reachable, device=row.device_name,
        virtual_gid=row.virtual_gid, virtual_ip=row.virtual_ip,
        quota=Quota.model_validate(row.quota), qos=QosPolicy.model_validate(row.qos),
        attach=AttachInfo(vrnic_id=row.public_id, mode=mode, device=row.device_name, virtual_gid=row.virtual_gid,
                          socket_path=row.socket_path, token=attach_token, extra=row.attach_extra),
        vm_domain=row.vm_domain, created_at=row.created_at, updated_at=row.updated_at, released_at=row.released_at)


def device_out(device: Device, *, host: str, live_vrnics: int) -> DeviceOut:
    return DeviceOut(id=device.id, host=host, name=device.name, driver=device.driver, node_guid=device.node_guid,
                     ports=[PortInfo.model_validate(p) for p in device.ports], caps=device.caps,
                     present=device.present, live_vrnics=live_vrnics, max_vrnics=device.max_vrnics,
                     discovered_at=device.discovered_at)


def host_out(host: Host) -> HostOut:
    return HostOut(name=host.name, api_url=host.api_url, version=host.version,
                   state="down" if host.state == "down" else "up", registered_at=host.registered_at,
                   last_seen_at=host.last_seen_at)


def security_rule_out(rule: SecurityRule, *, tenant: str) -> SecurityRuleOut:
    return SecurityRuleOut(id=rule.id, tenant=tenant, action=RuleAction(rule.action), peer_tenant=rule.peer_tenant,
                           created_at=rule.created_at)


def event_out(event: Event, *, tenant: str | None) -> EventOut:
    return EventOut(id=event.id, at=event.at, actor=event.actor, action=event.action, subject=event.subject,
                    tenant=tenant, detail=event.detail)


# -- SR-IOV ---------------------------------------------------------------------------------------

def vf_settings(config: VfConfig) -> VfSettings:
    link_state = cast(Literal["auto", "enable", "disable"], config.link_state.name.lower())
    return VfSettings(mac=config.mac, vlan=config.vlan, qos=config.qos, max_tx_rate=config.max_tx_rate,
                      min_tx_rate=config.min_tx_rate, spoofchk=config.spoofchk, trust=config.trust,
                      link_state=link_state)


def pf_out(inventory: PfInventory) -> SriovPfOut:
    pf = inventory.pf
    return SriovPfOut(name=pf.name, kind=pf.kind.value, bus_id=pf.bus_id, driver=pf.driver, num_vfs=pf.num_vfs,
                      total_vfs=pf.total_vfs, eswitch_mode=pf.eswitch_mode, rdma_device=pf.rdma_device,
                      allocated_vfs=len(inventory.allocations),
                      free_vfs=pf.num_vfs - sum(1 for i in inventory.allocations if i < pf.num_vfs),
                      vanished_vrnics=[a.vrnic_id for a in inventory.vanished])


def vf_out(pf: str, index: int, vf: VfInfo | None, allocation: Allocation | None) -> SriovVfOut:
    """vf None: the VF is gone (a vanished allocation)."""
    held = None
    if allocation is not None:
        held = VfAllocationOut(vrnic_id=allocation.vrnic_id, tenant=allocation.tenant,
                               desired=vf_settings(allocation.config),
                               in_sync=vf is not None and vf.config == allocation.config,
                               netns=allocation.netns, vanished=allocation.vanished)
    return SriovVfOut(pf=pf, index=index, pci_address=vf.pci_address if vf else None,
                      netdev=vf.netdev if vf else None, rdma_device=vf.rdma_device if vf else None,
                      settings=vf_settings(vf.config) if vf else None, allocation=held)


def sriov_event_out(event: VfEvent) -> SriovEventOut:
    return SriovEventOut(kind=str(event.kind), pf=event.pf, vf=event.vf, vrnic_id=event.vrnic_id,
                         detail=dict(event.detail))
