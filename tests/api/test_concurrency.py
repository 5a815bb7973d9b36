"""Concurrent clients over real HTTP: idempotency, quotas and releases hold under races."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import Engine

from vrnic.api.app import create_app
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.daemon import serve_in_thread

CLIENTS = 12


@pytest.fixture
def base(migrated: Engine, settings: DaemonSettings, backend: BackendService,
         operator_token: str) -> Iterator[str]:
    with serve_in_thread(create_app(settings, backend, engine=migrated)) as url:
        yield f"{url}/api/v1"


def _race(request: Callable[[httpx.Client], httpx.Response]) -> list[httpx.Response]:
    """Run request from CLIENTS threads released at the same moment."""
    barrier = threading.Barrier(CLIENTS)

    def one(_: int) -> httpx.Response:
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            return request(client)

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(CLIENTS)))


def _tenant(base: str, operator_token: str, **fields: object) -> dict[str, str]:
    response = httpx.post(f"{base}/tenants", json={"name": "acme", **fields},
                          headers={"Authorization": f"Bearer {operator_token}"})
    response.raise_for_status()
    return {"Authorization": f"Bearer {response.json()['token']}"}


def test_one_idempotency_key_allocates_once_under_a_race(base: str, backend: BackendService,
                                                         operator_token: str) -> None:
    headers = {**_tenant(base, operator_token), "Idempotency-Key": "race-1"}
    responses = _race(lambda c: c.post(f"{base}/vrnics", json={}, headers=headers))
    assert Counter(r.status_code for r in responses) == {201: 1, 200: CLIENTS - 1}
    assert len({r.json()["id"] for r in responses}) == 1
    assert backend.vrnic_ids() == {responses[0].json()["id"]}


def test_the_vrnic_limit_holds_under_a_race(base: str, backend: BackendService, operator_token: str) -> None:
    headers = _tenant(base, operator_token, max_vrnics=5)
    responses = _race(lambda c: c.post(f"{base}/vrnics", json={}, headers=headers))
    assert Counter(r.status_code for r in responses) == {201: 5, 403: CLIENTS - 5}
    assert len(backend.vrnic_ids()) == 5


def test_one_release_wins_a_race(base: str, backend: BackendService, operator_token: str) -> None:
    headers = _tenant(base, operator_token)
    vid = httpx.post(f"{base}/vrnics", json={}, headers=headers).json()["id"]
    responses = _race(lambda c: c.delete(f"{base}/vrnics/{vid}", headers=headers))
    assert Counter(r.status_code for r in responses) == {200: 1, 409: CLIENTS - 1}
    assert all(r.json()["current_state"] == "released" for r in responses if r.status_code == 409)
    assert backend.vrnic_ids() == set()
