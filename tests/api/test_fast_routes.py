"""vrnic.api.fast_routes (issue 14): POST /api/v1/vrnics and DELETE /api/v1/vrnics/{id}, served without FastAPI's
request machinery, answer every request as the declared FastAPI routes do. Each request goes through the app
twice, with the fast routes in front and with them taken out, and the two answers are compared."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vrnic.api.fast_routes import FastAllocateRoute, FastReleaseRoute, FastRoutes, PlainRequestRoute, install

Tenant = dict[str, str]
# what differs between two allocations of the same request
# (the device too: the fake driver spreads vRNICs over its two)
VOLATILE = {"id", "virtual_gid", "virtual_ip", "device", "created_at", "updated_at", "released_at"}
VOLATILE_ATTACH = {"vrnic_id", "virtual_gid", "device", "token"}


def _fast_route(client: TestClient, kind: type[PlainRequestRoute]) -> PlainRequestRoute:
    routes = client.app.state.fast_routes  # type: ignore[attr-defined]
    assert [type(r) for r in routes] == [FastAllocateRoute, FastReleaseRoute]
    return next(r for r in routes if type(r) is kind)


@contextmanager
def _without_fast_routes(client: TestClient) -> Iterator[None]:
    routes = client.app.state.fast_routes  # type: ignore[attr-defined]
    fast = routes[:]
    routes.clear()
    try:
        yield
    finally:
        routes[:] = fast


def _send(client: TestClient, request: dict[str, Any]) -> httpx.Response:
    url = request.get("path", "/api/v1/vrnics") + request.get("query", "")
    return client.request(request.get("method", "POST"), url, content=request.get("content"),
                          headers=request.get("headers", {}))


def _both(client: TestClient, request: dict[str, Any], *, served: bool | None,
          declared_request: dict[str, Any] | None = None) -> tuple[httpx.Response, httpx.Response]:
    """(through the fast routes, through the declared routes alone). served: whether the fast route for the
    request's method served it (True) or passed it on (False); None: it is not that route's at all."""
    route = _fast_route(client, FastReleaseRoute if request.get("method") == "DELETE" else FastAllocateRoute)
    before = (route.served, route.declined)
    fast = _send(client, request)
    expected = {True: (1, 0), False: (0, 1), None: (0, 0)}[served]
    assert (route.served - before[0], route.declined - before[1]) == expected, request
    with _without_fast_routes(client):
        declared = _send(client, declared_request or request)
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
    route = _fast_route(client, FastAllocateRoute)
    served = route.served
    fast = _send(client, _json(acme["auth"], **{"Idempotency-Key": "key-fast"}))
    assert route.served == served + 1
    with _without_fast_routes(client):
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


def _release(auth: str, vrnic_id: str, **request: Any) -> dict[str, Any]:
    return {"method": "DELETE", "path": f"/api/v1/vrnics/{vrnic_id}", "headers": {"Authorization": auth}, **request}


def test_a_plain_release_is_served_fast_and_answered_as_the_declared_route_answers(
        client: TestClient, acme: Tenant, backend: Any) -> None:
    first, second = (_send(client, _json(acme["auth"])).json()["id"] for _ in range(2))
    fast, declared = _both(client, _release(acme["auth"], first), served=True,
                           declared_request=_release(acme["auth"], second))
    assert fast.status_code == declared.status_code == 200
    assert fast.json()["state"] == declared.json()["state"] == "released"
    assert _comparable(fast) == _comparable(declared)
    assert not {first, second} & set(backend.vrnic_ids())  # the backend let both go
    # released again, and one that never was: answered alike
    for vrnic_id in (first, "vr-" + "0" * 32):
        fast, declared = _both(client, _release(acme["auth"], vrnic_id), served=True)
        assert _comparable(fast) == _comparable(declared)
        assert fast.status_code >= 400 or fast.json()["state"] == "released"


@pytest.mark.parametrize("case", ["no token", "unknown token", "force", "unknown query parameter", "bad id"])
def test_every_other_release_goes_to_the_declared_route(client: TestClient, acme: Tenant, case: str) -> None:
    vrnic_id, spare = (_send(client, _json(acme["auth"])).json()["id"] for _ in range(2))
    request, served = {
        "no token": (_release("", vrnic_id), False),
        "unknown token": (_release("Bearer vrt_nobody", vrnic_id), False),
        "force": (_release(acme["auth"], vrnic_id, query="?force=false"), False),
        "unknown query parameter": (_release(acme["auth"], vrnic_id, query="?forse=true"), False),
        "bad id": (_release(acme["auth"], "vr-NOT-HEX"), None),  # not the fast route's path at all
    }[case]
    # the one that succeeds (force=false) is made on a second vRNIC the second time
    second = {**request, "path": request["path"].replace(vrnic_id, spare)} if case == "force" else None
    fast, declared = _both(client, request, served=served, declared_request=second)
    assert _comparable(fast) == _comparable(declared)
    if case == "force":  # a tenant's `force=false` is a plain release
        assert fast.status_code == 200 and fast.json()["state"] == "released"
    else:
        assert fast.status_code >= 400


def test_a_release_of_another_tenants_vrnic_is_refused_alike(
        client: TestClient, acme: Tenant, make_tenant: Callable[..., Tenant]) -> None:
    other = make_tenant("other")
    assert client.get("/api/v1/vrnics", headers={"Authorization": other["auth"]}).status_code == 200
    vrnic_id = _send(client, _json(acme["auth"])).json()["id"]
    fast, declared = _both(client, _release(other["auth"], vrnic_id), served=True)
    assert fast.status_code == 404
    assert _comparable(fast) == _comparable(declared)
    assert client.get(f"/api/v1/vrnics/{vrnic_id}", headers={"Authorization": acme["auth"]}).json()["state"] != \
        "released"


def test_an_unexpected_error_is_the_catch_all_problem_then_raised_for_the_server_to_log(
        client: TestClient, acme: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a daemon bug")

    monkeypatch.setattr(client.app.state.control_plane.vrnics, "allocate", broken)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a daemon bug"):  # raised past the answer, as by Starlette's own
        client.post("/api/v1/vrnics", json={}, headers={"Authorization": acme["auth"]})
    answering = TestClient(client.app, raise_server_exceptions=False)  # what the client gets
    fast, declared = _both(answering, _json(acme["auth"]), served=True)
    assert fast.status_code == 500 and fast.json()["code"] == "internal"
    assert _comparable(fast) == _comparable(declared)


def test_a_client_gone_before_its_body_is_read_gets_nothing_and_nothing_is_done(
        client: TestClient, acme: Tenant) -> None:
    stack_calls: list[object] = []

    async def stack(*args: object) -> None:
        stack_calls.append(args)

    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    route = _fast_route(client, FastAllocateRoute)
    before = (route.served, route.declined)
    scope = {"type": "http", "method": "POST", "path": "/api/v1/vrnics", "root_path": "", "query_string": b"",
             "headers": [(b"authorization", acme["auth"].encode()), (b"content-type", b"application/json")],
             "app": client.app}
    asyncio.run(FastRoutes(client.app, stack)(scope, gone, send))  # type: ignore[arg-type]
    assert sent == [] and stack_calls == [] and (route.served, route.declined) == before


def test_an_app_with_a_request_body_limit_gets_no_fast_routes() -> None:
    app, limited = FastAPI(), FastAPI()
    limited.max_body_size = 1 << 10  # (FastAPI(max_body_size=...) in the versions that have the limit)
    for each in (app, limited):
        install(each)
    assert isinstance(app.build_middleware_stack(), FastRoutes)
    assert not isinstance(limited.build_middleware_stack(), FastRoutes)
