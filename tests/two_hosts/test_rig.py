"""The rig itself: one PostgreSQL, two agents that register and survive a database restart, programs on b.

(kill -9 of an agent and its restart: test_multihost.py.)"""

from __future__ import annotations

import time

from vrnic.lab.health import health
from vrnic.lab.two_hosts.rig import Rig


def test_both_agents_serve_one_database(rig: Rig) -> None:
    for host in ("a", "b"):
        assert health(rig.url(host)) == {"status": "ok", "host": host}
    for host in ("a", "b"):  # each API sees both hosts: the registry is the shared database
        with rig.client(host) as api:
            hosts = {h["name"]: h for h in api.get("/hosts").json()["items"]}
        assert {"a", "b"} <= set(hosts), hosts
        assert hosts["b"]["api_url"].startswith(rig.url("b")), hosts["b"]


def test_a_tenant_made_on_a_is_seen_on_b_after_postgres_restarts(rig: Rig) -> None:
    with rig.client("a") as a, rig.client("b") as b:
        made = a.post("/tenants", json={"name": "restart-survivor"})
        assert made.status_code == 201, made.text
        for mode in ("fast", "immediate"):
            seconds = rig.postgres.restart(mode)
            assert seconds < 60
            deadline = time.monotonic() + 30
            while True:  # pool_pre_ping replaces the connections the restart cut
                seen = b.get("/tenants/restart-survivor")
                if seen.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert seen.status_code == 200, (mode, seen.text)
            assert a.get("/tenants/restart-survivor").status_code == 200


def test_guest_programs_run_on_b(rig: Rig) -> None:
    result = rig.run_on_b(["sh", "-c", "echo $VRNIC_LAB_ROLE; cat /sys/class/infiniband/rxe0/ports/1/state"])
    assert result["rc"] == 0, result
    assert str(result["stdout"]).split("\n")[0] == "b"
    assert "ACTIVE" in str(result["stdout"])
