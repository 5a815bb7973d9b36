"""FastAllocateRoute (issue 14): POST /api/v1/vrnics served without FastAPI's request machinery answers every
request as the declared FastAPI route does. Each request goes through the app twice, with the fast route in
front and with it taken out, and the two answers are compared."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from vrnic.api.fast_allocate import FastAllocateRoute

Tenant = dict[str, str]
# what differs between two allocations of the same request
# (the device too: the fake driver spreads vRNICs over its two)
VOLATILE = {"id", "virtual_gid", "virtual_ip", "device", "created_at", "updated_at"}
VOLATILE_ATTACH = {"vrnic_id", "virtual_gid", "device", "token"}


def _fast_route(client: TestClient) -> FastAllocateRoute:
    routes = client.app.router.routes  # type: ignore[attr-defined]
    assert isinstance(routes[0], FastAllocateRoute), "the fast route is first"
    return routes[0]


@contextmanager
def _without_fast_route(client: TestClient) -> Iterator[None]:
    routes = client.app.router.routes  # type: ignore[attr-defined]
    fast = routes.pop(0)
    try:
        yield
    finally:
        routes.insert(0, fast)


def _send(client: TestClient, request: dict[str, Any]) -> httpx.Response:
    return client.request("POST", "/api/v1/vrnics" + request.get("query", ""), content=request.get("content"),
                          headers=request.get("headers", {}))


def _both(client: TestClient, request: dict[str, Any], *, served: bool) -> tuple[httpx.Response, httpx.Response]:
    """(through the fast route, through the FastAPI route alone); asserts whether the fast route served it."""
    route = _fast_route(client)
    before = (route.served, route.declined)
    fast = _send(client, request)
    assert (route.served - before[0], route.declined - before[1]) == ((1, 0) if served else (0, 1)), request
    with _without_fast_route(client):
        declared = _send(client, request)
    return fast, declared


def _comparable(response: httpx.Response) -> tuple[int, dict[str, str], Any]:
    headers = {k: v for k, v in response.headers.items() if k not in {"location", "link", "content-length"}}
    body = response.json()
    if isinstance(body, dict) and "attach" in body:
        body = {k: v for k, v in body.items() if k not in VOLATILE}
        if body["attach"] is not None:
            body["attach"] = {k: v for k, v in body["attach"].items() if k not in VOLATILE_ATTACH}
    return response.status_code, headers, body


def _json(auth: str, content: str = "{}", **headers: str) -> dict[str, Any]:
    base = {"Content-Type": "application/json", "Authorization": auth}
    return {"content": content, "headers": {**base, **headers}}


@pytest.fixture
def acme(client: TestClient, make_tenant: Callable[..., Tenant]) -> Tenant:
    tenant = make_tenant("acme", vpc_id=7)
    # a token is known without a database read once it has been seen
    assert client.get("/api/v1/vrnics", headers={"Authorization": tenant["auth"]}).status_code == 200
    return tenant


def test_a_token_not_seen_yet_is_looked_up_by_the_declared_route_then_served_fast(
        client: TestClient, make_tenant: Callable[..., Tenant]) -> None:
    fresh = make_tenant("fresh")
    fast, declared = _both(client, _json(fresh["auth"]), served=False)
    assert fast.status_code == declared.status_code == 201
    served, _ = _both(client, _json(fresh["auth"]), served=True)
    assert served.status_code == 201


def test_the_plain_request_is_served_fast_and_answered_as_the_declared_route_answers(
        client: TestClient, acme: Tenant) -> None:
    fast, declared = _both(client, _json(acme["auth"], '{"qos": {"rate_cap_mbps": 1000}, "quota": {"max_qps": 8}}'),
                           served=True)
    assert fast.status_code == declared.status_code == 201
    assert _comparable(fast) == _comparable(declared)
    for response in (fast, declared):
        assert response.headers["location"] == f"/api/v1/vrnics/{response.json()['id']}"
        assert response.json()["attach"]["token"]
        # what it answered is what is stored
        stored = client.get(response.headers["location"], headers={"Authorization": acme["auth"]}).json()
        assert {k: v for k, v in stored.items() if k != "attach"} == \
            {k: v for k, v in response.json().items() if k != "attach"}
    assert fast.content.decode().startswith('{"id":"vr-')  # compact JSON, as FastAPI writes it


def test_an_idempotent_replay_is_answered_alike(client: TestClient, acme: Tenant) -> None:
    for key in ("key-fast", "key-declared"):
        first = _send(client, _json(acme["auth"], **{"Idempotency-Key": key}))
        assert first.status_code == 201, first.text
    fast, declared = None, None
    route = _fast_route(client)
    served = route.served
    fast = _send(client, _json(acme["auth"], **{"Idempotency-Key": "key-fast"}))
    assert route.served == served + 1
    with _without_fast_route(client):
        declared = _send(client, _json(acme["auth"], **{"Idempotency-Key": "key-declared"}))
    for response in (fast, declared):
        assert response.status_code == 200 and response.headers["idempotent-replayed"] == "true"
        vrnic_id = response.json()["id"]
        assert response.headers["link"] == f'</api/v1/vrnics/{vrnic_id}/token>; rel="token"'
        assert response.json()["attach"]["token"] is None
    assert _comparable(fast) == _comparable(declared)
    # the same key with another body is refused alike
    fast, declared = _both(client, _json(acme["auth"], '{"engine": "direct"}', **{"Idempotency-Key": "key-fast"}),
                           served=True)
    assert fast.status_code == 409
    assert fast.json()["code"] == declared.json()["code"] == "conflict"


@pytest.mark.parametrize("case", [
    "no token", "basic scheme", "unknown token", "query parameter", "text/plain", "no content type", "bad json",
    "not an object", "unknown field", "wrong type", "empty key", "long key", "non-ascii key", "two keys",
    "empty body",
])
def test_every_other_request_goes_to_the_declared_route(client: TestClient, acme: Tenant, case: str) -> None:
    auth = acme["auth"]
    request = {
        "no token": _json(""),  # (the client's own header is the operator's)
        "basic scheme": _json("Basic " + acme["token"]),
        "unknown token": _json("Bearer vrt_nobody"),
        "query parameter": {**_json(auth), "query": "?forse=true"},
        "text/plain": _json(auth, **{"Content-Type": "text/plain"}),
        "no content type": {"content": "{}", "headers": {"Authorization": auth}},
        "bad json": _json(auth, '{"mode": '),
        "not an object": _json(auth, "[]"),
        "unknown field": _json(auth, '{"bogus": 1}'),
        "wrong type": _json(auth, '{"mode": 5}'),
        "empty key": _json(auth, **{"Idempotency-Key": ""}),
        "long key": _json(auth, **{"Idempotency-Key": "k" * 256}),
        "non-ascii key": {"content": "{}", "headers": [(b"Content-Type", b"application/json"),
                                                       (b"Authorization", auth.encode()),
                                                       (b"Idempotency-Key", "caf\u00e9".encode("latin-1"))]},
        "two keys": {"content": "{}", "headers": [("Content-Type", "application/json"), ("Authorization", auth),
                                                  ("Idempotency-Key", "a"), ("Idempotency-Key", "b")]},
        "empty body": _json(auth, ""),
    }[case]
    fast, declared = _both(client, request, served=False)
    if case == "two keys":  # FastAPI takes one of them and allocates: the second time is that key's replay
        assert (fast.status_code, declared.status_code) == (201, 200)
        assert fast.json()["id"] == declared.json()["id"]
        return
    assert fast.status_code >= 400
    assert _comparable(fast) == _comparable(declared)


def test_refusals_of_the_allocation_itself_come_from_the_problem_handlers(
        client: TestClient, acme: Tenant, make_tenant: Callable[..., Tenant]) -> None:
    make_tenant("other")
    for request in (_json(acme["auth"], '{"tenant": "other"}'),  # a tenant allocates only for itself
                    _json(client.headers["Authorization"])):  # the operator must name a tenant
        fast, declared = _both(client, request, served=True)
        assert fast.status_code in (400, 403)
        assert fast.headers["content-type"] == "application/problem+json"
        assert _comparable(fast) == _comparable(declared)


def test_other_methods_on_the_path_are_not_its_own(client: TestClient, acme: Tenant) -> None:
    listed = client.get("/api/v1/vrnics", headers={"Authorization": acme["auth"]})
    assert listed.status_code == 200
    refused = client.put("/api/v1/vrnics", headers={"Authorization": acme["auth"]})
    assert refused.status_code == 405
    assert set(refused.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
