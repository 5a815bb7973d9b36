"""Security groups over REST (a tenant's own VPC, the operator any) and the DbLocator the agents read the
cluster through (agents by virtual GID, physical GID and virtual IP; rules; audit)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select, update

from vrnic.api.controlplane import ControlPlane
from vrnic.backend.peer_directory import AgentRef
from vrnic.core.peering import Identity, RuleAction, SecurityRule, decide
from vrnic.db.locator import DbLocator
from vrnic.db.tables import Device, Host, utcnow


def _rules(client: TestClient, auth: str | None = None, **params: str) -> list[tuple[str, str, str]]:
    headers = {"Authorization": auth} if auth else {}
    page = client.get("/api/v1/security-rules", params=params, headers=headers)
    assert page.status_code == 200, page.text
    return [(r["tenant"], r["action"], r["peer_tenant"]) for r in page.json()["items"]]


def test_a_tenant_manages_its_own_vpcs_rules_and_the_operator_anyones(
        client: TestClient, make_tenant: Callable[..., dict[str, str]]) -> None:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    added = client.post("/api/v1/security-rules", json={"action": "allow", "peer_tenant": "globex"},
                        headers={"Authorization": acme["auth"]})
    assert added.status_code == 201
    rule = added.json()
    assert (rule["tenant"], rule["action"], rule["peer_tenant"]) == ("acme", "allow", "globex")
    assert added.headers["Location"] == f"/api/v1/security-rules/{rule['id']}"
    denied = client.post("/api/v1/security-rules", json={"tenant": "globex", "action": "deny", "peer_tenant": "*"})
    assert denied.status_code == 201 and denied.json()["tenant"] == "globex"

    assert _rules(client, acme["auth"]) == [("acme", "allow", "globex")]  # its own only
    assert _rules(client, globex["auth"]) == [("globex", "deny", "*")]
    assert _rules(client) == [("acme", "allow", "globex"), ("globex", "deny", "*")]
    assert _rules(client, tenant="globex") == [("globex", "deny", "*")]
    assert client.get("/api/v1/security-rules", params={"tenant": "nobody"}).status_code == 404

    # refusals
    cases = [
        (acme["auth"], {"tenant": "globex", "action": "allow", "peer_tenant": "acme"}, 403, "permission_denied"),
        (acme["auth"], {"action": "allow", "peer_tenant": "globex"}, 409, "conflict"),
        (acme["auth"], {"action": "allow", "peer_tenant": "acme"}, 400, "invalid_argument"),
        (None, {"action": "allow", "peer_tenant": "acme"}, 400, "invalid_argument"),  # operator: whose?
        (acme["auth"], {"action": "maybe", "peer_tenant": "globex"}, 422, "invalid_request"),
        (acme["auth"], {"action": "allow", "peer_tenant": "Not A Tenant"}, 422, "invalid_request"),
    ]
    for auth, body, status, code in cases:
        response = client.post("/api/v1/security-rules", json=body, headers={"Authorization": auth} if auth else {})
        assert (response.status_code, response.json()["code"]) == (status, code), body

    # another tenant's rule looks like one that does not exist
    other = client.delete(f"/api/v1/security-rules/{rule['id']}", headers={"Authorization": globex["auth"]})
    assert other.status_code == 404
    assert client.delete(f"/api/v1/security-rules/{rule['id']}",
                         headers={"Authorization": acme["auth"]}).status_code == 204
    assert client.delete(f"/api/v1/security-rules/{rule['id']}").status_code == 404
    assert client.delete(f"/api/v1/security-rules/{denied.json()['id']}").status_code == 204
    assert _rules(client) == []

    events = client.get("/api/v1/events", params={"subject": f"security-rule/{rule['id']}"}).json()["items"]
    assert [(e["action"], e["actor"], e["tenant"]) for e in events] == [
        ("security_rule.create", "tenant:acme", "acme"), ("security_rule.delete", "tenant:acme", "acme")]
    assert events[0]["detail"] == {"action": "allow", "peer_tenant": "globex"}
    assert [e["actor"] for e in client.get("/api/v1/events", params={"action": "security_rule.create"},
                                           headers={"Authorization": globex["auth"]}).json()["items"]] == ["operator"]


def _allocate(client: TestClient, tenant: str, **body: object) -> dict[str, str]:
    response = client.post("/api/v1/vrnics", json={"tenant": tenant, "host": "test-host", **body})
    assert response.status_code == 201, response.text
    return dict(response.json())


def _identity(vrnic: dict[str, str], vpc_id: int) -> Identity:
    return Identity(vrnic["id"], vrnic["tenant"], vpc_id, vrnic["virtual_gid"])


def test_the_locator_finds_agents_addresses_and_rules_in_the_database(
        client: TestClient, make_tenant: Callable[..., dict[str, str]], migrated: Engine) -> None:
    cp: ControlPlane = client.app.state.control_plane  # type: ignore[attr-defined]
    acme, globex = make_tenant("acme"), make_tenant("globex")
    del acme, globex
    with migrated.begin() as connection:  # this host's agent URL, and a second host with a RoCE GID
        connection.execute(update(Host).where(Host.name == "test-host").values(api_url="http://10.0.2.15:8470"))
        connection.execute(Host.__table__.insert().values(name="other", api_url="http://10.0.2.16:8470",
                                                          version="0", state="up"))
        other_id = connection.scalar(select(Host.id).where(Host.name == "other"))
        connection.execute(Device.__table__.insert().values(
            host_id=other_id, name="rxe0", driver="verbs", node_guid="x", caps={}, present=True,
            ports=[{"port": 1, "state": "ACTIVE", "mtu": 1024,
                    "gids": [{"index": 1, "gid": "::ffff:10.0.2.16", "type": "RoCE v2"}]}]))
    first = _allocate(client, "acme")
    second = _allocate(client, "acme", virtual_ip="10.0.0.9")
    theirs = _allocate(client, "globex", virtual_ip="10.0.0.9")
    locator = DbLocator(migrated)
    here = AgentRef("test-host", "http://10.0.2.15:8470")
    assert locator.agent_of(first["virtual_gid"]) == here
    assert locator.agent_of(first["virtual_gid"].upper()) == here  # any spelling of the address
    assert locator.agent_of("fd76:726e:1::999") is None  # no such serial
    assert locator.agent_of("fd76:726e:7::1") is None  # a serial, but not that VPC's GID
    assert locator.agent_of("not a gid") is None
    assert locator.agent_of_phys_gid("0000:0000:0000:0000:0000:ffff:0a00:0210") == \
        AgentRef("other", "http://10.0.2.16:8470")
    assert locator.agent_of_phys_gid("::ffff:10.0.2.99") is None

    acme_vpc = client.get("/api/v1/tenants/acme").json()["vpc_id"]
    globex_vpc = client.get("/api/v1/tenants/globex").json()["vpc_id"]
    asker = _identity(first, acme_vpc)
    assert locator.virtual_gid_of_ip(asker, "10.0.0.9") == second["virtual_gid"]  # its own VPC's, not globex's
    assert locator.virtual_gid_of_ip(_identity(theirs, globex_vpc), "10.0.0.9") == theirs["virtual_gid"]
    assert locator.virtual_gid_of_ip(asker, "10.0.0.77") is None
    assert locator.virtual_gid_of_ip(asker, "nonsense") is None

    client.post("/api/v1/security-rules", json={"tenant": "acme", "action": "allow", "peer_tenant": "globex"})
    client.post("/api/v1/security-rules", json={"tenant": "globex", "action": "allow", "peer_tenant": "*"})
    rules = locator.rules()
    assert rules == [SecurityRule("acme", RuleAction.ALLOW, "globex"), SecurityRule("globex", RuleAction.ALLOW, "*")]
    assert decide(asker, _identity(theirs, globex_vpc), rules).allowed  # peered both ways

    locator.audit("peer.refused", asker, _identity(theirs, globex_vpc), {"reason": "test"})
    [event] = client.get("/api/v1/events", params={"action": "peer.refused"}).json()["items"]
    assert (event["actor"], event["subject"], event["tenant"]) == ("daemon", f"vrnic/{first['id']}", "acme")
    assert event["detail"]["reason"] == "test" and event["detail"]["target"]["vrnic_id"] == theirs["id"]

    # a host that is down is named for nothing; a released vRNIC is gone
    cp.inventory.sweep(now=utcnow() + timedelta(hours=1))
    assert locator.agent_of_phys_gid("::ffff:10.0.2.16") is None
    with migrated.begin() as connection:
        connection.execute(update(Host).where(Host.name == "test-host").values(state="down"))
    assert locator.agent_of(first["virtual_gid"]) is None
    cp.inventory.heartbeat()
    assert locator.agent_of(first["virtual_gid"]) == here
    client.delete(f"/api/v1/vrnics/{second['id']}").raise_for_status()
    assert locator.agent_of(second["virtual_gid"]) is None
    assert locator.virtual_gid_of_ip(asker, "10.0.0.9") is None


@pytest.mark.parametrize("cidr", ["10.0.0.0/16", "192.168.0.0/24"])
def test_a_tenants_vpc_cidr_is_shown(client: TestClient, cidr: str) -> None:
    created = client.post("/api/v1/tenants", json={"name": "acme", "vpc_cidr": cidr})
    assert created.status_code == 201 and created.json()["vpc_cidr"] == cidr


def test_a_deleted_tenants_rules_go_with_it(client: TestClient, make_tenant: Callable[..., dict[str, str]]) -> None:
    make_tenant("acme")
    make_tenant("globex")
    for owner in ("acme", "globex"):
        added = client.post("/api/v1/security-rules", json={"tenant": owner, "action": "allow", "peer_tenant": "*"})
        assert added.status_code == 201
    assert client.delete("/api/v1/tenants/acme").status_code == 204
    assert _rules(client) == [("globex", "allow", "*")]
