"""QoS through the REST API: a live change (PATCH), the counters, the Prometheus endpoint; on the fake driver,
which records what reaches the backend (the kernel tier enforces it on rxe: tests/kernel/test_qos_rxe.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.peering_rig import two_agents_on_one_database
from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.service import BackendService
from vrnic.core.specs import QosPolicy, VrnicMode

pytestmark = pytest.mark.api
Tenant = dict[str, str]


def _as(tenant: Tenant) -> dict[str, str]:
    return {"Authorization": tenant["auth"]}


def _allocate(client: TestClient, tenant: Tenant, qos: dict[str, Any] | None = None) -> dict[str, Any]:
    response = client.post("/api/v1/vrnics", json={"qos": qos or {}}, headers=_as(tenant))
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def test_a_live_qos_change_reaches_the_backend_and_is_recorded(client: TestClient, backend: BackendService,
                                                               make_tenant: Callable[..., Tenant]) -> None:
    acme, other = make_tenant("acme"), make_tenant("other")
    mine = _allocate(client, acme, {"rate_cap_mbps": 80})
    url = f"/api/v1/vrnics/{mine['id']}"
    changed = client.patch(url, json={"qos": {"rate_cap_mbps": 40, "guarantee_mbps": 10, "weight": 2}},
                           headers=_as(acme))
    assert changed.status_code == 200, changed.text
    assert changed.json()["qos"] == {"rate_cap_mbps": 40, "guarantee_mbps": 10, "weight": 2}
    assert client.get(url, headers=_as(acme)).json()["qos"]["rate_cap_mbps"] == 40
    fake = backend.driver(VrnicMode.PARAVIRTUAL)
    assert isinstance(fake, FakeDriver) and fake.qos[mine["id"]] == QosPolicy(rate_cap_mbps=40, guarantee_mbps=10,
                                                                              weight=2)
    events = client.get("/api/v1/events", params={"action": "vrnic.qos"}).json()["items"]
    assert any(e["subject"] == f"vrnic/{mine['id']}" and e["detail"]["to"]["rate_cap_mbps"] == 40 for e in events)
    # bad input: a guarantee above the cap, unknown fields, another tenant's vRNIC, a released one
    bad = client.patch(url, json={"qos": {"rate_cap_mbps": 10, "guarantee_mbps": 20}}, headers=_as(acme))
    assert bad.status_code == 422 and "exceeds the cap" in bad.text
    assert client.patch(url, json={"qos": {"burst": 1}}, headers=_as(acme)).status_code == 422
    assert client.patch(url, json={"qos": {"weight": 0}}, headers=_as(acme)).status_code == 422
    assert client.patch(url, json={"qos": {}}, headers=_as(other)).status_code == 404
    assert client.delete(url, headers=_as(acme)).status_code == 200
    gone = client.patch(url, json={"qos": {}}, headers=_as(acme))
    assert gone.status_code == 409 and gone.json()["current_state"] == "released"


def test_counters_and_metrics(client: TestClient, backend: BackendService, make_tenant: Callable[..., Tenant],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    acme = make_tenant("acme")
    mine = _allocate(client, acme)
    counters = client.get(f"/api/v1/vrnics/{mine['id']}/counters", headers=_as(acme))
    assert counters.status_code == 200
    assert counters.json() == {"vrnic_id": mine["id"], "shaped": False, "tx_bytes": 0, "tx_packets": 0,
                               "tx_rate_bps": 0.0, "rx_bytes": 0, "rx_packets": 0, "rx_rate_bps": 0.0}
    assert client.get("/metrics", headers=_as(acme)).status_code == 403  # operator only
    scraped = client.get("/metrics")
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    assert "# TYPE vrnic_tx_bytes_total counter" in scraped.text
    assert "# TYPE vrnic_rx_bytes_total counter" in scraped.text
    # The in-memory NIC counts nothing (the kernel tier counts on rxe): what a mechanism reports is passed on.
    monkeypatch.setattr(backend, "qos_counters", lambda: {mine["id"]: {
        "tx_bytes": 1000, "tx_packets": 10, "rx_bytes": 5000, "rx_packets": 7}})
    counted = client.get(f"/api/v1/vrnics/{mine['id']}/counters", headers=_as(acme)).json()
    assert (counted["shaped"], counted["tx_bytes"], counted["rx_bytes"], counted["rx_packets"]) == (True, 1000, 5000, 7)
    scraped = client.get("/metrics").text
    assert f'vrnic_rx_bytes_total{{vrnic="{mine["id"]}"}} 5000.0' in scraped
    assert f'vrnic_tx_packets_total{{vrnic="{mine["id"]}"}} 10.0' in scraped


def test_a_limit_on_a_device_without_a_qos_mechanism_is_refused_through_rest(tmp_path: Path) -> None:
    """The verbs driver on the in-memory NIC (no netdev to shape): allocate and PATCH answer 422 naming why,
    and nothing is made or changed; a vRNIC that asks for nothing is served."""
    edge = FakeEdge()
    with two_agents_on_one_database(edge, ("fake0", "fake1"), tmp_path) as rig:
        url = f"{rig.agents['host-a'].url}/api/v1"
        httpx.post(f"{url}/tenants", json={"name": "acme"}, headers=rig.operator).raise_for_status()
        for qos in ({"rate_cap_mbps": 10}, {"guarantee_mbps": 5}, {"weight": 2}):
            refused = httpx.post(f"{url}/vrnics", json={"tenant": "acme", "host": "host-a", "qos": qos},
                                 headers=rig.operator, timeout=60)
            assert refused.status_code == 422, refused.text
            assert "no QoS mechanism" in refused.json()["detail"]
        assert not edge.live
        listed = httpx.get(f"{url}/vrnics", params={"state": "allocated"}, headers=rig.operator).json()["items"]
        assert listed == []  # no row was left behind by a refused allocation
        made = httpx.post(f"{url}/vrnics", json={"tenant": "acme", "host": "host-a"}, headers=rig.operator,
                          timeout=60)
        assert made.status_code == 201, made.text
        vrnic = f"{url}/vrnics/{made.json()['id']}"
        patched = httpx.patch(vrnic, json={"qos": {"rate_cap_mbps": 10}}, headers=rig.operator, timeout=60)
        assert patched.status_code == 422 and "no QoS mechanism" in patched.json()["detail"], patched.text
        assert httpx.get(vrnic, headers=rig.operator).json()["qos"]["rate_cap_mbps"] is None  # unchanged
        assert httpx.delete(vrnic, headers=rig.operator, timeout=60).status_code == 200
    assert not edge.live
