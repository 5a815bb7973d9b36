"""The auth matrix: operator, tenant A, tenant B, no token, bad token, across the resources."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

WHO = ("operator", "tenant_a", "tenant_b", "none", "bad")


@pytest.fixture
def world(client: TestClient, make_tenant: Callable[..., dict[str, str]], operator_token: str) -> dict[str, object]:
    a, b = make_tenant("tenant-a"), make_tenant("tenant-b")
    vrnic_a = client.post("/api/v1/vrnics", json={}, headers={"Authorization": a["auth"]}).json()["id"]
    device = client.get("/api/v1/devices").json()["items"][0]["id"]
    headers = {"operator": {"Authorization": f"Bearer {operator_token}"},
               "tenant_a": {"Authorization": a["auth"]}, "tenant_b": {"Authorization": b["auth"]},
               "none": {"Authorization": ""}, "bad": {"Authorization": "Bearer vrt_not-a-real-token"}}
    return {"vrnic_a": vrnic_a, "device": device, "headers": headers}


# (method, path template, body) -> expected status for operator, tenant A, tenant B, no token, bad token,
# asked in that order on a fresh vRNIC of tenant A (so a 409 for A means: allowed, but the operator changed it).
# The delete row ends in 409 for A: the operator released it first.
MATRIX = [
    ("GET", "/api/v1/vrnics/{vrnic_a}", None, (200, 200, 404, 401, 401)),
    ("GET", "/api/v1/tenants", None, (200, 403, 403, 401, 401)),
    ("GET", "/api/v1/tenants/tenant-a", None, (200, 403, 403, 401, 401)),
    ("POST", "/api/v1/tenants", {"name": "new"}, (201, 403, 403, 401, 401)),
    ("POST", "/api/v1/tenants/tenant-a/tokens", None, (201, 403, 403, 401, 401)),
    ("GET", "/api/v1/devices", None, (200, 403, 403, 401, 401)),
    ("GET", "/api/v1/devices/{device}", None, (200, 403, 403, 401, 401)),
    ("GET", "/api/v1/hosts", None, (200, 403, 403, 401, 401)),
    ("GET", "/api/v1/events", None, (200, 200, 200, 401, 401)),
    ("GET", "/api/v1/vrnics", None, (200, 200, 200, 401, 401)),
    ("POST", "/api/v1/vrnics", {"tenant": "tenant-a"}, (201, 201, 403, 401, 401)),
    ("DELETE", "/api/v1/vrnics/{vrnic_a}", None, (200, 409, 404, 401, 401)),  # A: released by then
]


@pytest.mark.parametrize(("method", "path", "body", "expected"), MATRIX,
                         ids=[f"{m} {p}" for m, p, _, _ in MATRIX])
def test_auth_matrix(client: TestClient, world: dict[str, object], method: str, path: str,
                     body: dict[str, object] | None, expected: tuple[int, ...]) -> None:
    headers: dict[str, dict[str, str]] = world["headers"]  # type: ignore[assignment]
    got = []
    for who in WHO:
        response = client.request(method, path.format(**world), json=body, headers=headers[who])
        got.append(response.status_code)
        if response.status_code >= 400:
            assert response.headers["content-type"] == "application/problem+json", response.text
        if response.status_code == 401:
            assert response.headers["www-authenticate"] == "Bearer"
        if method == "POST" and path == "/api/v1/tenants":
            body = {"name": f"new-{len(got)}"}
    assert dict(zip(WHO, got, strict=True)) == dict(zip(WHO, expected, strict=True))


def test_tenant_lists_show_only_their_own(client: TestClient, world: dict[str, object]) -> None:
    headers: dict[str, dict[str, str]] = world["headers"]  # type: ignore[assignment]
    client.post("/api/v1/vrnics", json={}, headers=headers["tenant_b"])
    ids = {who: [v["tenant"] for v in client.get("/api/v1/vrnics", headers=headers[who]).json()["items"]]
           for who in ("operator", "tenant_a", "tenant_b")}
    assert ids == {"operator": ["tenant-a", "tenant-b"], "tenant_a": ["tenant-a"], "tenant_b": ["tenant-b"]}
    # filtering on another tenant's name shows nothing rather than an error that confirms it exists
    assert client.get("/api/v1/vrnics", params={"tenant": "tenant-a"}, headers=headers["tenant_b"]).json() == \
        {"items": [], "next_cursor": None}
    events_b = client.get("/api/v1/events", headers=headers["tenant_b"]).json()["items"]
    assert events_b and all(e["tenant"] == "tenant-b" for e in events_b)
