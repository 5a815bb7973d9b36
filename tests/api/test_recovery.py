"""Crash recovery at the API's start (SQLite and PostgreSQL): a new vrnicd process holds again what the database
holds live, with the same attach tokens; vRNICs whose guest was attached are lost (and audited) until the guest
attaches again; what the new backend holds that the database does not is released. The same on real rxe under
kill -9: tests/kernel/test_crash_recovery.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine

from vrnic.api.app import create_app
from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid

AUTH = {"Authorization": "Bearer vro_test-operator-token"}


@contextmanager
def daemon(engine: Engine, settings: DaemonSettings) -> Iterator[tuple[TestClient, BackendService, FakeDriver]]:
    """One vrnicd process: a fresh backend (nothing survives a process) over the shared database."""
    fake = FakeDriver()
    backend = BackendService({VrnicMode.PARAVIRTUAL: fake})
    try:
        with TestClient(create_app(settings, backend, engine=engine), headers=AUTH) as client:
            yield client, backend, fake
    finally:
        backend.close()


def _events(client: TestClient, action: str) -> list[dict[str, Any]]:
    return list(client.get("/api/v1/events", params={"action": action}).json()["items"])


def test_a_restart_holds_live_vrnics_again_marks_attached_ones_lost_and_releases_orphans(
        migrated: Engine, settings: DaemonSettings) -> None:
    with daemon(migrated, settings) as (client, _, fake):
        client.post("/api/v1/tenants", json={"name": "acme"}).raise_for_status()

        def allocate() -> dict[str, Any]:
            created = client.post("/api/v1/vrnics", json={"tenant": "acme"})
            assert created.status_code == 201, created.text
            return created.json()  # type: ignore[no-any-return]

        attached, idle, gone, forced = allocate(), allocate(), allocate(), allocate()
        for vrnic in (attached, forced):
            fake.guest_attached(vrnic["id"])
            assert client.get(f"/api/v1/vrnics/{vrnic['id']}").json()["state"] == "attached"
        client.delete(f"/api/v1/vrnics/{gone['id']}").raise_for_status()
    # the process died: kernel objects and in-memory state gone; the database stays

    with daemon(migrated, settings.model_copy(update={"host_name": "test-host"})) as (client, backend, fake):
        state: Callable[[dict[str, Any]], str] = \
            lambda v: client.get(f"/api/v1/vrnics/{v['id']}").json()["state"]  # noqa: E731
        assert backend.vrnic_ids() == {attached["id"], idle["id"], forced["id"]}
        assert (state(attached), state(idle), state(gone), state(forced)) == ("lost", "allocated", "released", "lost")
        # the guest keeps its token: the new process accepts it
        assert fake.accepts_token(attached["id"], attached["attach"]["token"])
        assert fake.accepts_token(idle["id"], idle["attach"]["token"])
        lost = _events(client, "vrnic.lost")
        assert sorted((e["subject"], e["actor"]) for e in lost) == sorted(
            [(f"vrnic/{attached['id']}", "daemon"), (f"vrnic/{forced['id']}", "daemon")])
        assert {v["id"] for v in client.get("/api/v1/vrnics", params={"state": "lost"}).json()["items"]} == \
            {attached["id"], forced["id"]}
        fake.guest_attached(attached["id"])  # it attaches again and rebuilds its objects
        assert state(attached) == "attached"
        assert client.delete(f"/api/v1/vrnics/{forced['id']}").json()["state"] == "released"  # lost: no guest
        assert forced["id"] not in backend.vrnic_ids()
        # a third process: an allocation the backend made whose commit never happened is an orphan
        orphan = VrnicSpec(id="vr-" + "0" * 32, tenant="acme", vpc_id=1, virtual_gid=make_virtual_gid(1, 999))

    with daemon(migrated, settings) as (client, backend, fake):
        assert state(attached) == "lost"  # type: ignore[misc]  # attached again, then lost with this restart
    fake2 = FakeDriver()
    restarted = BackendService({VrnicMode.PARAVIRTUAL: fake2})
    restarted.create_vrnic(orphan)
    try:
        with TestClient(create_app(settings, restarted, engine=migrated), headers=AUTH) as client:
            assert restarted.vrnic_ids() == {attached["id"], idle["id"]}
            assert [e["subject"] for e in _events(client, "vrnic.orphan_released")] == [f"vrnic/{orphan.id}"]
    finally:
        restarted.close()
