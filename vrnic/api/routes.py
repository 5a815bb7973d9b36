"""REST routes under /api/v1: thin adapters from HTTP to the ControlPlane's parts."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from vrnic.api.auth import Principal
from vrnic.api.controlplane import ControlPlane
from vrnic.api.pagination import MAX_PAGE
from vrnic.api.problems import RESPONSES, unknown_query_parameters
from vrnic.api.schemas import (
    ContainerAttach,
    ContainerAttached,
    DeviceOut,
    EventOut,
    HostOut,
    NumVfsChange,
    NumVfsChanged,
    Page,
    ReconcileOut,
    SecurityRuleCreate,
    SecurityRuleOut,
    SriovPfOut,
    SriovVfOut,
    TenantCreate,
    TenantCreated,
    TenantOut,
    TenantUpdate,
    TokenIssued,
    TokenOut,
    VmAdmission,
    VmAdmitted,
    VmAttach,
    VmHandoverRequest,
    VmMigrationAborted,
    VmMigrationPrepared,
    VmMigrationSwitched,
    VmUnbound,
    VrnicCounters,
    VrnicCreate,
    VrnicOut,
    VrnicQosChange,
)
from vrnic.core.lifecycle import VrnicState
from vrnic.core.specs import HOST_NAME_PATTERN, VmBinding
from vrnic.errors import InvalidArgument

bearer = HTTPBearer(auto_error=False, description="the operator token, or a tenant's token")


# Dependencies are async so FastAPI does not hop to a worker thread for each of them; only a cache
# miss reads the token table, and that goes to a worker thread.
async def control_plane(request: Request) -> ControlPlane:
    cp: ControlPlane = request.app.state.control_plane
    return cp


async def caller(request: Request,
                 credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    cp = await control_plane(request)
    token = credentials.credentials if credentials else None
    known = cp.tenants.cached_principal(token)
    return known if known is not None else await run_in_threadpool(cp.tenants.authenticate, token)


CP = Annotated[ControlPlane, Depends(control_plane)]
Caller = Annotated[Principal, Depends(caller)]
Cursor = Annotated[str | None, Query(max_length=20, pattern=r"^[0-9]+$",
                                     description="next_cursor of the previous page")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
TenantPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
VRNIC_ID_PATTERN = r"^vr-[0-9a-f]{32}$"
IDEMPOTENCY_KEY_MAX = 255
VrnicPath = Annotated[str, Path(pattern=VRNIC_ID_PATTERN, examples=["vr-0123456789abcdef0123456789abcdef"])]
BigId = Annotated[int, Path(ge=1, lt=1 << 63)]
Printable = r"^[\x20-\x7e]*$"
DomainPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$", description="libvirt domain name",
                                examples=["vm1"])]
PfPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:@-]{1,15}$", description="the PF's netdev name",
                             examples=["eth0"])]

async def known_query_only(request: Request) -> None:
    """Refuse query parameters the operation does not have (`?forse=true` must not be ignored)."""
    if request.query_params:
        unknown = unknown_query_parameters(request.app, request.method, request.url.path,
                                           set(request.query_params.keys()))
        if unknown:
            raise InvalidArgument(f"unknown query parameter(s): {', '.join(map(repr, unknown))}")


router = APIRouter(prefix="/api/v1", responses=RESPONSES, dependencies=[Depends(known_query_only)])


@router.get("/health", tags=["meta"])
def health(cp: CP) -> dict[str, str]:
    """Liveness (no token needed)."""
    return {"status": "ok", "host": cp.host_name}


# -- tenants (operator only) ----------------------------------------------------------------------

@router.post("/tenants", status_code=status.HTTP_201_CREATED, tags=["tenants"])
async def create_tenant(body: TenantCreate, cp: CP, who: Caller, response: Response) -> TenantCreated:
    """Create a tenant; the response carries its first token, shown only here."""
    created = await cp.write(cp.tenants.create_tenant, who, body)
    response.headers["Location"] = f"/api/v1/tenants/{created.name}"
    return created


@router.get("/tenants", tags=["tenants"])
def list_tenants(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50) -> Page[TenantOut]:
    return cp.tenants.list_tenants(who, cursor, limit)


@router.get("/tenants/{name}", tags=["tenants"])
def get_tenant(name: TenantPath, cp: CP, who: Caller) -> TenantOut:
    return cp.tenants.get_tenant(who, name)


@router.patch("/tenants/{name}", tags=["tenants"])
async def update_tenant(name: TenantPath, body: TenantUpdate, cp: CP, who: Caller) -> TenantOut:
    return await cp.write(cp.tenants.update_tenant, who, name, body)


@router.delete("/tenants/{name}", status_code=status.HTTP_204_NO_CONTENT, tags=["tenants"])
async def delete_tenant(name: TenantPath, cp: CP, who: Caller) -> None:
    """Delete a tenant with no live vRNICs (its released vRNICs and tokens go with it)."""
    await cp.write(cp.tenants.delete_tenant, who, name)


@router.post("/tenants/{name}/tokens", status_code=status.HTTP_201_CREATED, tags=["tenants"])
async def issue_token(name: TenantPath, cp: CP, who: Caller) -> TokenIssued:
    return await cp.write(cp.tenants.issue_token, who, name)


@router.get("/tenants/{name}/tokens", tags=["tenants"])
def list_tokens(name: TenantPath, cp: CP, who: Caller) -> list[TokenOut]:
    return cp.tenants.list_tokens(who, name)


@router.delete("/tenants/{name}/tokens/{token_id}", tags=["tenants"])
async def revoke_token(name: TenantPath, token_id: BigId, cp: CP, who: Caller) -> TokenOut:
    return await cp.write(cp.tenants.revoke_token, who, name, token_id)


# -- vRNICs ---------------------------------------------------------------------------------------

@router.post("/vrnics", status_code=status.HTTP_201_CREATED, tags=["vrnics"],
             responses={200: {"model": VrnicOut, "description": "a replay: Idempotency-Key matched an earlier "
                                                                 "allocation. The attach token is not shown again: "
                                                                 "POST /vrnics/{id}/token issues a new one",
                              "headers": {"Idempotent-Replayed": {"schema": {"type": "string", "enum": ["true"]}},
                                          "Link": {"description": "rel=\"token\": where to get a new attach token",
                                                   "schema": {"type": "string"}}}}})
async def allocate_vrnic(body: VrnicCreate, cp: CP, who: Caller, response: Response,
                         idempotency_key: Annotated[str | None, Header(min_length=1, max_length=IDEMPOTENCY_KEY_MAX,
                                                                       pattern=Printable)] = None) -> VrnicOut:
    """Allocate a vRNIC: pick a device, create it in the backend, return what a frontend needs to attach.

    The attach token is in this response only. Retrying with the same Idempotency-Key returns the
    same vRNIC (status 200, header Idempotent-Replayed: true) instead of allocating another, without its
    token: the header `Link: </api/v1/vrnics/{id}/token>; rel="token"` says where to get a new one.
    """
    out, replayed = await cp.write(cp.vrnics.allocate, who, body, idempotency_key)
    answer_allocation(response, out, replayed)  # the plain request is served by fast_routes
    return out


def answer_allocation(response: Response, out: VrnicOut, replayed: bool) -> None:
    """The status and headers of an allocation's answer (here and in fast_routes)."""
    response.headers["Location"] = f"/api/v1/vrnics/{out.id}"
    if replayed:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
        response.headers["Link"] = f'</api/v1/vrnics/{out.id}/token>; rel="token"'


@router.post("/vrnics/{vrnic_id}/token", tags=["vrnics"])
async def reissue_vrnic_token(vrnic_id: VrnicPath, cp: CP, who: Caller) -> VrnicOut:
    """A new attach token for a paravirtual vRNIC (its tenant or the operator), shown in this response only;
    the old token stops working at once (a guest attached now stays attached). Audited."""
    return await cp.write(cp.vrnics.reissue_token, who, vrnic_id)


@router.get("/vrnics", tags=["vrnics"])
async def list_vrnics(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50, state: VrnicState | None = None,
                      tenant: Annotated[str | None, Query(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")] = None
                      ) -> Page[VrnicOut]:
    """vRNICs, oldest first; `state` attached/detached is what vrnicd observes, not what a client said."""
    page, stale = await run_in_threadpool(cp.vrnics.list_vrnics, who, cursor, limit, state=state, tenant=tenant)
    if stale:  # an observed attach or detach: into the database and the audit log, then the filter sees it
        await cp.write(cp.vrnics.record_observed)
        page, _ = await run_in_threadpool(cp.vrnics.list_vrnics, who, cursor, limit, state=state, tenant=tenant)
    return page


@router.patch("/vrnics/{vrnic_id}", tags=["vrnics"])
async def change_vrnic_qos(vrnic_id: VrnicPath, body: VrnicQosChange, cp: CP, who: Caller) -> VrnicOut:
    """Change a live vRNIC's QoS (cap, guarantee, weight): enforced at once, its QPs stay connected. Refused
    (nothing changes) when the link cannot give the guarantee or the device has no QoS mechanism."""
    return await cp.write(cp.vrnics.change_qos, who, vrnic_id, body.qos)


@router.get("/vrnics/{vrnic_id}/counters", tags=["vrnics"])
def vrnic_counters(vrnic_id: VrnicPath, cp: CP, who: Caller) -> VrnicCounters:
    """Bytes and packets the vRNIC sent as its device's QoS mechanism counts them, and the rate since the
    previous reading."""
    return cp.vrnics.counters(who, vrnic_id)


@router.get("/vrnics/{vrnic_id}", tags=["vrnics"])
async def get_vrnic(vrnic_id: VrnicPath, cp: CP, who: Caller) -> VrnicOut:
    """A vRNIC; its state attached/detached is what vrnicd observes now."""
    out, stale = await run_in_threadpool(cp.vrnics.get_vrnic, who, vrnic_id)
    if stale:
        await cp.write(cp.vrnics.record_observed)
    return out


@router.delete("/vrnics/{vrnic_id}", tags=["vrnics"])
async def release_vrnic(vrnic_id: VrnicPath, cp: CP, who: Caller,
                        force: Annotated[bool, Query(description="operator: release even while a guest is "
                                                                 "attached")] = False
                        ) -> VrnicOut:
    """Release: tear down the backend state; the record stays, in state released."""
    return await cp.write(cp.vrnics.release, who, vrnic_id, force=force)


@router.put("/vrnics/{vrnic_id}/vm", tags=["vrnics", "vms"])
async def attach_vrnic_to_vm(vrnic_id: VrnicPath, body: VmAttach, cp: CP, who: Caller) -> VrnicOut:
    """Record that the vRNIC belongs to a libvirt domain (`vrnic vm attach` then edits the domain's XML).
    Refused for a released vRNIC, one attached to another domain, or one a container guest holds."""
    return await cp.write(cp.vms.attach, who, vrnic_id, body.domain)


@router.delete("/vrnics/{vrnic_id}/vm", tags=["vrnics", "vms"])
async def detach_vrnic_from_vm(vrnic_id: VrnicPath, cp: CP, who: Caller) -> VrnicOut:
    """The vRNIC belongs to no domain any more; a running VM it was bound to loses its service now."""
    return await cp.write(cp.vms.detach, who, vrnic_id)


@router.get("/vms", tags=["vms"])
def list_vm_bindings(cp: CP, who: Caller) -> dict[str, list[VmBinding]]:
    """Operator: the running VMs vrnicd serves (observed)."""
    return {"items": cp.vms.bindings(who)}


@router.post("/vms/{domain}/admission", tags=["vms"])
def admit_vm(domain: DomainPath, body: VmAdmission, cp: CP, who: Caller) -> VmAdmitted:
    """Operator (the libvirt hook at prepare): may this domain start with these vRNICs?"""
    return cp.vms.admission(who, domain, body.vrnic_ids)


@router.put("/vms/{domain}/binding", tags=["vms"])
async def bind_vm(domain: DomainPath, body: VmBinding, cp: CP, who: Caller) -> VmBinding:
    """Operator (the libvirt hook at started and reconnect): vrnicd maps the VM's RAM and connects its
    channels, all or nothing; binding the same again is a no-op."""
    return await cp.write(cp.vms.bind, who, domain, body)


@router.delete("/vms/{domain}/binding", tags=["vms"])
async def unbind_vm(domain: DomainPath, cp: CP, who: Caller) -> VmUnbound:
    """Operator (the libvirt hook at stopped and release): release every kernel object of the VM's vRNICs."""
    return await cp.write(cp.vms.unbind, who, domain)


@router.post("/vms/{domain}/migration", tags=["vms"])
async def prepare_vm_migration(domain: DomainPath, body: VmBinding, cp: CP, who: Caller) -> VmMigrationPrepared:
    """Operator: the bound VM's destination QEMU runs, paused and incoming (body: its binding). vrnicd maps its
    RAM, connects its channels, starts logging what the NIC writes and pre-registers the MRs there."""
    return await cp.write(cp.vms.migration_prepare, who, domain, body)


@router.post("/vms/{domain}/migration/switchover", tags=["vms"])
async def switch_vm_migration(domain: DomainPath, cp: CP, who: Caller) -> VmMigrationSwitched:
    """Operator: QEMU's migration completed and the destination has not run yet. vrnicd holds and drains the
    VM's QPs and its peers', copies what the NIC wrote, and serves the VM on the destination. On an error
    (409) the source still serves it: resume it there and abort."""
    return await cp.write(cp.vms.migration_complete, who, domain)


@router.delete("/vms/{domain}/migration", tags=["vms"])
async def abort_vm_migration(domain: DomainPath, cp: CP, who: Caller) -> VmMigrationAborted:
    """Operator: QEMU's migration failed or was cancelled; drop the destination's pre-setup."""
    return await cp.write(cp.vms.migration_abort, who, domain)


@router.post("/vms/{domain}/handover", tags=["vms"])
async def prepare_vm_handover(domain: DomainPath, body: VmHandoverRequest, cp: CP, who: Caller) -> dict[str, Any]:
    """Operator: the bound VM's destination QEMU runs on another host, paused and incoming (body: the host and
    the VM's binding there). That host's vrnicd pre-sets-up the vRNICs over its RAM; this host and every host with
    a peer of the VM start logging what the NIC writes into it."""
    return await cp.write(cp.vms.handover_prepare, who, domain, body.host, body.binding)


@router.post("/vms/{domain}/handover/switchover", tags=["vms"])
async def switch_vm_handover(domain: DomainPath, cp: CP, who: Caller) -> dict[str, Any]:
    """Operator: QEMU's migration completed and the destination has not run yet. The VM's QPs and its peers' are
    held and drained on every host, the NIC's writes copied, the state handed over; the database records the
    vRNICs' new host, then every peer host re-points its QPs. On an error (409) this host still serves the VM."""
    return await cp.write(cp.vms.handover_complete, who, domain)


@router.delete("/vms/{domain}/handover", tags=["vms"])
async def abort_vm_handover(domain: DomainPath, cp: CP, who: Caller) -> VmMigrationAborted:
    """Operator: QEMU's migration to the other host failed or was cancelled; drop the pre-setup everywhere."""
    return await cp.write(cp.vms.handover_abort, who, domain)


# -- devices, hosts (operator only), events -------------------------------------------------------

@router.get("/devices", tags=["devices"])
def list_devices(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50) -> Page[DeviceOut]:
    return cp.inventory.list_devices(who, cursor, limit)


@router.get("/devices/{device_id}", tags=["devices"])
def get_device(device_id: BigId, cp: CP, who: Caller) -> DeviceOut:
    return cp.inventory.get_device(who, device_id)


@router.get("/hosts", tags=["hosts"])
def list_hosts(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50) -> Page[HostOut]:
    return cp.inventory.list_hosts(who, cursor, limit)


@router.get("/hosts/{name}", tags=["hosts"])
def get_host(name: Annotated[str, Path(max_length=253, pattern=HOST_NAME_PATTERN)], cp: CP, who: Caller) -> HostOut:
    return cp.inventory.get_host(who, name)


@router.get("/events", tags=["events"])
def list_events(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50,
                subject: Annotated[str | None, Query(max_length=80, pattern=Printable)] = None,
                action: Annotated[str | None, Query(max_length=40, pattern=Printable)] = None) -> Page[EventOut]:
    """The audit log, oldest first; a tenant sees only events about itself."""
    return cp.inventory.list_events(who, cursor, limit, subject=subject, action=action)


# -- security groups: a tenant's own VPC's rules (the operator: any tenant's) ------------------------

@router.post("/security-rules", status_code=status.HTTP_201_CREATED, tags=["security-rules"])
async def add_security_rule(body: SecurityRuleCreate, cp: CP, who: Caller, response: Response) -> SecurityRuleOut:
    """Allow or deny peers of another tenant's VPC ("*": any other). Cross-VPC connections need an allow on both
    sides and no deny on either; checked by the agents at connect time, and audited."""
    rule = await cp.write(cp.security_rules.create, who, body)
    response.headers["Location"] = f"/api/v1/security-rules/{rule.id}"
    return rule


@router.get("/security-rules", tags=["security-rules"])
def list_security_rules(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50,
                        tenant: Annotated[str | None, Query(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")] = None
                        ) -> Page[SecurityRuleOut]:
    return cp.security_rules.list(who, cursor, limit, tenant=tenant)


@router.delete("/security-rules/{rule_id}", status_code=status.HTTP_204_NO_CONTENT, tags=["security-rules"])
async def delete_security_rule(rule_id: BigId, cp: CP, who: Caller) -> None:
    await cp.write(cp.security_rules.delete, who, rule_id)


# -- SR-IOV: PFs and VFs (operator only), a vRNIC's VF (its tenant too) ---------------------------

@router.get("/sriov/pfs", tags=["sriov"])
def list_sriov_pfs(cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50) -> Page[SriovPfOut]:
    """SR-IOV capable PFs of this host: VF totals and count, driver, eswitch mode, allocated and free VFs."""
    return cp.sriov.list_pfs(who, cursor, limit)


@router.get("/sriov/pfs/{pf}", tags=["sriov"])
def get_sriov_pf(pf: PfPath, cp: CP, who: Caller) -> SriovPfOut:
    return cp.sriov.get_pf(who, pf)


@router.get("/sriov/pfs/{pf}/vfs", tags=["sriov"])
def list_sriov_vfs(pf: PfPath, cp: CP, who: Caller, cursor: Cursor = None, limit: Limit = 50) -> Page[SriovVfOut]:
    """A PF's VFs: the settings the kernel reports, and who holds each (with the desired settings)."""
    return cp.sriov.list_vfs(who, pf, cursor, limit)


@router.put("/sriov/pfs/{pf}/num-vfs", tags=["sriov"])
async def set_sriov_num_vfs(pf: PfPath, body: NumVfsChange, cp: CP, who: Caller) -> NumVfsChanged:
    """Set the VF count. Refused (409, naming the allocations) while VFs are allocated, unless `force`:
    then it goes through zero, re-applies every surviving VF's configuration and marks vanished vRNICs."""
    return await cp.write(cp.sriov.set_num_vfs, who, pf, body)


@router.post("/sriov/reconcile", tags=["sriov"])
async def reconcile_sriov(cp: CP, who: Caller) -> ReconcileOut:
    """Compare desired VF state (database) with the kernel's now and restore what drifted (each correction
    is also an event). The daemon does this at startup and periodically."""
    return await cp.write(cp.sriov.reconcile, who)


@router.get("/vrnics/{vrnic_id}/vf", tags=["vrnics", "sriov"])
def get_vrnic_vf(vrnic_id: VrnicPath, cp: CP, who: Caller) -> SriovVfOut:
    """The VF behind an SR-IOV vRNIC: desired and observed settings, netns, vanished."""
    return cp.sriov.vrnic_vf(who, vrnic_id)


@router.get("/vrnics/{vrnic_id}/hostdev", tags=["vrnics", "sriov"], response_class=Response,
            responses={200: {"description": "libvirt `<interface type='hostdev'>` XML",
                             "content": {"application/xml": {"schema": {"type": "string"}}}}})
def get_vrnic_hostdev(vrnic_id: VrnicPath, cp: CP, who: Caller,
                      alias: Annotated[str | None, Query(pattern=r"^ua-[A-Za-z0-9_-]{1,60}$",
                                                         description="libvirt user alias")] = None) -> Response:
    """The libvirt device XML that gives the vRNIC's VF to a VM (needs a PCI VF)."""
    return Response(cp.sriov.vrnic_hostdev_xml(who, vrnic_id, alias), media_type="application/xml")


@router.put("/vrnics/{vrnic_id}/container", tags=["vrnics", "sriov"])
async def attach_vrnic_to_container(vrnic_id: VrnicPath, body: ContainerAttach, cp: CP, who: Caller
                                    ) -> ContainerAttached:
    """Operator (the container runtime): move the vRNIC's VF netdev, and its RDMA device, into a container's
    named network namespace. Refused (422) for a VF without a netdev of its own, or, with require_rdma,
    without an RDMA device that can move; 409 when it is in a namespace already."""
    attached = await cp.write(cp.sriov.attach_container, who, vrnic_id, body)
    await cp.write(cp.vrnics.record_observed)  # vrnicd now observes it attached
    return attached


@router.delete("/vrnics/{vrnic_id}/container", tags=["vrnics", "sriov"])
async def detach_vrnic_from_container(vrnic_id: VrnicPath, cp: CP, who: Caller) -> SriovVfOut:
    """Operator: bring the VF back from the container's namespace into the host's (a namespace that is
    gone already gave it back)."""
    vf = await cp.write(cp.sriov.detach_container, who, vrnic_id)
    await cp.write(cp.vrnics.record_observed)
    return vf


metrics_router = APIRouter(responses=RESPONSES, dependencies=[Depends(known_query_only)])


@metrics_router.get("/metrics", tags=["metrics"], response_class=PlainTextResponse)
def metrics(cp: CP, who: Caller) -> PlainTextResponse:
    """Operator: Prometheus text format. Per vRNIC whose device has QoS on: bytes and packets sent (counters)
    and the send rate since the previous scrape (a gauge)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector, CollectorRegistry

    who.require_operator()
    counted = cp.backend.qos_counters()

    class Counted(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            now = time.monotonic()
            for way, verb, noun in (("tx", "sent", "Send"), ("rx", "received", "Receive")):
                nbytes = CounterMetricFamily(f"vrnic_{way}_bytes", f"Bytes a vRNIC {verb} (QoS mechanism)",
                                             labels=["vrnic"])
                packets = CounterMetricFamily(f"vrnic_{way}_packets", f"Packets a vRNIC {verb}", labels=["vrnic"])
                rate = GaugeMetricFamily(f"vrnic_{way}_rate_bits_per_second", f"{noun} rate since the previous "
                                         "scrape", labels=["vrnic"])
                for vrnic_id, c in sorted(counted.items()):
                    nbytes.add_metric([vrnic_id], c.get(f"{way}_bytes", 0))
                    packets.add_metric([vrnic_id], c.get(f"{way}_packets", 0))
                    rate.add_metric([vrnic_id], cp.vrnics.meter.read(f"metrics:{way}:{vrnic_id}",
                                                                     c.get(f"{way}_bytes", 0), now))
                yield from (nbytes, packets, rate)

    registry = CollectorRegistry()
    registry.register(Counted())
    return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)
