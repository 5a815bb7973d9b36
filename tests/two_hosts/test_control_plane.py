"""Issue 13's control plane on two real hosts: capacity enforced across two API servers, and liveness.

Both agents run against the one PostgreSQL on host a; b's rxe0 takes B_DEVICE_CAP live vRNICs. The agents
beat every HEARTBEAT_S and call a host down after DOWN_AFTER_S without a beat (rig.AGENT_ENV).
"""

from __future__ import annotations

import signal
import threading
import time

import httpx

from vrnic.lab.two_hosts.rig import DOWN_AFTER_S, HEARTBEAT_S, Rig

from .conftest import B_DEVICE_CAP
from .support import events, eventually, release


def test_two_api_calls_race_for_the_last_slot_of_a_device(rig: Rig) -> None:
    token = rig.make_tenant("racers")
    with rig.client("a") as api:
        devices = [d for d in api.get("/devices").json()["items"] if d["host"] == "b" and d["name"] == "rxe0"]
        live = [v for v in api.get("/vrnics", params={"limit": 100}).json()["items"]
                if v["host"] == "b" and v["device"] == "rxe0" and v["state"] != "released"]
    assert devices and devices[0]["max_vrnics"] == B_DEVICE_CAP, devices
    fillers = [rig.allocate("a", token, host="b") for _ in range(B_DEVICE_CAP - 1 - len(live))]
    start = threading.Barrier(2)
    results: dict[str, httpx.Response] = {}

    def race(via: str) -> None:
        with rig.client(via, token) as api:
            start.wait()
            results[via] = api.post("/vrnics", json={"host": "b", "device": "rxe0"})

    threads = [threading.Thread(target=race, args=(via,)) for via in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    try:
        codes = sorted(r.status_code for r in results.values())
        assert codes == [201, 409], {via: (r.status_code, r.text) for via, r in results.items()}
        loser = next(r for r in results.values() if r.status_code == 409)
        assert "full" in loser.text, loser.text
        with rig.client("b") as api:
            live_now = [v for v in api.get("/vrnics", params={"limit": 100}).json()["items"]
                        if v["host"] == "b" and v["device"] == "rxe0" and v["state"] != "released"]
        assert len(live_now) == B_DEVICE_CAP  # exactly the cap: one winner, no overshoot
    finally:
        winners = [r.json() for r in results.values() if r.status_code == 201]
        release(rig, *fillers, *winners)


def _states(rig: Rig) -> dict[str, str]:
    with rig.client("a") as api:
        return {h["name"]: h["state"] for h in api.get("/hosts").json()["items"]}


def test_agent_killed_with_9_is_marked_down_within_the_heartbeat_window(rig: Rig) -> None:
    token = rig.make_tenant("stranded")
    stranded = rig.allocate("b", token)
    assert _states(rig)["b"] == "up"
    killed_at = time.monotonic()
    assert rig.agents["b"].kill(signal.SIGKILL) == -signal.SIGKILL
    window = DOWN_AFTER_S + 2 * HEARTBEAT_S  # b's last beat may be a beat old; a sweeps once per beat
    assert eventually(lambda: _states(rig)["b"] == "down", timeout=window + 20, every=0.2), "b never marked down"
    took = time.monotonic() - killed_at
    assert took <= window + 2.0, f"b marked down after {took:.1f} s; the window is {window:.0f} s"
    with rig.client("a") as api:
        shown = api.get(f"/vrnics/{stranded['id']}").json()
        assert shown["reachable"] is False and shown["state"] != "released", shown  # kept, never reallocated
        listed = {v["id"]: v for v in api.get("/vrnics", params={"limit": 100}).json()["items"]}
        assert listed[stranded["id"]]["reachable"] is False
        assert all(v["reachable"] for v in listed.values() if v["host"] == "a")
        refused = api.post("/vrnics", headers={"Authorization": f"Bearer {token}"}, json={"host": "b"})
        assert refused.status_code in (409, 503), refused.text  # nothing is placed on a down host
    assert any(e["subject"] == "host/b" for e in events(rig, "host.down"))
    rig.agents["b"].start()  # b comes back: up again, its vRNIC reachable again
    assert eventually(lambda: _states(rig)["b"] == "up", timeout=20)
    assert any(e["subject"] == "host/b" for e in events(rig, "host.up"))
    with rig.client("a") as api:
        assert api.get(f"/vrnics/{stranded['id']}").json()["reachable"] is True
    release(rig, stranded)
