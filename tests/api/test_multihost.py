"""Several hosts on one database: heartbeat and down hosts, placement by capacity, the race for a device's last
slot, vRNICs of other hosts through their agents (real HTTP between two served apps), and virtual IPs.

Each "host" is an app of its own (its own engine, FakeDriver backend and host name) served over HTTP, as
two `vrnic daemon` processes would be; both are registered in the same SQLite file or PostgreSQL database.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, select, text, update

from vrnic.api.app import create_app
from vrnic.api.controlplane import ControlPlane
from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import serve_in_thread
from vrnic.db.engine import make_engine
from vrnic.db.tables import Device, Host, utcnow

OPERATOR = "vro_multi-host-operator"
AUTH = {"Authorization": f"Bearer {OPERATOR}"}
WINDOW_S = 6.0  # heartbeat_interval_s 2 x 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    """One host: its served API, its control plane and its (fake) backend."""

    name: str
    url: str  # base URL; the API is url + /api/v1
    cp: ControlPlane
    backend: BackendService
    stop: Callable[[], None]

    @property
    def api(self) -> str:
        return f"{self.url}/api/v1"

    @property
    def fake(self) -> FakeDriver:
        driver = self.backend.driver(VrnicMode.PARAVIRTUAL)
        assert isinstance(driver, FakeDriver)
        return driver

    def post(self, path: str, body: dict[str, Any], auth: dict[str, str] = AUTH) -> httpx.Response:
        return httpx.post(f"{self.api}{path}", json=body, headers=auth, timeout=60)


@pytest.fixture
def cluster(migrated: Engine, database_url: str, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """cluster(name, devices=2, **settings) starts a host; all stop at the end."""
    with ExitStack() as stack:

        def start(name: str, devices: int = 2, **fields: Any) -> Node:
            port = _free_port()
            fields = {"heartbeat_interval_s": 3600,  # unless asked: the tests beat and sweep themselves
                      "host_down_after_s": WINDOW_S, **fields}
            settings = DaemonSettings(state_dir=tmp_path / name, operator_token=SecretStr(OPERATOR), host_name=name,
                                      paravirtual_driver="fake", sriov_driver=None,
                                      advertise_url=f"http://127.0.0.1:{port}", **fields)
            backend = BackendService({VrnicMode.PARAVIRTUAL: FakeDriver(device_count=devices)})
            engine = make_engine(database_url)
            app = create_app(settings, backend, engine=engine)
            served = ExitStack()
            url = served.enter_context(serve_in_thread(app, port=port))
            stack.callback(engine.dispose)
            stack.callback(backend.close)
            stack.callback(served.close)
            return Node(name, url, app.state.control_plane, backend, served.close)

        yield start


@pytest.fixture
def tenant(cluster: Callable[..., Node]) -> Callable[..., dict[str, str]]:
    def make(node: Node, name: str = "acme", **fields: Any) -> dict[str, str]:
        created = node.post("/tenants", {"name": name, **fields})
        assert created.status_code == 201, created.text
        return {"Authorization": f"Bearer {created.json()['token']}"}

    return make


def _events(node: Node, action: str) -> list[dict[str, Any]]:
    page = httpx.get(f"{node.api}/events", params={"action": action, "limit": 500}, headers=AUTH).json()
    return list(page["items"])


# -- liveness -------------------------------------------------------------------------------------

def test_a_silent_host_is_marked_down_after_the_window_and_up_when_it_beats(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]]) -> None:
    a, b = cluster("host-a"), cluster("host-b")
    acme = tenant(a)
    on_b = a.post("/vrnics", {"host": "host-b"}, acme).json()
    assert on_b["host"] == "host-b" and on_b["reachable"] is True
    last_seen = utcnow()
    b.cp.inventory.heartbeat(now=last_seen)

    assert a.cp.inventory.sweep(now=last_seen + timedelta(seconds=WINDOW_S - 0.5)) == []  # within the window
    assert a.cp.inventory.sweep(now=last_seen + timedelta(seconds=WINDOW_S + 0.5)) == ["host-b"]
    assert a.cp.inventory.sweep(now=last_seen + timedelta(seconds=WINDOW_S + 60)) == []  # once
    # b sweeping with the same clock does not mark itself: it is the one beating
    assert b.cp.inventory.sweep(now=last_seen + timedelta(seconds=WINDOW_S + 60)) == ["host-a"]
    a.cp.inventory.heartbeat()

    hosts = {h["name"]: h for h in httpx.get(f"{a.api}/hosts", headers=AUTH).json()["items"]}
    assert hosts["host-b"]["state"] == "down" and hosts["host-a"]["state"] == "up"
    [down] = [e for e in _events(a, "host.down") if e["subject"] == "host/host-b"]
    assert down["actor"] == "daemon" and down["detail"]["by"] == "host-a"

    # its vRNICs are kept, shown unreachable, and nothing else lands there
    shown = httpx.get(f"{a.api}/vrnics/{on_b['id']}", headers=acme).json()
    assert shown["reachable"] is False and shown["state"] == "allocated" and shown["host"] == "host-b"
    listed = httpx.get(f"{a.api}/vrnics", headers=acme).json()["items"]
    assert [(v["id"], v["reachable"]) for v in listed] == [(on_b["id"], False)]
    refused = a.post("/vrnics", {"host": "host-b"}, acme)
    assert refused.status_code == 503 and refused.json()["code"] == "unavailable"
    assert "host host-b is down" in refused.json()["detail"]
    placed = [a.post("/vrnics", {}, acme).json()["host"] for _ in range(3)]
    assert placed == ["host-a"] * 3
    release = httpx.delete(f"{a.api}/vrnics/{on_b['id']}", headers=acme)
    assert release.status_code == 503 and "host host-b is down" in release.json()["detail"]
    assert on_b["id"] in b.backend.vrnic_ids()  # never reallocated, never dropped

    b.cp.inventory.heartbeat()
    assert httpx.get(f"{a.api}/hosts/host-b", headers=AUTH).json()["state"] == "up"
    assert [e["subject"] for e in _events(a, "host.up")] == ["host/host-a", "host/host-b"]
    assert httpx.get(f"{a.api}/vrnics/{on_b['id']}", headers=acme).json()["reachable"] is True
    assert httpx.delete(f"{a.api}/vrnics/{on_b['id']}", headers=acme).json()["state"] == "released"
    assert on_b["id"] not in b.backend.vrnic_ids()


def test_a_host_beats_and_sweeps_while_an_allocation_on_it_is_still_open(
        cluster: Callable[..., Node], migrated: Engine) -> None:
    """An allocation on a host keeps its transaction open through the backend call (seconds, on a slow agent), and
    its vRNIC row's foreign key holds a KEY SHARE lock on the host's row all that time (PostgreSQL). The beat and
    the sweep must not wait for it: a beat that waits is a host the others mark down."""
    if migrated.dialect.name != "postgresql":
        pytest.skip("SQLite has no row locks: its writers queue on one lock")
    a, b = cluster("host-a"), cluster("host-b")
    # (the pool is left last: a beat still waiting on the lock gets it when the allocation's connection goes)
    with ThreadPoolExecutor(2) as pool, migrated.connect() as allocation:
        allocation.execute(text("SELECT 1 FROM hosts WHERE name = 'host-b' FOR KEY SHARE"))  # what the FK check takes
        beat = pool.submit(b.cp.inventory.heartbeat)
        sweep = pool.submit(a.cp.inventory.sweep, utcnow() + timedelta(seconds=WINDOW_S + 1))
        beat.result(timeout=20)
        assert sweep.result(timeout=20) == ["host-b"]  # the sweep did not wait either (its clock is ahead)


def test_the_daemons_own_heartbeat_beats_and_sweeps(cluster: Callable[..., Node], migrated: Engine) -> None:
    """The lifespan task, not the test, beats every heartbeat_interval_s and marks a silent host down."""
    with migrated.begin() as connection:  # a host that stopped beating a minute ago
        connection.execute(Host.__table__.insert().values(name="silent", version="0", state="up",
                                                          last_seen_at=utcnow() - timedelta(minutes=1)))
    a = cluster("host-a", heartbeat_interval_s=0.1, host_down_after_s=30)
    first = httpx.get(f"{a.api}/hosts/host-a", headers=AUTH).json()["last_seen_at"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        hosts = {h["name"]: h for h in httpx.get(f"{a.api}/hosts", headers=AUTH).json()["items"]}
        if hosts["silent"]["state"] == "down" and hosts["host-a"]["last_seen_at"] != first:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no beat or no sweep within 20 s: {hosts}")
    assert hosts["host-a"]["state"] == "up"
    assert [e["subject"] for e in _events(a, "host.down")] == ["host/silent"]


def test_hosts_list_in_the_cli_shows_state(cluster: Callable[..., Node], monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from vrnic.cli.main import app as cli

    a, _ = cluster("host-a"), cluster("host-b")
    a.cp.inventory.sweep(now=utcnow() + timedelta(seconds=WINDOW_S + 1))
    monkeypatch.setenv("VRNIC_API_URL", a.url)
    monkeypatch.setenv("VRNIC_API_TOKEN", OPERATOR)
    result = CliRunner().invoke(cli, ["hosts", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "state" in result.stdout
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if "host-" in line}
    assert " down " in lines["host-b"] and " up " in lines["host-a"]


# -- placement --------------------------------------------------------------------------------------

def test_placement_spreads_by_load_over_the_up_hosts_and_honours_host(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]]) -> None:
    a, b = cluster("host-a"), cluster("host-b")
    acme = tenant(a)
    placed = [a.post("/vrnics", {}, acme).json() for _ in range(4)]
    assert sorted((v["host"], v["device"]) for v in placed) == [
        ("host-a", "fake0"), ("host-a", "fake1"), ("host-b", "fake0"), ("host-b", "fake1")]
    # ties go by host name, then device name: the order is the same on every API server
    assert [(v["host"], v["device"]) for v in placed] == [
        ("host-a", "fake0"), ("host-a", "fake1"), ("host-b", "fake0"), ("host-b", "fake1")]
    assert {v["id"] for v in placed if v["host"] == "host-b"} == b.backend.vrnic_ids()
    assert {v["id"] for v in placed if v["host"] == "host-a"} == a.backend.vrnic_ids()

    pinned = a.post("/vrnics", {"host": "host-b", "device": "fake1"}, acme).json()
    assert (pinned["host"], pinned["device"]) == ("host-b", "fake1") and pinned["id"] in b.backend.vrnic_ids()
    devices = {(d["host"], d["name"]): d["live_vrnics"] for d in httpx.get(f"{a.api}/devices", headers=AUTH)
               .json()["items"]}
    assert devices == {("host-a", "fake0"): 1, ("host-a", "fake1"): 1, ("host-b", "fake0"): 1,
                       ("host-b", "fake1"): 2}
    unknown = a.post("/vrnics", {"host": "host-z"}, acme)
    assert unknown.status_code == 404 and unknown.json()["detail"] == "no host host-z"
    no_device = a.post("/vrnics", {"host": "host-b", "device": "fake7"}, acme)
    assert no_device.status_code == 422 and no_device.json()["code"] == "not_supported"


def test_a_full_device_is_a_409_and_a_release_frees_its_slot(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]]) -> None:
    a = cluster("host-a", devices=1, device_max_vrnics=2)
    acme = tenant(a)
    first, second = (a.post("/vrnics", {}, acme) for _ in range(2))
    assert first.status_code == second.status_code == 201
    full = a.post("/vrnics", {}, acme)
    assert full.status_code == 409 and full.json()["current_state"] == "full"
    assert "device full" in full.json()["detail"] and "host-a/fake0" in full.json()["detail"]
    assert len(a.backend.vrnic_ids()) == 2  # nothing was created for the refused one
    assert httpx.delete(f"{a.api}/vrnics/{first.json()['id']}", headers=acme).status_code == 200
    assert a.post("/vrnics", {}, acme).status_code == 201
    device = httpx.get(f"{a.api}/devices", headers=AUTH).json()["items"][0]
    assert device["max_vrnics"] == 2 and device["live_vrnics"] == 2


ROUNDS = 15


def test_two_hosts_racing_for_the_last_slot_of_a_device_exactly_one_wins(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]], migrated: Engine) -> None:
    """Each round the device host-a/fake0 has one slot left; host-a allocates it locally while host-b's API
    allocates it through host-a's agent, both released by one barrier. Exactly one wins every round."""
    a, b = cluster("host-a", devices=1), cluster("host-b", devices=1)
    acme = tenant(a)
    headers = [acme, acme]
    nodes = [a, b]
    with migrated.begin() as connection:
        device_id = connection.scalar(select(Device.id).join(Host).where(Host.name == "host-a"))
    outcomes: Counter[str] = Counter()
    for round_ in range(ROUNDS):
        with migrated.begin() as connection:
            connection.execute(update(Device).where(Device.id == device_id).values(max_vrnics=round_ + 1))
        barrier = threading.Barrier(2)

        def allocate(i: int, barrier: threading.Barrier = barrier) -> httpx.Response:
            with httpx.Client(timeout=60) as client:
                barrier.wait()
                return client.post(f"{nodes[i].api}/vrnics", json={"host": "host-a", "device": "fake0"},
                                   headers=headers[i])

        with ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(allocate, range(2)))
        codes = sorted(r.status_code for r in responses)
        assert codes == [201, 409], [r.text for r in responses]
        loser = next(r for r in responses if r.status_code == 409).json()
        assert loser["current_state"] == "full" and "device full" in loser["detail"]
        outcomes["host-a" if responses[0].status_code == 201 else "host-b"] += 1
        assert len(a.backend.vrnic_ids()) == round_ + 1  # the loser left nothing behind
    assert b.backend.vrnic_ids() == set()
    with migrated.connect() as connection:
        live = connection.scalar(text("SELECT count(*) FROM vrnics WHERE state != 'released' AND device_id = :d"),
                                 {"d": device_id})
    assert live == ROUNDS
    assert sum(outcomes.values()) == ROUNDS


# -- vRNICs of another host, through its agent -----------------------------------------------------

def test_a_remote_vrnic_lives_released_and_shaped_through_its_hosts_agent(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]]) -> None:
    a, b = cluster("host-a"), cluster("host-b")
    acme = tenant(a)
    created = a.post("/vrnics", {"host": "host-b", "qos": {"rate_cap_mbps": 100}}, acme)
    assert created.status_code == 201
    vrnic = created.json()
    assert vrnic["host"] == "host-b" and vrnic["attach"]["token"] and vrnic["virtual_ip"] == "10.0.0.1"
    assert vrnic["id"] in b.backend.vrnic_ids() and vrnic["id"] not in a.backend.vrnic_ids()
    [event] = [e for e in _events(a, "vrnic.allocate") if e["subject"] == f"vrnic/{vrnic['id']}"]
    assert event["detail"]["host"] == "host-b"

    # what b's backend observes decides a release asked of a
    b.fake.guest_attached(vrnic["id"])
    refused = httpx.delete(f"{a.api}/vrnics/{vrnic['id']}", headers=acme)
    assert refused.status_code == 409 and refused.json()["current_state"] == "attached"
    assert httpx.get(f"{a.api}/vrnics/{vrnic['id']}", headers=acme).json()["state"] == "attached"
    b.fake.guest_detached(vrnic["id"])
    assert b.cp.vrnics.record_observed() == 1  # what b's heartbeat does: its observations reach the database
    assert httpx.get(f"{a.api}/vrnics/{vrnic['id']}", headers=acme).json()["state"] == "detached"

    changed = httpx.patch(f"{a.api}/vrnics/{vrnic['id']}", json={"qos": {"rate_cap_mbps": 300}}, headers=acme)
    assert changed.status_code == 200 and changed.json()["qos"]["rate_cap_mbps"] == 300
    assert b.fake.qos[vrnic["id"]].rate_cap_mbps == 300
    counters = httpx.get(f"{a.api}/vrnics/{vrnic['id']}/counters", headers=acme)
    assert counters.status_code == 200 and counters.json()["shaped"] is False

    reissued = httpx.post(f"{a.api}/vrnics/{vrnic['id']}/token", headers=acme)
    assert reissued.status_code == 200 and b.fake.accepts_token(vrnic["id"], reissued.json()["attach"]["token"])
    assert reissued.json()["attach"]["token"] != vrnic["attach"]["token"]

    released = httpx.delete(f"{a.api}/vrnics/{vrnic['id']}", headers=acme)
    assert released.status_code == 200 and released.json()["state"] == "released"
    assert b.backend.vrnic_ids() == set()
    actions = [e["action"] for e in httpx.get(f"{a.api}/events", params={"subject": f"vrnic/{vrnic['id']}"},
                                              headers=AUTH).json()["items"]]
    assert actions == ["vrnic.allocate", "vrnic.attach", "vrnic.detach", "vrnic.qos", "vrnic.token_reissue",
                       "vrnic.release"]
    attach = [e for e in _events(a, "vrnic.attach") if e["subject"] == f"vrnic/{vrnic['id']}"]
    assert attach[0]["actor"] == "daemon"


def test_agent_errors_come_back_as_the_same_errors_and_a_dead_agent_is_a_503(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]]) -> None:
    a, b = cluster("host-a"), cluster("host-b")
    acme = tenant(a)
    vrnic = a.post("/vrnics", {"host": "host-b"}, acme).json()
    b.backend.release_vrnic(vrnic["id"])  # gone from b's backend behind the control plane's back
    missing = httpx.patch(f"{a.api}/vrnics/{vrnic['id']}", json={"qos": {"rate_cap_mbps": 5}}, headers=acme)
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    assert missing.json()["detail"] == f"host host-b: no vRNIC {vrnic['id']} in the backend"
    second = a.post("/vrnics", {"host": "host-b", "device": "fake1", "quota": {"max_qps": 1}}, acme)
    assert second.status_code == 201

    # the agent routes take the agent token only
    for headers in ({}, {"Authorization": acme["Authorization"]}, {"Authorization": "Bearer nope"}):
        denied = httpx.get(f"{b.url}/agent/v1/attached", headers=headers)
        assert denied.status_code == 401 and denied.json()["code"] == "unauthenticated"
    assert httpx.get(f"{b.url}/agent/v1/attached", headers=AUTH).json() == {"vrnic_ids": []}

    b.stop()  # the agent dies; its host is still marked up until the sweep
    dead = httpx.delete(f"{a.api}/vrnics/{second.json()['id']}", headers=acme)
    assert dead.status_code == 503 and dead.json()["code"] == "unavailable"
    assert "the agent of host host-b" in dead.json()["detail"] and "unreachable" in dead.json()["detail"]
    assert httpx.get(f"{a.api}/vrnics/{second.json()['id']}", headers=acme).json()["state"] == "allocated"
    failed = a.post("/vrnics", {"host": "host-b"}, acme)
    assert failed.status_code == 503
    assert len(httpx.get(f"{a.api}/vrnics", headers=acme).json()["items"]) == 2  # the failed one left no row


def test_different_agent_tokens_are_refused_clearly(cluster: Callable[..., Node],
                                                    tenant: Callable[..., dict[str, str]]) -> None:
    a = cluster("host-a", agent_token=SecretStr("vra_one"))
    cluster("host-b", agent_token=SecretStr("vra_two"))
    acme = tenant(a)
    refused = a.post("/vrnics", {"host": "host-b"}, acme)
    assert refused.status_code == 503 and "refused this host's agent token" in refused.json()["detail"]


# -- virtual IPs ------------------------------------------------------------------------------------

def test_virtual_ips_come_from_the_tenants_vpc(cluster: Callable[..., Node],
                                               tenant: Callable[..., dict[str, str]]) -> None:
    a = cluster("host-a")
    acme = tenant(a, "acme", vpc_cidr="10.9.0.0/29")  # host addresses .1 to .6
    globex = tenant(a, "globex")

    def allocate(auth: dict[str, str], **body: Any) -> httpx.Response:
        return a.post("/vrnics", body, auth)

    assert httpx.get(f"{a.api}/tenants/acme", headers=AUTH).json()["vpc_cidr"] == "10.9.0.0/29"
    first, second = allocate(acme).json(), allocate(acme).json()
    assert (first["virtual_ip"], second["virtual_ip"]) == ("10.9.0.1", "10.9.0.2")
    assert allocate(acme, virtual_ip="10.9.0.5").json()["virtual_ip"] == "10.9.0.5"
    taken = allocate(acme, virtual_ip="10.9.0.5")
    assert taken.status_code == 409 and taken.json()["current_state"] == "taken"
    for wrong, why in (("10.9.1.1", "outside the VPC's 10.9.0.0/29"), ("10.9.0.0", "network or broadcast"),
                       ("10.9.0.7", "network or broadcast")):
        refused = allocate(acme, virtual_ip=wrong)
        assert refused.status_code == 400 and why in refused.json()["detail"]
    assert [allocate(acme).json()["virtual_ip"] for _ in range(3)] == ["10.9.0.6", "10.9.0.3", "10.9.0.4"]
    full = allocate(acme)
    assert full.status_code == 409 and "no free virtual IP left" in full.json()["detail"]
    assert len(a.backend.vrnic_ids()) == 6  # refusals come before the backend is asked
    assert allocate(globex, virtual_ip="10.0.0.5").json()["virtual_ip"] == "10.0.0.5"  # its own VPC
    httpx.delete(f"{a.api}/vrnics/{first['id']}", headers=acme).raise_for_status()
    assert allocate(acme).json()["virtual_ip"] == "10.9.0.1"  # released: free again
    bad = a.post("/tenants", {"name": "initech", "vpc_cidr": "10.9.0.1/29"})
    assert bad.status_code == 422


def test_concurrent_allocations_of_one_tenant_get_distinct_virtual_ips(
        cluster: Callable[..., Node], tenant: Callable[..., dict[str, str]]) -> None:
    a, b = cluster("host-a"), cluster("host-b")
    acme = tenant(a)
    barrier = threading.Barrier(8)

    def allocate(i: int) -> httpx.Response:
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            return client.post(f"{(a, b)[i % 2].api}/vrnics", json={}, headers=acme)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(allocate, range(8)))
    assert [r.status_code for r in responses] == [201] * 8, [r.text for r in responses]
    assert sorted(r.json()["virtual_ip"] for r in responses) == [f"10.0.0.{i}" for i in range(1, 9)]
