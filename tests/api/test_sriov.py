"""SR-IOV through the database, the REST API and the CLI (SQLite and PostgreSQL): the real SriovManager,
SriovDriver, DbVfStateStore and event log over in-memory kernel edges. The same flows on real netdevsim VFs:
tests/kernel/test_sriov_api.py."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, insert, select, text
from sriov_fakes import PF, MemoryKernel, sriov_driver
from typer.testing import CliRunner

from vrnic.api.app import create_app
from vrnic.backend.driver import load_driver
from vrnic.backend.service import BackendService
from vrnic.cli.main import app as cli
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import serve_in_thread
from vrnic.db.tables import Host, SriovVf, Tenant, Vrnic
from vrnic.db.unit_of_work import Database
from vrnic.db.vf_store import DbVfEventLog, DbVfStateStore
from vrnic.errors import NotFound
from vrnic.sriov.vf_types import CLEAN_VF, Allocation, EventKind, LinkState, VfAddress, VfConfig, VfEvent

HOST = "test-host"


@pytest.fixture
def kernel() -> MemoryKernel:
    return MemoryKernel()


@pytest.fixture
def sriov_settings(settings: DaemonSettings) -> DaemonSettings:
    return settings.model_copy(update={"sriov_reconcile_interval": 0})


@pytest.fixture
def sriov_backend(migrated: Engine, kernel: MemoryKernel) -> Iterator[BackendService]:
    backend = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake"),
                              VrnicMode.SRIOV: sriov_driver(migrated, HOST, kernel)})
    yield backend
    backend.close()


@pytest.fixture
def api(migrated: Engine, sriov_settings: DaemonSettings, sriov_backend: BackendService) -> Iterator[TestClient]:
    app = create_app(sriov_settings, sriov_backend, engine=migrated)
    with TestClient(app, headers={"Authorization": f"Bearer {sriov_settings.operator_token.get_secret_value()}"
                                  }) as client:  # type: ignore[union-attr]
        yield client


@pytest.fixture
def tenant(api: TestClient) -> Callable[[str, int], dict[str, str]]:
    def make(name: str, vpc_id: int) -> dict[str, str]:
        created = api.post("/api/v1/tenants", json={"name": name, "vpc_id": vpc_id})
        assert created.status_code == 201, created.text
        return {"Authorization": f"Bearer {created.json()['token']}"}

    return make


# -- the store on its own -------------------------------------------------------------------------

def _vrnic_row(engine: Engine, public_id: str, tenant: str = "red") -> None:
    with engine.begin() as c:
        host = c.scalar(select(Host.id).where(Host.name == HOST))
        if host is None:
            host = c.execute(insert(Host).values(name=HOST, version="0")).inserted_primary_key[0]  # type: ignore[index]
        tenant_id = c.scalar(select(Tenant.id).where(Tenant.name == tenant))
        if tenant_id is None:
            tenant_id = c.execute(insert(Tenant).values(name=tenant, vpc_id=100 + len(tenant), default_quota={})
                                  ).inserted_primary_key[0]  # type: ignore[index]
        c.execute(insert(Vrnic).values(public_id=public_id, tenant_id=tenant_id, mode="sriov", state="allocated",
                                       host_id=host, device_name=PF, quota={}, qos={}, virtual_gid=public_id))


def test_store_round_trips_allocations_linked_to_vrnic_rows(migrated: Engine) -> None:
    store = DbVfStateStore(migrated, HOST)
    assert store.list() == [] and store.get("vr-1") is None  # no host registered yet: nothing
    _vrnic_row(migrated, "vr-1")
    _vrnic_row(migrated, "vr-2", tenant="blue")
    config = VfConfig(mac="02:00:00:00:00:01", vlan=100, qos=3, max_tx_rate=1000, min_tx_rate=100,
                      link_state=LinkState.DISABLE)
    first = Allocation("vr-1", "red", VfAddress(PF, 2), config)
    second = Allocation("vr-2", "blue", VfAddress(PF, 0), VfConfig(mac="02:00:00:00:00:02", vlan=200))
    store.put(first)
    store.put(second)
    assert store.get("vr-1") == first
    assert store.list() == [second, first]  # by PF and VF index
    moved = Allocation("vr-1", "red", VfAddress(PF, 2), config, netns="ctr1")
    store.put(moved)  # put replaces
    assert store.get("vr-1") == moved
    store.put(Allocation("vr-1", "red", VfAddress(PF, 2), config, vanished=True))
    assert store.get("vr-1").vanished and store.get("vr-1").netns is None  # type: ignore[union-attr]
    with migrated.connect() as c:
        assert c.execute(select(SriovVf.vf_index, SriovVf.link_state, SriovVf.vanished)
                         .order_by(SriovVf.vf_index)).all() == [(0, "auto", False), (2, "disable", True)]
    store.delete("vr-1")
    store.delete("vr-1")  # unknown: a no-op
    assert store.list() == [second]
    with pytest.raises(NotFound, match="no vRNIC vr-9"):
        store.put(Allocation("vr-9", "red", VfAddress(PF, 1), CLEAN_VF))


def test_writes_in_a_unit_of_work_commit_or_roll_back_with_it(migrated: Engine) -> None:
    store = DbVfStateStore(migrated, HOST)
    events, db = DbVfEventLog(store), Database(migrated)
    _vrnic_row(migrated, "vr-1")
    allocation = Allocation("vr-1", "red", VfAddress(PF, 1), VfConfig(mac="02:00:00:00:00:01", vlan=100))
    seen_by_undo: list[Allocation | None] = []
    with pytest.raises(RuntimeError), store.working_in(lambda: db.write("tenant:red")) as uow:
        store.put(allocation)
        events(VfEvent(EventKind.ALLOCATED, PF, 1, "vr-1", {"vlan": "100"}))
        assert store.get("vr-1") == allocation and store.list() == [allocation]  # visible inside its transaction
        with migrated.execution_options(vrnic_read_only=True).connect() as other:  # and only there
            assert other.execute(text("SELECT count(*) FROM sriov_vfs")).scalar() == 0
        uow.on_failure(lambda: seen_by_undo.append(store.get("vr-1")))
        raise RuntimeError("the vRNIC row could not be committed")
    # The undo (which resets the VF in the control plane) still found the allocation after the rollback.
    assert seen_by_undo == [allocation]
    with migrated.connect() as c:
        assert c.execute(text("SELECT count(*) FROM events WHERE action = 'vf_allocated'")).scalar() == 0
        assert c.execute(text("SELECT count(*) FROM sriov_vfs")).scalar() == 0
    assert store.get("vr-1") is None and store.list() == []  # nothing outlives the unit of work
    with store.working_in(lambda: db.write("tenant:red")):
        store.put(allocation)
        events(VfEvent(EventKind.ALLOCATED, PF, 1, "vr-1", {"vlan": "100"}))
    assert store.get("vr-1") == allocation
    with migrated.connect() as c:
        row = c.execute(text("SELECT actor, subject, tenant_id, detail FROM events WHERE action = 'vf_allocated'")
                        ).one()
        red = c.scalar(select(Tenant.id).where(Tenant.name == "red"))
    assert (row[0], row[1], row[2]) == ("tenant:red", f"vf/{PF}/1", red)
    detail = row[3] if isinstance(row[3], dict) else json.loads(row[3])
    assert detail == {"vlan": "100", "vrnic_id": "vr-1"}
    events(VfEvent(EventKind.NUM_VFS_CHANGED, PF, None, None, {"from": "4", "to": "2"}))  # no unit of work: daemon's
    with migrated.connect() as c:
        assert c.execute(text("SELECT actor, subject, tenant_id FROM events WHERE action = 'pf_num_vfs_changed'")
                         ).one() == ("daemon", f"pf/{PF}", None)


def test_only_the_unit_of_works_thread_writes_through_it_and_the_next_one_waits(migrated: Engine) -> None:
    import threading

    store, db = DbVfStateStore(migrated, HOST), Database(migrated)
    _vrnic_row(migrated, "vr-1")
    allocation = Allocation("vr-1", "red", VfAddress(PF, 1), VfConfig(mac="02:00:00:00:00:01", vlan=100))
    seen: list[list[Allocation]] = []
    next_began = threading.Event()

    def next_unit_of_work() -> None:
        with store.working_in(lambda: db.write("tenant:blue")):
            next_began.set()
            seen.append(store.list())

    reader = threading.Thread(target=lambda: seen.append(store.list()))
    writer = threading.Thread(target=next_unit_of_work)
    with store.working_in(lambda: db.write("tenant:red")):
        store.put(allocation)
        reader.start()
        reader.join(5)
        assert seen == [[]]  # another thread reads what has committed, without waiting
        writer.start()
        assert not next_began.wait(0.3)  # the next unit of work waits until this one has committed
    writer.join(5)
    assert seen == [[], [allocation]]  # and then sees the VF as taken


# -- REST ----------------------------------------------------------------------------------------

def test_tenant_allocates_a_vf_through_the_pool_and_sees_only_its_own(api: TestClient, tenant: Any,
                                                                      kernel: MemoryKernel) -> None:
    red, blue = tenant("red", 100), tenant("blue", 200)
    created = api.post("/api/v1/vrnics", headers=red,
                       json={"mode": "sriov", "qos": {"rate_cap_mbps": 1000, "guarantee_mbps": 100}})
    assert created.status_code == 201, created.text
    vrnic = created.json()
    extra = vrnic["attach"]["extra"]
    assert (vrnic["device"], extra["pf"], extra["vf_index"], extra["vlan"], extra["max_tx_rate"],
            extra["min_tx_rate"], extra["pci_address"]) == (PF, PF, "0", "100", "1000", "100", "0000:03:00.1")
    assert kernel.vfs[0] == VfConfig(mac=extra["mac"], vlan=100, max_tx_rate=1000, min_tx_rate=100)

    vf = api.get(f"/api/v1/vrnics/{vrnic['id']}/vf", headers=red).json()
    assert vf["allocation"] == {"vrnic_id": vrnic["id"], "tenant": "red", "in_sync": True, "netns": None,
                                "vanished": False, "desired": vf["settings"]}
    assert vf["pci_address"] == "0000:03:00.1" and vf["settings"]["vlan"] == 100
    assert api.get(f"/api/v1/vrnics/{vrnic['id']}/vf", headers=blue).status_code == 404
    for path in ("/api/v1/sriov/pfs", f"/api/v1/sriov/pfs/{PF}/vfs"):
        assert api.get(path, headers=red).json()["code"] == "permission_denied"
    assert api.post("/api/v1/sriov/reconcile", headers=red).status_code == 403
    assert api.put(f"/api/v1/sriov/pfs/{PF}/num-vfs", headers=red, json={"num_vfs": 2}).status_code == 403

    xml = api.get(f"/api/v1/vrnics/{vrnic['id']}/hostdev", headers=red, params={"alias": "ua-red0"})
    assert xml.status_code == 200 and xml.headers["content-type"].startswith("application/xml")
    root = ET.fromstring(xml.text)
    assert (root.tag, root.get("type"), root.find("mac").get("address"),  # type: ignore[union-attr]
            root.find("vlan/tag").get("id"), root.find("alias").get("name")) == \
        ("interface", "hostdev", extra["mac"], "100", "ua-red0")  # type: ignore[union-attr]
    assert root.find("source/address").attrib == {"type": "pci", "domain": "0x0000", "bus": "0x03",  # type: ignore[union-attr]
                                                  "slot": "0x00", "function": "0x1"}

    released = api.delete(f"/api/v1/vrnics/{vrnic['id']}", headers=red)
    assert released.status_code == 200
    assert kernel.vfs[0] == CLEAN_VF
    assert api.get(f"/api/v1/vrnics/{vrnic['id']}/vf", headers=red).json()["current_state"] == "released"
    actions = [e["action"] for e in api.get("/api/v1/events", headers=red).json()["items"]]
    assert actions == ["tenant.create", "vf_allocated", "vrnic.allocate", "vf_released", "vrnic.release"]


def test_a_live_qos_change_on_a_vf_is_refused_and_changes_nothing(api: TestClient, tenant: Any,
                                                                   kernel: MemoryKernel) -> None:
    """A VF takes its cap and guarantee as max/min_tx_rate at allocation; the sriov driver cannot change them
    while the vRNIC lives, so PATCH says so (422) instead of recording a policy nothing applies."""
    red = tenant("red", 100)
    vrnic = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov", "qos": {"rate_cap_mbps": 1000}}).json()
    refused = api.patch(f"/api/v1/vrnics/{vrnic['id']}", headers=red, json={"qos": {"rate_cap_mbps": 500}})
    assert refused.status_code == 422 and "its rates are set when it is allocated" in refused.json()["detail"], \
        refused.text
    assert api.get(f"/api/v1/vrnics/{vrnic['id']}", headers=red).json()["qos"]["rate_cap_mbps"] == 1000
    assert kernel.vfs[0].max_tx_rate == 1000


def test_a_vf_moved_into_a_container_is_observed_as_attached(api: TestClient, tenant: Any,
                                                            sriov_backend: BackendService, kernel: MemoryKernel
                                                            ) -> None:
    from vrnic.backend.drivers.sriov import SriovDriver

    red = tenant("red", 100)
    vid = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).json()["id"]
    url = f"/api/v1/vrnics/{vid}"
    driver = sriov_backend.driver(VrnicMode.SRIOV)
    assert isinstance(driver, SriovDriver)
    assert api.get(url, headers=red).json()["state"] == "allocated"  # a VM's hostdev would not show either
    moved = driver.manager.attach_container(vid, "ctr1", require_rdma=False)
    assert kernel.netns == {moved.netdev: "ctr1"}
    assert api.get(url, headers=red).json()["state"] == "attached"
    refused = api.delete(url, headers=red)
    assert refused.status_code == 409 and refused.json()["current_state"] == "attached"
    driver.manager.detach_container(vid)
    assert api.get(url, headers=red).json()["state"] == "detached"
    actions = [(e["action"], e["actor"]) for e in
               api.get("/api/v1/events", headers=red, params={"subject": f"vrnic/{vid}"}).json()["items"]]
    assert actions == [("vrnic.allocate", "tenant:red"), ("vrnic.attach", "daemon"), ("vrnic.detach", "daemon")]
    assert api.delete(url, headers=red).json()["state"] == "released" and kernel.vfs[0] == CLEAN_VF


def test_operator_moves_a_vf_into_a_container_over_rest_and_back(api: TestClient, tenant: Any,
                                                                 kernel: MemoryKernel) -> None:
    red = tenant("red", 100)
    vid = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).json()["id"]
    url = f"/api/v1/vrnics/{vid}/container"
    # a tenant may not pick a host namespace to move a device into
    assert api.put(url, headers=red, json={"netns": "ctr1"}).status_code == 403
    assert api.put(url, json={"netns": "../etc"}).json()["code"] == "invalid_request"
    assert api.put(url, json={"netns": "ctr1", "require_rdma": 0}).json()["code"] == "invalid_request"  # strict
    refused = api.put(url, json={"netns": "ctr1"})  # these VFs have no RDMA device: nothing moves
    assert refused.status_code == 422 and "no RDMA device" in refused.json()["detail"] and kernel.netns == {}
    moved = api.put(url, json={"netns": "ctr1", "require_rdma": False})
    assert moved.status_code == 200, moved.text
    body = moved.json()
    assert (body["netns"], body["netdev"], body["rdma_device"]) == ("ctr1", f"{PF}v0", None) and body["notes"]
    assert kernel.netns == {f"{PF}v0": "ctr1"}
    assert api.get(f"/api/v1/vrnics/{vid}", headers=red).json()["state"] == "attached"
    assert api.get(f"/api/v1/vrnics/{vid}/vf", headers=red).json()["allocation"]["netns"] == "ctr1"
    again = api.put(url, json={"netns": "ctr2", "require_rdma": False})
    assert again.status_code == 409 and again.json()["current_state"] == "attached"
    back = api.delete(url)
    assert back.status_code == 200 and back.json()["allocation"]["netns"] is None and kernel.netns == {}
    assert api.get(f"/api/v1/vrnics/{vid}", headers=red).json()["state"] == "detached"
    actions = [(e["action"], e["actor"]) for e in api.get("/api/v1/events").json()["items"]
               if e["subject"] in (f"vrnic/{vid}", f"vf/{PF}/0")]
    assert actions == [("vf_allocated", "tenant:red"), ("vrnic.allocate", "tenant:red"),
                       ("vf_netns_moved", "operator"), ("vrnic.attach", "daemon"),
                       ("vf_netns_returned", "operator"), ("vrnic.detach", "daemon")]
    no_token = api.post(f"/api/v1/vrnics/{vid}/token", headers=red)
    assert no_token.status_code == 422 and "no attach token" in no_token.json()["detail"]
    paravirtual = api.post("/api/v1/vrnics", headers=red, json={}).json()["id"]
    assert api.put(f"/api/v1/vrnics/{paravirtual}/container", json={"netns": "ctr1"}).status_code == 422


def test_operator_lists_pfs_and_vfs_and_the_count_change_is_refused_while_allocated(
        api: TestClient, tenant: Any, kernel: MemoryKernel) -> None:
    red = tenant("red", 100)
    held = [api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).json()["id"] for _ in range(2)]
    pfs = api.get("/api/v1/sriov/pfs").json()
    assert pfs["next_cursor"] is None
    assert pfs["items"] == [{"name": PF, "kind": "pci", "bus_id": "0000:03:00.0", "driver": "mlx5_core", "num_vfs": 4,
                             "total_vfs": 8, "eswitch_mode": "legacy", "rdma_device": None, "allocated_vfs": 2,
                             "free_vfs": 2, "vanished_vrnics": []}]
    page = api.get(f"/api/v1/sriov/pfs/{PF}/vfs", params={"limit": 3}).json()
    assert [v["index"] for v in page["items"]] == [0, 1, 2] and page["next_cursor"] == "2"
    rest = api.get(f"/api/v1/sriov/pfs/{PF}/vfs", params={"cursor": page["next_cursor"]}).json()
    assert [v["index"] for v in rest["items"]] == [3] and rest["next_cursor"] is None
    assert [v["allocation"]["vrnic_id"] if v["allocation"] else None for v in page["items"]] == [*held, None]
    assert api.get("/api/v1/sriov/pfs/nope0").json()["code"] == "not_found"

    refused = api.put(f"/api/v1/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 2})
    assert refused.status_code == 409 and refused.headers["content-type"] == "application/problem+json"
    problem = refused.json()
    assert problem["current_state"] == "allocated" and all(v in problem["detail"] for v in held)
    assert kernel.num_vfs == 4

    changed = api.put(f"/api/v1/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 1, "force": True}).json()
    assert (changed["previous"], changed["num_vfs"], changed["steps"]) == (4, 1, [0, 1])
    assert sorted((e["kind"], e["vf"]) for e in changed["events"]) == \
        [("pf_num_vfs_changed", None), ("vf_reapplied", 0), ("vf_vanished", 1)]
    assert kernel.vfs[0].vlan == 100  # re-applied after going through zero
    assert api.get(f"/api/v1/sriov/pfs/{PF}").json()["vanished_vrnics"] == [held[1]]
    vanished = api.get(f"/api/v1/vrnics/{held[1]}/vf", headers=red).json()
    assert vanished["allocation"]["vanished"] and vanished["settings"] is None
    assert api.put(f"/api/v1/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 4, "force": True}).status_code == 200
    # the re-created VF 1 is free for a new vRNIC while the vanished one still waits for its release
    again = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).json()
    assert again["attach"]["extra"]["vf_index"] == "1"
    assert api.delete(f"/api/v1/vrnics/{held[1]}", headers=red).json()["state"] == "released"
    assert kernel.vfs[1].vlan == 100  # releasing the vanished vRNIC did not touch the new holder's VF
    bad = api.put(f"/api/v1/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 9, "force": True})
    assert bad.status_code == 400 and "at most 8" in bad.json()["detail"]


def test_reconcile_endpoint_restores_drift_and_records_it(api: TestClient, tenant: Any,
                                                           kernel: MemoryKernel) -> None:
    red = tenant("red", 100)
    vrnic = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).json()
    desired = kernel.vfs[0]
    assert api.post("/api/v1/sriov/reconcile").json() == {"events": []}
    kernel.tamper(0, vlan=7, trust=True)
    assert not api.get(f"/api/v1/vrnics/{vrnic['id']}/vf", headers=red).json()["allocation"]["in_sync"]
    events = api.post("/api/v1/sriov/reconcile").json()["events"]
    assert events == [{"kind": "vf_drift_corrected", "pf": PF, "vf": 0, "vrnic_id": vrnic["id"],
                       "detail": {"vlan": "7 -> 100", "trust": "True -> False"}}]
    assert kernel.vfs[0] == desired
    logged = api.get("/api/v1/events", headers=red, params={"action": "vf_drift_corrected"}).json()["items"]
    assert [(e["actor"], e["subject"], e["tenant"]) for e in logged] == [("operator", f"vf/{PF}/0", "red")]


def test_restart_reconciles_the_database_with_the_kernel(migrated: Engine, sriov_settings: DaemonSettings,
                                                          api: TestClient, tenant: Any, kernel: MemoryKernel) -> None:
    red = tenant("red", 100)
    vrnic = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov", "qos": {"rate_cap_mbps": 300}}).json()
    desired = kernel.vfs[0]
    kernel.tamper(0, max_tx_rate=0, mac="02:66:66:66:66:66")  # while "the daemon is down"
    # VF 2: configured for an allocation whose commit never happened (the daemon was killed in between)
    kernel.tamper(2, mac="02:77:77:77:77:77", vlan=300)
    restarted = BackendService({VrnicMode.SRIOV: sriov_driver(migrated, HOST, kernel)})  # a fresh process's state
    try:
        app = create_app(sriov_settings, restarted, engine=migrated)
        with TestClient(app, headers=dict(api.headers)) as client:
            assert kernel.vfs[0] == desired  # at startup, before any request
            assert kernel.vfs[2] == CLEAN_VF  # orphaned settings reset
            logged = client.get("/api/v1/events", params={"action": "vf_drift_corrected"}).json()["items"]
            assert [(e["actor"], e["detail"]["vrnic_id"]) for e in logged] == [("daemon", vrnic["id"])]
            [reset] = client.get("/api/v1/events", params={"action": "vf_reset"}).json()["items"]
            assert (reset["actor"], reset["subject"], reset["detail"]["vlan"]) == ("daemon", f"vf/{PF}/2", "300")
            # the desired state outlived the process: the new one releases it
            assert client.delete(f"/api/v1/vrnics/{vrnic['id']}").json()["state"] == "released"
            assert kernel.vfs[0] == CLEAN_VF
    finally:
        restarted.close()


def test_periodic_reconcile_runs_in_the_background(migrated: Engine, sriov_settings: DaemonSettings,
                                                   sriov_backend: BackendService, tenant: Any, api: TestClient,
                                                   kernel: MemoryKernel) -> None:
    red = tenant("red", 100)
    api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).raise_for_status()
    desired = kernel.vfs[0]
    kernel.tamper(0, vlan=9)
    app = create_app(sriov_settings.model_copy(update={"sriov_reconcile_interval": 0.2}), sriov_backend,
                     engine=migrated)
    with serve_in_thread(app) as url:
        import time

        import httpx
        deadline = time.monotonic() + 10
        while kernel.vfs[0] != desired and time.monotonic() < deadline:
            time.sleep(0.05)
        kernel.tamper(0, vlan=10)  # after the startup pass: only a periodic one can undo this
        while kernel.vfs[0] != desired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kernel.vfs[0] == desired
        events = httpx.get(f"{url}/api/v1/events", params={"action": "vf_drift_corrected"},
                           headers=dict(api.headers)).json()["items"]
        assert [e["detail"]["vlan"] for e in events][:2] == ["9 -> 100", "10 -> 100"]


def test_sriov_routes_answer_clearly_without_the_mode_or_for_other_modes(client: TestClient, make_tenant: Any
                                                                         ) -> None:
    assert client.get("/api/v1/sriov/pfs").json()["detail"] == "mode sriov is not enabled on this host"
    acme = make_tenant("acme")
    vrnic = client.post("/api/v1/vrnics", headers={"Authorization": acme["auth"]}, json={}).json()
    answer = client.get(f"/api/v1/vrnics/{vrnic['id']}/vf", headers={"Authorization": acme["auth"]})
    assert answer.status_code == 422 and "paravirtual mode: it has no VF" in answer.json()["detail"]


# -- CLI -----------------------------------------------------------------------------------------

@pytest.fixture
def run(migrated: Engine, sriov_settings: DaemonSettings, sriov_backend: BackendService,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[int, str, str]]]:
    app = create_app(sriov_settings, sriov_backend, engine=migrated)
    with serve_in_thread(app) as url:
        monkeypatch.setenv("VRNIC_API_URL", url)
        monkeypatch.setenv("VRNIC_API_TOKEN", sriov_settings.operator_token.get_secret_value())  # type: ignore[union-attr]
        runner = CliRunner()

        def invoke(*args: str) -> tuple[int, str, str]:
            result = runner.invoke(cli, list(args), env={"COLUMNS": "200"})
            return result.exit_code, result.stdout, result.stderr

        yield invoke


def test_cli_lists_pfs_and_vfs_sets_the_count_and_reconciles(run: Any, kernel: MemoryKernel) -> None:
    run("tenants", "create", "red", "--vpc-id", "100")
    code, out, _ = run("vrnics", "allocate", "--tenant", "red", "--mode", "sriov", "--json")
    assert code == 0
    vid = json.loads(out)["id"]
    code, out, _ = run("sriov", "pfs")
    assert code == 0 and PF in out and "mlx5_core" in out and "legacy" in out
    code, out, _ = run("sriov", "pfs", "--json")
    assert code == 0 and json.loads(out)[0]["free_vfs"] == 3
    code, out, _ = run("sriov", "vfs", PF)
    assert code == 0 and f"{vid} (red, in sync)" in out and "vlan 100" in out and out.count("free") == 3
    code, out, err = run("sriov", "set-numvfs", PF, "2")
    assert code == 1 and out == "" and err.strip().splitlines()[-1].startswith("vrnic: 409 conflict: ")
    assert vid in err and err.strip().endswith("(current state: allocated)")
    kernel.tamper(0, vlan=5)
    code, out, _ = run("sriov", "vfs", PF, "--json")
    assert code == 0 and json.loads(out)[0]["allocation"]["in_sync"] is False
    code, out, _ = run("sriov", "reconcile")
    assert code == 0 and f"vf_drift_corrected {PF}/vf0 ({vid}): vlan=5 -> 100" in out
    code, out, _ = run("sriov", "reconcile")
    assert code == 0 and "in sync" in out
    code, out, _ = run("sriov", "set-numvfs", PF, "2", "--force")
    assert code == 0 and f"{PF}: 4 -> 2 VFs (sriov_numvfs 0 -> 2)" in out and "vf_reapplied" in out
    code, out, _ = run("sriov", "set-numvfs", PF, "2", "--json")
    assert code == 0 and json.loads(out)["steps"] == []
    code, _, err = run("sriov", "vfs", "nope0")
    assert code == 1 and err.strip() == "vrnic: 404 not_found: no SR-IOV PF 'nope0' on this host (known: ens1f0)"


def test_cli_moves_a_vf_into_a_container_and_back(run: Any, kernel: MemoryKernel) -> None:
    run("tenants", "create", "red", "--vpc-id", "100")
    vid = json.loads(run("vrnics", "allocate", "--tenant", "red", "--mode", "sriov", "--json")[1])["id"]
    code, _, err = run("sriov", "attach-container", vid, "ctr1")
    assert code == 1 and "422" in err and "no RDMA device" in err and kernel.netns == {}
    code, out, err = run("sriov", "attach-container", vid, "ctr1", "--ethernet-only")
    assert code == 0 and f"moved {PF}v0 (Ethernet only) of {vid} into netns ctr1" in out and "no RDMA" in err
    assert kernel.netns == {f"{PF}v0": "ctr1"}
    code, out, _ = run("vrnics", "show", vid, "--json")
    assert code == 0 and json.loads(out)["state"] == "attached"
    code, out, _ = run("sriov", "detach-container", vid)
    assert code == 0 and f"VF {PF}/vf0 is back" in out and kernel.netns == {}


def test_daemon_builds_the_sriov_driver_on_the_database(settings: DaemonSettings, caplog: Any) -> None:
    from vrnic.backend.drivers.sriov import SriovDriver
    from vrnic.daemon import build_backend

    wired = settings.model_copy(update={"paravirtual_driver": None, "sriov_driver": "sriov"})
    backend = build_backend(wired)
    try:
        driver = backend.driver(VrnicMode.SRIOV)
        assert isinstance(driver, SriovDriver)
        assert isinstance(driver.manager.store, DbVfStateStore) and driver.manager.store.host_name == HOST
        assert not driver._release_on_close  # desired state outlives the process
    finally:
        backend.close()
    refused = build_backend(wired.model_copy(update={"sriov_driver_options": {"no_such_option": 1}}))
    assert not refused.has_mode(VrnicMode.SRIOV)
    assert "unknown sriov driver option(s): no_such_option" in caplog.text


def test_a_vf_configured_for_an_allocation_that_failed_to_commit_is_reset(api: TestClient, tenant: Any,
                                                                          kernel: MemoryKernel,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from vrnic.api import vrnics

    red = tenant("red", 100)
    real = vrnics.vrnic_out

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(vrnics, "vrnic_out", real)
        raise RuntimeError("the database went away after the VF was configured")

    monkeypatch.setattr(vrnics, "vrnic_out", fail_once)
    with pytest.raises(RuntimeError):
        api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"})
    assert kernel.vfs[0] == CLEAN_VF  # the allocation rolled back, and so did the VF
    assert api.get(f"/api/v1/sriov/pfs/{PF}").json()["free_vfs"] == 4
    again = api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"}).json()
    assert again["attach"]["extra"]["vf_index"] == "0" and kernel.vfs[0].vlan == 100


def test_a_vf_configured_for_an_allocation_whose_commit_failed_is_reset(api: TestClient, tenant: Any,
                                                                       kernel: MemoryKernel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import Connection

    red = tenant("red", 100)
    assert api.get("/api/v1/vrnics", headers=red).status_code == 200  # the token is known: no read to commit
    real = Connection.commit

    def fail_once(self: Connection) -> None:
        monkeypatch.setattr(Connection, "commit", real)
        raise ConnectionError("the database went away at COMMIT, after the VF was configured")

    monkeypatch.setattr(Connection, "commit", fail_once)  # what a write unit of work commits
    with pytest.raises(ConnectionError):
        api.post("/api/v1/vrnics", headers=red, json={"mode": "sriov"})
    assert kernel.vfs[0] == CLEAN_VF  # the undo found the allocation the failed transaction wrote
    assert api.get(f"/api/v1/sriov/pfs/{PF}").json()["free_vfs"] == 4
    assert api.get("/api/v1/vrnics", headers=red).json()["items"] == []


def test_concurrent_sriov_allocations_get_distinct_vfs(migrated: Engine, sriov_settings: DaemonSettings,
                                                       sriov_backend: BackendService, kernel: MemoryKernel) -> None:
    import concurrent.futures

    import httpx

    token = sriov_settings.operator_token.get_secret_value()  # type: ignore[union-attr]
    auth = {"Authorization": f"Bearer {token}"}
    with serve_in_thread(create_app(sriov_settings, sriov_backend, engine=migrated)) as url:
        httpx.post(f"{url}/api/v1/tenants", json={"name": "red", "vpc_id": 100}, headers=auth).raise_for_status()

        def allocate(_: int) -> httpx.Response:
            return httpx.post(f"{url}/api/v1/vrnics", json={"mode": "sriov", "tenant": "red"}, headers=auth,
                              timeout=60)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(allocate, range(6)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201, 201, 201, 201, 403, 403], [a.text for a in answers if a.status_code >= 500]
    indexes = sorted(a.json()["attach"]["extra"]["vf_index"] for a in answers if a.status_code == 201)
    assert indexes == ["0", "1", "2", "3"]
    assert all(kernel.vfs[i].vlan == 100 for i in range(4))
