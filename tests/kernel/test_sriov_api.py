"""The SR-IOV mode through the REST API and the CLI, on real netdevsim VFs inside the lab
(`vrnic lab run --netdevsim`): the daemon's own wiring (build_backend: the sriov driver with its desired state
in the database and its events in the audit log) behind the API served in-process on a SQLite file.

Every VF setting is read back independently of vrnic, through iproute2 (`ip -j -d link show`).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from vrnic.backend.service import BackendService
from vrnic.cli.main import app as cli
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import build_backend, serve_in_process
from vrnic.db.engine import make_engine
from vrnic.db.migrate import upgrade

from .sriov_iproute import CLEAN, sh, vf_settings

PF = os.environ.get("VRNIC_LAB_NETDEVSIM_PF", "")
NSIM_DEV = os.environ.get("VRNIC_LAB_NETDEVSIM_DEV", "netdevsim10")
NSIM = Path("/sys/bus/netdevsim/devices") / NSIM_DEV
VF_COUNT = 4
OPERATOR = {"Authorization": "Bearer vro_lab-operator"}

pytestmark = pytest.mark.skipif(not PF or not NSIM.exists(),
                                reason="needs netdevsim: `vrnic lab run --netdevsim -- pytest tests/kernel`")




def numvfs() -> int:
    return int((NSIM / "sriov_numvfs").read_text())


def db_rows(database: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(database) as connection:
        return connection.execute("SELECT pf, vf_index, mac, vlan, max_tx_rate_mbps, min_tx_rate_mbps, vanished "
                                  "FROM sriov_vfs ORDER BY vf_index").fetchall()


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[DaemonSettings]:
    settings = DaemonSettings(state_dir=tmp_path, operator_token=SecretStr(OPERATOR["Authorization"][7:]),
                              host_name="lab-host", paravirtual_driver=None, sriov_driver="sriov",
                              sriov_reconcile_interval=0)
    engine = make_engine(settings.database)
    upgrade(engine)  # the daemon refuses to start on an older schema; build_backend reads the store
    engine.dispose()
    yield settings
    # whatever happened, leave the PF as the next test expects it: 4 clean VFs
    if numvfs() != VF_COUNT:
        (NSIM / "sriov_numvfs").write_text("0")
        (NSIM / "sriov_numvfs").write_text(str(VF_COUNT))
    for index in range(VF_COUNT):
        sh("ip", "link", "set", PF, "vf", str(index), "mac", "00:00:00:00:00:00", "vlan", "0", "max_tx_rate", "0",
           "min_tx_rate", "0", "trust", "off", "spoofchk", "on", "state", "auto")


@pytest.fixture
def backend(settings: DaemonSettings) -> Iterator[BackendService]:
    backend = build_backend(settings)
    yield backend
    backend.close()


def test_sriov_vrnic_lifecycle_through_rest_and_cli(settings: DaemonSettings, backend: BackendService,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend.has_mode(VrnicMode.SRIOV)
    database = settings.state_dir / "vrnic.db"
    with serve_in_process(settings, backend) as url:
        api = httpx.Client(base_url=f"{url}/api/v1", headers=OPERATOR, timeout=60)
        pfs = api.get("/sriov/pfs").json()["items"]
        assert [(p["name"], p["kind"], p["bus_id"], p["driver"], p["eswitch_mode"], p["num_vfs"], p["free_vfs"])
                for p in pfs] == [(PF, "netdevsim", NSIM_DEV, "netdevsim", "legacy", VF_COUNT, VF_COUNT)]

        red = api.post("/tenants", json={"name": "red", "vpc_id": 100}).json()
        blue = api.post("/tenants", json={"name": "blue", "vpc_id": 200}).json()
        as_red = {"Authorization": f"Bearer {red['token']}"}
        as_blue = {"Authorization": f"Bearer {blue['token']}"}

        # A tenant allocates an SR-IOV vRNIC: it gets a VF from the pool, configured for its VLAN and rates.
        created = api.post("/vrnics", headers=as_red,
                           json={"mode": "sriov", "qos": {"rate_cap_mbps": 1000, "guarantee_mbps": 100}})
        assert created.status_code == 201, created.text
        vrnic = created.json()
        vid, extra = vrnic["id"], vrnic["attach"]["extra"]
        index = int(extra["vf_index"])
        assert (vrnic["mode"], vrnic["device"], extra["pf"], extra["vlan"], extra["max_tx_rate"],
                extra["min_tx_rate"], extra["netdevsim_device"]) == ("sriov", PF, PF, "100", "1000", "100", NSIM_DEV)
        wanted = {"mac": extra["mac"], "vlan": 100, "qos": 0, "max": 1000, "min": 100, "spoofchk": True,
                  "trust": False, "state": "auto"}
        assert vf_settings(PF)[index] == wanted
        other = api.post("/vrnics", headers=as_blue, json={"mode": "sriov", "qos": {"rate_cap_mbps": 500}}).json()
        other_index = int(other["attach"]["extra"]["vf_index"])
        other_vf = vf_settings(PF)[other_index]
        assert other_index != index and other_vf["vlan"] == 200 and other_vf["max"] == 500
        # the desired state is in the database, linked to the vRNIC
        assert (PF, index, extra["mac"], 100, 1000, 100, 0) in db_rows(database)

        # The tenant sees its own VF; nobody else's, and no PF.
        vf = api.get(f"/vrnics/{vid}/vf", headers=as_red).json()
        assert vf["allocation"]["in_sync"] and vf["settings"]["vlan"] == 100 and vf["allocation"]["tenant"] == "red"
        assert api.get(f"/vrnics/{vid}/vf", headers=as_blue).status_code == 404
        assert api.get("/sriov/pfs", headers=as_red).status_code == 403
        listed = {v["index"]: v for v in api.get(f"/sriov/pfs/{PF}/vfs").json()["items"]}
        assert listed[index]["allocation"]["vrnic_id"] == vid and listed[other_index]["allocation"]["tenant"] == "blue"
        assert api.get(f"/sriov/pfs/{PF}").json()["free_vfs"] == VF_COUNT - 2

        # Behind vrnic's back: reconcile (the endpoint) restores it and records the correction.
        sh("ip", "link", "set", PF, "vf", str(index), "vlan", "7", "max_tx_rate", "0", "min_tx_rate", "0")
        assert not api.get(f"/vrnics/{vid}/vf", headers=as_red).json()["allocation"]["in_sync"]
        events = api.post("/sriov/reconcile").json()["events"]
        assert [(e["kind"], e["vf"], e["vrnic_id"]) for e in events] == [("vf_drift_corrected", index, vid)]
        assert vf_settings(PF)[index] == wanted
        logged = api.get("/events", headers=as_red, params={"action": "vf_drift_corrected"}).json()["items"]
        assert [(e["subject"], e["actor"], e["tenant"]) for e in logged] == [(f"vf/{PF}/{index}", "operator", "red")]
        assert logged[0]["detail"]["vlan"] == "7 -> 100"

        # The VF count cannot change while VFs are allocated: 409 naming the allocations, nothing changed.
        refused = api.put(f"/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 2})
        assert refused.status_code == 409
        problem = refused.json()
        assert problem["current_state"] == "allocated"
        assert vid in problem["detail"] and "tenant red" in problem["detail"]
        assert refused.headers["content-type"] == "application/problem+json"
        assert numvfs() == VF_COUNT and vf_settings(PF)[index] == wanted

        # The same through the CLI (REST only): tables, --json, one-line errors.
        monkeypatch.setenv("VRNIC_API_URL", url)
        monkeypatch.setenv("VRNIC_API_TOKEN", OPERATOR["Authorization"][7:])
        runner = CliRunner()
        result = runner.invoke(cli, ["sriov", "set-numvfs", PF, "2"], env={"COLUMNS": "200"})
        assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith("vrnic: 409 conflict: ")
        assert "(current state: allocated)" in result.stderr
        result = runner.invoke(cli, ["sriov", "pfs", "--json"])
        assert result.exit_code == 0 and json.loads(result.stdout)[0]["allocated_vfs"] == 2
        result = runner.invoke(cli, ["sriov", "vfs", PF], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and vid in result.stdout and "in sync" in result.stdout
        sh("ip", "link", "set", PF, "vf", str(other_index), "trust", "on")
        result = runner.invoke(cli, ["sriov", "reconcile"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and f"vf_drift_corrected {PF}/vf{other_index} ({other['id']})" in result.stdout
        assert vf_settings(PF)[other_index]["trust"] is False

        # A VM needs a PCI VF: netdevsim VFs have none, and the API says so.
        xml = api.get(f"/vrnics/{vid}/hostdev", headers=as_red)
        assert xml.status_code == 422 and "no PCI address" in xml.json()["detail"]

        # Drift while the daemon is down: the next start reconciles the database with netlink.
        sh("ip", "link", "set", PF, "vf", str(index), "mac", "02:66:66:66:66:66", "min_tx_rate", "0")

    restarted = build_backend(settings)
    try:
        with serve_in_process(settings, restarted) as url:
            api = httpx.Client(base_url=f"{url}/api/v1", headers=OPERATOR, timeout=60)
            assert vf_settings(PF)[index] == wanted  # restored at startup, before the first request
            at_start = api.get("/events", params={"action": "vf_drift_corrected", "limit": 50}).json()["items"]
            assert (at_start[-1]["subject"], at_start[-1]["actor"], at_start[-1]["detail"]["vrnic_id"]) == \
                (f"vf/{PF}/{index}", "daemon", vid)

            # Release through REST: the VF is reset, its row is gone, and it is free again.
            released = api.delete(f"/vrnics/{vid}", headers=as_red)
            assert released.status_code == 200 and released.json()["state"] == "released"
            assert vf_settings(PF)[index] == CLEAN
            assert [r[1] for r in db_rows(database)] == [other_index]
            listed = {v["index"]: v for v in api.get(f"/sriov/pfs/{PF}/vfs").json()["items"]}
            assert listed[index]["allocation"] is None and listed[index]["settings"]["mac"] == CLEAN["mac"]
            assert api.delete(f"/vrnics/{other['id']}").status_code == 200
            assert vf_settings(PF)[other_index] == CLEAN and db_rows(database) == []

            # Nothing allocated: the count change goes through.
            changed = api.put(f"/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 2}).json()
            assert (changed["previous"], changed["num_vfs"], changed["steps"]) == (VF_COUNT, 2, [0, 2])
            assert numvfs() == 2
            assert api.put(f"/sriov/pfs/{PF}/num-vfs", json={"num_vfs": VF_COUNT}).status_code == 200
            assert numvfs() == VF_COUNT
            actions = [e["action"] for e in api.get("/events", params={"subject": f"vf/{PF}/{index}"}).json()["items"]]
            assert actions == ["vf_allocated", "vf_drift_corrected", "vf_drift_corrected", "vf_released"]
    finally:
        restarted.close()


def test_forced_count_change_through_rest_reapplies_and_marks_vanished(settings: DaemonSettings,
                                                                        backend: BackendService) -> None:
    with serve_in_process(settings, backend) as url:
        api = httpx.Client(base_url=f"{url}/api/v1", headers=OPERATOR, timeout=60)
        api.post("/tenants", json={"name": "red", "vpc_id": 100}).raise_for_status()
        first = api.post("/vrnics", json={"mode": "sriov", "tenant": "red", "qos": {"rate_cap_mbps": 300}}).json()
        api.post("/vrnics", json={"mode": "sriov", "tenant": "red"}).raise_for_status()
        api.post("/vrnics", json={"mode": "sriov", "tenant": "red"}).raise_for_status()
        last = api.post("/vrnics", json={"mode": "sriov", "tenant": "red"}).json()
        assert last["attach"]["extra"]["vf_index"] == "3"
        full = api.post("/vrnics", json={"mode": "sriov", "tenant": "red"})
        assert full.status_code == 403 and full.json()["code"] == "quota_exceeded"  # the pool is exhausted

        changed = api.put(f"/sriov/pfs/{PF}/num-vfs", json={"num_vfs": 2, "force": True})
        assert changed.status_code == 200, changed.text
        kinds = sorted((e["kind"], e["vf"]) for e in changed.json()["events"])
        assert kinds == [("pf_num_vfs_changed", None), ("vf_reapplied", 0), ("vf_reapplied", 1),
                         ("vf_vanished", 2), ("vf_vanished", 3)]
        assert numvfs() == 2
        first_vf = vf_settings(PF)[0]
        assert first_vf["vlan"] == 100 and first_vf["max"] == 300  # re-applied after going through zero
        vanished = api.get(f"/vrnics/{last['id']}/vf").json()
        assert vanished["allocation"]["vanished"] and vanished["settings"] is None
        assert set(api.get(f"/sriov/pfs/{PF}").json()["vanished_vrnics"]) == set(vanished_ids(api))
        # the vanished vRNIC is released like any other
        assert api.delete(f"/vrnics/{last['id']}").json()["state"] == "released"
        assert api.get("/events", params={"action": "vf_vanished"}).json()["items"][0]["tenant"] == "red"
        assert api.get(f"/vrnics/{first['id']}/vf").json()["allocation"]["in_sync"]


def vanished_ids(api: httpx.Client) -> list[str]:
    return [v["id"] for v in api.get("/vrnics", params={"state": "allocated"}).json()["items"]
            if v["attach"]["extra"]["vf_index"] in ("2", "3")]
