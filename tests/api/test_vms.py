"""VMs through the REST API: `vrnic vm attach`'s record, and the libvirt hook's admission, binding and unbinding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.service import BackendService
from vrnic.core.specs import VrnicMode

pytestmark = pytest.mark.api
Tenant = dict[str, str]


def _as(tenant: Tenant) -> dict[str, str]:
    return {"Authorization": tenant["auth"]}


def _allocate(client: TestClient, tenant: Tenant) -> dict[str, Any]:
    response = client.post("/api/v1/vrnics", json={}, headers=_as(tenant))
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def _binding(domain: str, *ids: str) -> dict[str, Any]:
    return {"domain": domain, "ram_path": f"/var/lib/libvirt/qemu/ram/libvirt/qemu/1-{domain}/pc.ram",
            "machine": "q35", "vrnics": [{"vrnic_id": i, "channel_socket": f"/run/vrnic/vm/{domain}/{i}.sock"}
                                         for i in ids]}


def _fake(backend: BackendService) -> FakeDriver:
    driver = backend.driver(VrnicMode.PARAVIRTUAL)
    assert isinstance(driver, FakeDriver)
    return driver


def test_attach_records_the_domain_and_refuses_what_it_must(client: TestClient, backend: BackendService,
                                                            make_tenant: Callable[..., Tenant]) -> None:
    acme, other = make_tenant("acme"), make_tenant("other")
    mine, theirs = _allocate(client, acme), _allocate(client, other)
    url = f"/api/v1/vrnics/{mine['id']}/vm"
    attached = client.put(url, json={"domain": "vm1"}, headers=_as(acme))
    assert attached.status_code == 200 and attached.json()["vm_domain"] == "vm1"
    assert client.get(f"/api/v1/vrnics/{mine['id']}", headers=_as(acme)).json()["vm_domain"] == "vm1"
    assert client.put(url, json={"domain": "vm1"}, headers=_as(acme)).status_code == 200  # idempotent
    elsewhere = client.put(url, json={"domain": "vm2"}, headers=_as(acme))
    assert elsewhere.status_code == 409
    assert elsewhere.json()["current_state"] == "attached" and "vm1" in elsewhere.json()["detail"]
    foreign = client.put(f"/api/v1/vrnics/{theirs['id']}/vm", json={"domain": "vm1"}, headers=_as(acme))
    assert foreign.status_code == 404  # another tenant's vRNIC looks like none
    unknown = client.put(f"/api/v1/vrnics/vr-{'0' * 32}/vm", json={"domain": "vm1"}, headers=_as(acme))
    assert unknown.status_code == 404
    assert client.put(url, json={"domain": "bad name"}, headers=_as(acme)).status_code == 422
    # a container guest holds the vRNIC
    busy = _allocate(client, acme)
    _fake(backend).guest_attached(busy["id"])
    held = client.put(f"/api/v1/vrnics/{busy['id']}/vm", json={"domain": "vm3"}, headers=_as(acme))
    assert held.status_code == 409 and "container guest" in held.json()["detail"]
    # released
    gone = _allocate(client, acme)
    assert client.delete(f"/api/v1/vrnics/{gone['id']}", headers=_as(acme)).status_code == 200
    released = client.put(f"/api/v1/vrnics/{gone['id']}/vm", json={"domain": "vm1"}, headers=_as(acme))
    assert released.status_code == 409 and released.json()["current_state"] == "released"
    # detach, and attach elsewhere afterwards
    detached = client.delete(url, headers=_as(acme))
    assert detached.status_code == 200 and detached.json()["vm_domain"] is None
    assert client.delete(url, headers=_as(acme)).status_code == 200  # idempotent
    assert client.put(url, json={"domain": "vm2"}, headers=_as(acme)).json()["vm_domain"] == "vm2"
    actions = [e["action"] for e in client.get("/api/v1/events", params={"limit": 200}).json()["items"]]
    assert actions.count("vrnic.vm_attach") == 2 and actions.count("vrnic.vm_detach") == 1


def test_a_direct_vrnic_cannot_go_to_a_vm(client: TestClient, backend: BackendService,
                                          make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    direct = client.post("/api/v1/vrnics", json={"engine": "direct"}, headers=_as(acme)).json()
    refused = client.put(f"/api/v1/vrnics/{direct['id']}/vm", json={"domain": "vm1"}, headers=_as(acme))
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["code"] == "invalid_argument"
    assert f"vRNIC {direct['id']} uses the direct engine, which a VM cannot use" in refused.json()["detail"]
    assert "ring engine" in refused.json()["detail"]
    assert client.get(f"/api/v1/vrnics/{direct['id']}", headers=_as(acme)).json()["vm_domain"] is None
    # nor can the hook start a domain whose XML names it
    admission = client.post("/api/v1/vms/vm1/admission", json={"vrnic_ids": [direct["id"]]})
    assert admission.status_code == 400 and admission.json()["detail"].endswith("refusing to start vm1")
    ring = _allocate(client, acme)
    bound = client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", ring["id"], direct["id"]))
    assert bound.status_code == 400 and "direct engine" in bound.json()["detail"]
    assert backend.vm_bindings() == {}
    assert client.get(f"/api/v1/vrnics/{ring['id']}").json()["vm_domain"] is None  # all or nothing
    actions = [e["action"] for e in client.get("/api/v1/events", params={"limit": 200}).json()["items"]]
    assert "vrnic.vm_attach" not in actions and "vm.bind" not in actions


def test_hook_admission_bind_unbind(client: TestClient, backend: BackendService,
                                    make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    a, b = _allocate(client, acme), _allocate(client, acme)
    assert client.put(f"/api/v1/vrnics/{a['id']}/vm", json={"domain": "vm1"}, headers=_as(acme)).status_code == 200
    admitted = client.post("/api/v1/vms/vm1/admission", json={"vrnic_ids": [a["id"]]})
    assert admitted.status_code == 200 and admitted.json() == {"domain": "vm1", "vrnic_ids": [a["id"]]}
    # refusals, each with a sentence the hook prints and `virsh start` shows
    missing = client.post("/api/v1/vms/vm1/admission", json={"vrnic_ids": ["vr-nope"]})
    assert missing.status_code == 404 and missing.json()["detail"] == \
        "vRNIC vr-nope does not exist; refusing to start vm1"
    elsewhere = client.post("/api/v1/vms/vm2/admission", json={"vrnic_ids": [a["id"]]})
    assert elsewhere.status_code == 409 and "attached to VM vm1" in elsewhere.json()["detail"]
    assert client.post("/api/v1/vms/vm1/admission", json={"vrnic_ids": []}).status_code == 422
    twice = client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", a["id"], a["id"]))
    assert twice.status_code == 400 and "named twice" in twice.json()["detail"]
    # tenants may not speak for the hook
    for method, path, body in (("post", "/api/v1/vms/vm1/admission", {"vrnic_ids": [a["id"]]}),
                               ("put", "/api/v1/vms/vm1/binding", _binding("vm1", a["id"])),
                               ("delete", "/api/v1/vms/vm1/binding", None), ("get", "/api/v1/vms", None)):
        response = client.request(method, path, json=body, headers=_as(acme))
        assert response.status_code == 403, (method, path, response.text)
    # bind: the backend serves it; b had no domain and now belongs to vm1
    bound = client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", a["id"], b["id"]))
    assert bound.status_code == 200, bound.text
    assert set(backend.vm_bindings()) == {"vm1"}
    assert client.get(f"/api/v1/vrnics/{b['id']}").json()["vm_domain"] == "vm1"
    assert client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", a["id"], b["id"])).status_code == 200
    assert [i["domain"] for i in client.get("/api/v1/vms").json()["items"]] == ["vm1"]
    mismatch = client.put("/api/v1/vms/vm2/binding", json=_binding("vm1", a["id"]))
    assert mismatch.status_code == 400 and "path" in mismatch.json()["detail"]
    # unbind: the ids once, then nothing (stopped and release both call it)
    assert client.delete("/api/v1/vms/vm1/binding").json() == {"domain": "vm1", "unbound": [a["id"], b["id"]]}
    assert client.delete("/api/v1/vms/vm1/binding").json() == {"domain": "vm1", "unbound": []}
    assert backend.vm_bindings() == {}
    # a released vRNIC stops the next start
    assert client.delete(f"/api/v1/vrnics/{b['id']}", headers=_as(acme)).status_code == 200
    refused = client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", a["id"], b["id"]))
    assert refused.status_code == 409 and refused.json()["current_state"] == "released"
    assert backend.vm_bindings() == {}


def test_detach_and_release_stop_a_running_vms_service(client: TestClient, backend: BackendService,
                                                       make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    a, b = _allocate(client, acme), _allocate(client, acme)
    assert client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", a["id"])).status_code == 200
    assert client.delete(f"/api/v1/vrnics/{a['id']}/vm", headers=_as(acme)).status_code == 200
    assert backend.vm_bindings() == {}
    assert client.put("/api/v1/vms/vm2/binding", json=_binding("vm2", b["id"])).status_code == 200
    assert client.delete(f"/api/v1/vrnics/{b['id']}", params={"force": True}).status_code == 200
    assert backend.vm_bindings() == {}


def test_a_backend_failure_to_bind_records_nothing(client: TestClient, backend: BackendService,
                                                   make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    a, b = _allocate(client, acme), _allocate(client, acme)
    assert client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", a["id"])).status_code == 200
    _fake(backend).guest_attached(b["id"])
    refused = client.put("/api/v1/vms/vm2/binding", json=_binding("vm2", b["id"]))
    assert refused.status_code == 409
    assert client.get(f"/api/v1/vrnics/{b['id']}").json()["vm_domain"] is None
    assert set(backend.vm_bindings()) == {"vm1"}


def test_migration_prepare_switchover_abort(client: TestClient, backend: BackendService,
                                            make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    mine = _allocate(client, acme)
    assert client.put("/api/v1/vms/vm1/binding", json=_binding("vm1", mine["id"])).status_code == 200
    target = _binding("vm1", mine["id"]) | {"ram_path": "/dev/shm/vm1-incoming.ram"}
    # tenants cannot drive migrations; unknown domains and bad targets are refused with the reason
    assert client.post("/api/v1/vms/vm1/migration", json=target, headers=_as(acme)).status_code == 403
    assert client.post("/api/v1/vms/nope/migration", json=_binding("nope", mine["id"])).status_code == 404
    same = client.post("/api/v1/vms/vm1/migration", json=_binding("vm1", mine["id"]))
    assert same.status_code == 400 and "RAM file is the source's" in same.json()["detail"]
    assert client.post("/api/v1/vms/vm1/migration/switchover").status_code == 409
    prepared = client.post("/api/v1/vms/vm1/migration", json=target)
    assert prepared.status_code == 200 and prepared.json()["phase"] == "prepared", prepared.text
    assert client.post("/api/v1/vms/vm1/migration", json=target).status_code == 409
    aborted = client.delete("/api/v1/vms/vm1/migration")
    assert aborted.json() == {"domain": "vm1", "aborted": True}
    assert client.delete("/api/v1/vms/vm1/migration").json()["aborted"] is False
    # again, to the end: the binding now names the destination's RAM
    assert client.post("/api/v1/vms/vm1/migration", json=target).status_code == 200
    switched = client.post("/api/v1/vms/vm1/migration/switchover")
    assert switched.status_code == 200 and switched.json()["vrnics"] == [mine["id"]], switched.text
    bindings = client.get("/api/v1/vms").json()["items"]
    assert [b["ram_path"] for b in bindings] == ["/dev/shm/vm1-incoming.ram"]
    events = [e["action"] for e in client.get("/api/v1/events").json()["items"]]
    assert {"vm.migration_prepare", "vm.migration_abort", "vm.migration_switchover"} <= set(events)
