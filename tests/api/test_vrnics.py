"""vRNIC allocation through the REST API: backend state, idempotency, lifecycle, quotas, lists."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, Engine

from vrnic.api.app import create_app
from vrnic.backend.driver import load_driver
from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import DataEngine, VrnicMode, VrnicSpec
from vrnic.core.vaddr import parse_virtual_gid

Tenant = dict[str, str]


def _as(tenant: Tenant) -> dict[str, str]:
    return {"Authorization": tenant["auth"]}


def _allocate(client: TestClient, tenant: Tenant, **body: Any) -> dict[str, Any]:
    response = client.post("/api/v1/vrnics", json=body, headers=_as(tenant))
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def test_allocate_creates_backend_state_and_returns_attach_info(client: TestClient, backend: BackendService,
                                                                make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme", vpc_id=7)
    response = client.post("/api/v1/vrnics", json={"qos": {"rate_cap_mbps": 1000, "guarantee_mbps": 100},
                                                   "quota": {"max_qps": 8}}, headers=_as(acme))
    assert response.status_code == 201
    body = response.json()
    assert response.headers["location"] == f"/api/v1/vrnics/{body['id']}"
    assert body["id"] in backend.vrnic_ids()
    assert body["state"] == "allocated" and body["tenant"] == "acme" and body["mode"] == "paravirtual"
    vpc, serial = parse_virtual_gid(body["virtual_gid"])
    assert vpc == 7 and serial >= 1
    attach = body["attach"]
    assert attach["vrnic_id"] == body["id"] and attach["virtual_gid"] == body["virtual_gid"]
    assert attach["socket_path"] and attach["token"]
    assert attach["device"] in {"fake0", "fake1"}
    assert body["quota"]["max_qps"] == 8 and body["qos"]["rate_cap_mbps"] == 1000
    # the token is shown once: reading the vRNIC back does not reveal it
    again = client.get(f"/api/v1/vrnics/{body['id']}", headers=_as(acme)).json()
    assert again["attach"]["token"] is None
    assert {k: v for k, v in again.items() if k != "attach"} == {k: v for k, v in body.items() if k != "attach"}


def test_virtual_gids_are_unique_and_placement_spreads(client: TestClient, make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    made = [_allocate(client, acme) for _ in range(4)]
    assert len({m["virtual_gid"] for m in made}) == 4
    assert sorted(m["device"] for m in made) == ["fake0", "fake0", "fake1", "fake1"]
    pinned = _allocate(client, acme, device="fake1")
    assert pinned["device"] == "fake1"


def test_release_tears_down_backend_state_and_keeps_the_record(client: TestClient, backend: BackendService,
                                                               make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    vrnic = _allocate(client, acme)
    response = client.delete(f"/api/v1/vrnics/{vrnic['id']}", headers=_as(acme))
    assert response.status_code == 200
    assert response.json()["state"] == "released" and response.json()["released_at"]
    assert vrnic["id"] not in backend.vrnic_ids()
    again = client.delete(f"/api/v1/vrnics/{vrnic['id']}", headers=_as(acme))
    assert again.status_code == 409
    assert again.headers["content-type"] == "application/problem+json"
    problem = again.json()
    assert problem["current_state"] == "released" and problem["status"] == 409 and problem["code"] == "conflict"
    assert problem["type"] == "urn:vrnic:problem:conflict" and problem["instance"].endswith(vrnic["id"])


def _fake(backend: BackendService) -> FakeDriver:
    driver = backend.driver(VrnicMode.PARAVIRTUAL)
    assert isinstance(driver, FakeDriver)
    return driver


def _history(client: TestClient, vid: str) -> list[tuple[str, str]]:
    events = client.get("/api/v1/events", params={"subject": f"vrnic/{vid}"}).json()["items"]
    return [(e["action"], e["actor"]) for e in events]


def test_attach_state_is_what_vrnicd_observes_and_is_recorded_once(
        client: TestClient, backend: BackendService, make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    vid = _allocate(client, acme)["id"]
    url = f"/api/v1/vrnics/{vid}"
    for said in ("attach", "detach"):  # a client cannot claim a state any more
        assert client.post(f"{url}/{said}", headers=_as(acme)).status_code == 404
    assert client.get(url, headers=_as(acme)).json()["state"] == "allocated"
    _fake(backend).guest_attached(vid)
    assert client.get(url, headers=_as(acme)).json()["state"] == "attached"
    assert client.get(url, headers=_as(acme)).json()["state"] == "attached"  # read twice, recorded once
    assert _history(client, vid) == [("vrnic.allocate", "tenant:acme"), ("vrnic.attach", "daemon")]
    # persisted: the stored state (what the state filter sees) follows the observation
    attached = client.get("/api/v1/vrnics", params={"state": "attached"}).json()["items"]
    assert [v["id"] for v in attached] == [vid]
    _fake(backend).guest_detached(vid)
    listed = client.get("/api/v1/vrnics", headers=_as(acme)).json()["items"]
    assert [(v["id"], v["state"]) for v in listed] == [(vid, "detached")]
    assert _history(client, vid)[-1] == ("vrnic.detach", "daemon")
    assert client.get("/api/v1/vrnics", params={"state": "detached"}).json()["items"][0]["id"] == vid


def test_release_follows_the_observed_state_and_works_from_every_state(
        client: TestClient, backend: BackendService, make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    fake = _fake(backend)
    vid = _allocate(client, acme)["id"]
    url = f"/api/v1/vrnics/{vid}"
    fake.guest_attached(vid)  # nobody read it since: release observes it itself
    refused = client.delete(url, headers=_as(acme))
    assert refused.status_code == 409 and refused.json()["current_state"] == "attached"
    assert "disconnect the guest first" in refused.json()["detail"]
    assert vid in backend.vrnic_ids()  # nothing half-applied
    assert client.delete(url, params={"force": True}, headers=_as(acme)).status_code == 403  # force: operator's
    fake.guest_detached(vid)
    released = client.delete(url, headers=_as(acme))
    assert released.status_code == 200 and released.json()["state"] == "released"
    assert vid not in backend.vrnic_ids()
    assert _history(client, vid) == [("vrnic.allocate", "tenant:acme"), ("vrnic.attach", "daemon"),
                                     ("vrnic.detach", "daemon"), ("vrnic.release", "tenant:acme")]
    # allocated (never attached) and attached (the operator forces) release too
    never = _allocate(client, acme)["id"]
    assert client.delete(f"/api/v1/vrnics/{never}", headers=_as(acme)).json()["state"] == "released"
    busy = _allocate(client, acme)["id"]
    fake.guest_attached(busy)
    forced = client.delete(f"/api/v1/vrnics/{busy}", params={"force": True})
    assert forced.status_code == 200 and forced.json()["state"] == "released"
    assert [a for a, _ in _history(client, busy)] == ["vrnic.allocate", "vrnic.attach", "vrnic.release"]
    assert backend.vrnic_ids() == set() and backend.attached_vrnics() == set()


def test_idempotency_key_makes_retries_safe(client: TestClient, backend: BackendService,
                                            make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    key = {"Idempotency-Key": str(uuid.uuid4()), **_as(acme)}
    first = client.post("/api/v1/vrnics", json={"quota": {"max_qps": 4}}, headers=key)
    retry = client.post("/api/v1/vrnics", json={"quota": {"max_qps": 4}}, headers=key)
    assert first.status_code == 201 and retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["id"] == first.json()["id"]
    assert retry.json()["virtual_gid"] == first.json()["virtual_gid"]
    assert retry.json()["attach"]["token"] is None
    assert backend.vrnic_ids() == {first.json()["id"]}
    different = client.post("/api/v1/vrnics", json={"quota": {"max_qps": 5}}, headers=key)
    assert different.status_code == 409 and "different request" in different.json()["detail"]
    # keys are per tenant: another tenant's same key is its own allocation
    other = make_tenant("other")
    theirs = client.post("/api/v1/vrnics", json={"quota": {"max_qps": 4}},
                         headers={"Idempotency-Key": key["Idempotency-Key"], **_as(other)})
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]


def test_a_replayed_allocation_points_at_the_token_reissue_which_retires_the_old_token(
        client: TestClient, backend: BackendService, make_tenant: Callable[..., Tenant]) -> None:
    acme, other = make_tenant("acme"), make_tenant("other")
    key = {"Idempotency-Key": str(uuid.uuid4()), **_as(acme)}
    first = client.post("/api/v1/vrnics", json={}, headers=key).json()
    retry = client.post("/api/v1/vrnics", json={}, headers=key)
    vid = first["id"]
    assert retry.status_code == 200 and retry.json()["attach"]["token"] is None
    assert retry.headers["link"] == f'</api/v1/vrnics/{vid}/token>; rel="token"'
    fake = backend.driver(VrnicMode.PARAVIRTUAL)
    assert isinstance(fake, FakeDriver) and fake.accepts_token(vid, first["attach"]["token"])
    # another tenant's vRNIC looks like none
    assert client.post(f"/api/v1/vrnics/{vid}/token", headers=_as(other)).status_code == 404
    reissued = client.post(f"/api/v1/vrnics/{vid}/token", headers=_as(acme))
    assert reissued.status_code == 200, reissued.text
    token = reissued.json()["attach"]["token"]
    assert token and fake.accepts_token(vid, token) and not fake.accepts_token(vid, first["attach"]["token"])
    by_operator = client.post(f"/api/v1/vrnics/{vid}/token").json()["attach"]["token"]
    assert by_operator and fake.accepts_token(vid, by_operator) and not fake.accepts_token(vid, token)
    assert client.get(f"/api/v1/vrnics/{vid}", headers=_as(acme)).json()["attach"]["token"] is None
    events = client.get("/api/v1/events", params={"subject": f"vrnic/{vid}"}).json()["items"]
    assert [(e["action"], e["actor"]) for e in events] == [
        ("vrnic.allocate", "tenant:acme"), ("vrnic.token_reissue", "tenant:acme"), ("vrnic.token_reissue", "operator")]
    assert all(token not in str(e["detail"]) for e in events)
    client.delete(f"/api/v1/vrnics/{vid}", headers=_as(acme))
    gone = client.post(f"/api/v1/vrnics/{vid}/token", headers=_as(acme))
    assert gone.status_code == 409 and gone.json()["current_state"] == "released"


def test_quota_and_defaults(client: TestClient, backend: BackendService,
                            make_tenant: Callable[..., Tenant]) -> None:
    small = make_tenant("small", max_vrnics=2, default_quota={"max_qps": 3, "max_mrs": 9})
    first = _allocate(client, small)
    assert first["quota"]["max_qps"] == 3 and first["quota"]["max_mrs"] == 9
    _allocate(client, small)
    over = client.post("/api/v1/vrnics", json={}, headers=_as(small))
    assert over.status_code == 403
    assert over.json().items() >= {"code": "quota_exceeded", "limit": "vrnics", "maximum": 2, "requested": 3}.items()
    assert len(backend.vrnic_ids()) == 2
    client.delete(f"/api/v1/vrnics/{first['id']}", headers=_as(small))
    _allocate(client, small)  # released ones do not count
    assert client.patch("/api/v1/tenants/small", json={"unlimited": True}).json()["max_vrnics"] is None
    _allocate(client, small)
    assert client.get("/api/v1/tenants/small").json()["live_vrnics"] == 3


def test_bad_requests_are_problems_and_allocate_nothing(client: TestClient, backend: BackendService,
                                                        make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    cases = [
        ({"mode": "sriov"}, 422, "not_supported"),  # no sriov driver on this host
        ({"device": "nope0"}, 400, "invalid_argument"),
        ({"qos": {"rate_cap_mbps": 10, "guarantee_mbps": 20}}, 422, "invalid_request"),
        ({"quota": {"max_qps": -1}}, 422, "invalid_request"),
        ({"tenant": "other"}, 403, "permission_denied"),
        ({"bogus": 1}, 422, "invalid_request"),
    ]
    for body, status, code in cases:
        response = client.post("/api/v1/vrnics", json=body, headers=_as(acme))
        assert (response.status_code, response.json()["code"]) == (status, code), (body, response.text)
        assert response.headers["content-type"] == "application/problem+json"
    assert client.post("/api/v1/vrnics", json={}).json()["code"] == "invalid_argument"  # operator: which tenant?
    assert backend.vrnic_ids() == set()
    assert client.get("/api/v1/vrnics").json()["items"] == []


def test_engine_is_ring_by_default_and_direct_is_kept(client: TestClient, backend: BackendService,
                                                     make_tenant: Callable[..., Tenant],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    acme = make_tenant("acme")
    asked: list[VrnicSpec] = []
    create = backend.create_vrnic
    monkeypatch.setattr(backend, "create_vrnic", lambda spec: asked.append(spec) or create(spec))
    ring = _allocate(client, acme)
    direct = _allocate(client, acme, engine="direct")
    assert (ring["engine"], direct["engine"]) == ("ring", "direct")
    assert [s.engine for s in asked] == [DataEngine.RING, DataEngine.DIRECT]  # vrnicd is asked for it
    for vrnic in (ring, direct):  # stored: reads show it
        assert client.get(f"/api/v1/vrnics/{vrnic['id']}", headers=_as(acme)).json()["engine"] == vrnic["engine"]
    listed = client.get("/api/v1/vrnics", headers=_as(acme)).json()["items"]
    assert [(v["id"], v["engine"]) for v in listed] == [(ring["id"], "ring"), (direct["id"], "direct")]
    allocated = client.get("/api/v1/events", params={"subject": f"vrnic/{direct['id']}"}).json()["items"][0]
    assert allocated["action"] == "vrnic.allocate" and allocated["detail"]["engine"] == "direct"
    released = client.delete(f"/api/v1/vrnics/{direct['id']}", headers=_as(acme))
    assert released.status_code == 200 and released.json()["engine"] == "direct"


def test_sriov_with_the_direct_engine_is_a_problem_and_allocates_nothing(
        client: TestClient, backend: BackendService, make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    for body in ({"mode": "sriov", "engine": "direct"}, {"engine": "turbo"}):
        response = client.post("/api/v1/vrnics", json=body, headers=_as(acme))
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["code"] == "invalid_request" and problem["status"] == 422 and problem["errors"]
    assert "the direct engine is for paravirtual vRNICs" in client.post(
        "/api/v1/vrnics", json={"mode": "sriov", "engine": "direct"}, headers=_as(acme)).json()["detail"]
    assert backend.vrnic_ids() == set()
    assert client.get("/api/v1/vrnics").json()["items"] == []


def test_idempotency_key_tells_the_engines_apart(client: TestClient, make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    key = {"Idempotency-Key": str(uuid.uuid4()), **_as(acme)}
    first = client.post("/api/v1/vrnics", json={}, headers=key)
    assert first.status_code == 201
    same = client.post("/api/v1/vrnics", json={"engine": "ring"}, headers=key)  # the default, said out loud
    assert same.status_code == 200 and same.json()["id"] == first.json()["id"]
    other = client.post("/api/v1/vrnics", json={"engine": "direct"}, headers=key)
    assert other.status_code == 409 and "different request" in other.json()["detail"]


def test_operator_allocates_for_a_tenant_and_lists_paginate(client: TestClient,
                                                            make_tenant: Callable[..., Tenant]) -> None:
    make_tenant("acme")
    ids = [client.post("/api/v1/vrnics", json={"tenant": "acme"}).json()["id"] for _ in range(5)]
    seen, cursor = [], None
    while True:
        page = client.get("/api/v1/vrnics", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [v["id"] for v in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids
    client.delete(f"/api/v1/vrnics/{ids[0]}")
    live = client.get("/api/v1/vrnics", params={"state": "allocated", "tenant": "acme"}).json()["items"]
    assert [v["id"] for v in live] == ids[1:]
    assert client.get("/api/v1/vrnics", params={"cursor": "x"}).status_code == 422
    assert client.get("/api/v1/vrnics", params={"limit": 0}).status_code == 422


def test_tenants_tokens_devices_hosts(client: TestClient, make_tenant: Callable[..., Tenant]) -> None:
    acme = make_tenant("acme")
    assert client.post("/api/v1/tenants", json={"name": "acme"}).status_code == 409
    assert client.post("/api/v1/tenants", json={"name": "Bad Name"}).status_code == 422
    assert client.post("/api/v1/tenants", json={"name": "b", "vpc_id": 1}).status_code == 409  # acme has VPC 1
    issued = client.post("/api/v1/tenants/acme/tokens").json()
    assert client.get("/api/v1/vrnics", headers={"Authorization": f"Bearer {issued['token']}"}).status_code == 200
    tokens = client.get("/api/v1/tenants/acme/tokens").json()
    assert len(tokens) == 2 and all("token" not in t for t in tokens)
    revoked = client.delete(f"/api/v1/tenants/acme/tokens/{issued['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert client.get("/api/v1/vrnics", headers={"Authorization": f"Bearer {issued['token']}"}).status_code == 401
    assert client.get("/api/v1/vrnics", headers=_as(acme)).status_code == 200  # the first token still works
    devices = client.get("/api/v1/devices").json()["items"]
    assert {(d["name"], d["driver"], d["host"]) for d in devices} == {("fake0", "fake", "test-host"),
                                                                      ("fake1", "fake", "test-host")}
    assert client.get(f"/api/v1/devices/{devices[0]['id']}").json()["caps"]["max_qp"] == 1024
    assert [h["name"] for h in client.get("/api/v1/hosts").json()["items"]] == ["test-host"]
    assert client.get("/api/v1/hosts/test-host").json()["version"]
    vid = _allocate(client, acme)["id"]
    refused = client.delete("/api/v1/tenants/acme")
    assert refused.status_code == 409 and refused.json()["current_state"] == "has_vrnics"
    client.delete(f"/api/v1/vrnics/{vid}")
    assert client.delete("/api/v1/tenants/acme").status_code == 204
    assert client.get("/api/v1/vrnics", headers=_as(acme)).status_code == 401
    assert client.get("/api/v1/tenants/acme").status_code == 404
    assert client.get("/api/v1/events", params={"action": "tenant.delete"}).json()["items"][0]["subject"] == \
        "tenant/acme"


def test_after_a_restart_vrnics_whose_guests_went_with_the_old_process_are_lost(
        client: TestClient, backend: BackendService, make_tenant: Callable[..., Tenant], migrated: Engine,
        settings: DaemonSettings) -> None:
    acme = make_tenant("acme")
    vid = _allocate(client, acme)["id"]
    _fake(backend).guest_attached(vid)
    assert client.get(f"/api/v1/vrnics/{vid}").json()["state"] == "attached"  # recorded
    _fake(backend).guest_detached(vid)  # the old process dies (its app, still running here, must not see it)
    restarted = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake")})  # a new process holds nothing
    try:
        app = create_app(settings, restarted, engine=migrated)
        with TestClient(app, headers=dict(client.headers)) as again:
            assert _history(again, vid)[-1] == ("vrnic.lost", "daemon")  # at startup, before any read
            assert again.get(f"/api/v1/vrnics/{vid}").json()["state"] == "lost"
            released = again.delete(f"/api/v1/vrnics/{vid}", headers=_as(acme))  # no force needed
            assert released.status_code == 200 and released.json()["state"] == "released"
    finally:
        restarted.close()


def test_requests_are_strict_booleans_integers_query_names_and_405s_name_the_allowed_methods(
        client: TestClient, make_tenant: Callable[..., Tenant]) -> None:
    make_tenant("acme")
    as_int = client.patch("/api/v1/tenants/acme", json={"unlimited": 0})
    assert as_int.status_code == 422 and "boolean" in as_int.json()["detail"]
    as_bool = client.patch("/api/v1/tenants/acme", json={"max_vrnics": False})
    assert as_bool.status_code == 422 and "not a boolean" in as_bool.json()["detail"]
    quota = client.post("/api/v1/vrnics", json={"tenant": "acme", "quota": {"max_qps": True}})
    assert quota.status_code == 422
    typo = client.get("/api/v1/vrnics", params={"stat": "attached"})
    assert typo.status_code == 400 and "'stat'" in typo.json()["detail"]
    assert client.get("/api/v1/vrnics", params={"state": "attached"}).status_code == 200
    refused = client.put("/api/v1/tenants/acme")
    assert refused.status_code == 405 and refused.headers["allow"] == "DELETE, GET, PATCH"
    assert client.request("TRACE", "/metrics").headers["allow"] == "GET"


def test_a_database_gone_under_a_request_is_a_503_to_retry_and_nothing_is_half_made(
        client: TestClient, migrated: Engine, backend: BackendService, make_tenant: Callable[..., Tenant],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The database cut away mid-request (PostgreSQL restarted: tests/two_hosts/test_peering.py does it for
    real) answers 503 with Retry-After, never a bare 500; once it is back the same call works."""
    from sqlalchemy.exc import OperationalError

    acme = make_tenant("acme")
    before = backend.vrnic_ids()

    def gone(*_: object, **__: object) -> None:
        raise OperationalError("BEGIN", {}, ConnectionError("server closed the connection unexpectedly"))

    monkeypatch.setattr(migrated, "connect", gone)
    monkeypatch.setattr(Connection, "begin", gone)  # SQLite's writes hold their connection: it fails at BEGIN
    refused = client.post("/api/v1/vrnics", json={}, headers=_as(acme))
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1" and refused.json()["code"] == "unavailable"
    assert "the database is unavailable (ConnectionError)" in refused.json()["detail"]
    assert backend.vrnic_ids() == before  # nothing made in the backend for a request that did not commit
    monkeypatch.undo()
    assert client.post("/api/v1/vrnics", json={}, headers=_as(acme)).status_code == 201
