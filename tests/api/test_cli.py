"""The operator CLI against a served API: tables, --json, one-line errors with a non-zero exit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi import FastAPI
from sqlalchemy import Engine
from typer.testing import CliRunner

from vrnic.api.app import create_app
from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.service import BackendService
from vrnic.cli import vm as vm_cli
from vrnic.cli.main import app as cli
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import serve_in_thread


@pytest.fixture
def api_url(migrated: Engine, settings: DaemonSettings, backend: BackendService) -> Iterator[str]:
    app: FastAPI = create_app(settings, backend, engine=migrated)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def run(api_url: str, operator_token: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VRNIC_API_URL", api_url)
    runner = CliRunner()

    def invoke(*args: str, token: str = operator_token) -> tuple[int, str, str]:
        monkeypatch.setenv("VRNIC_API_TOKEN", token)
        result = runner.invoke(cli, list(args), env={"COLUMNS": "200"})
        return result.exit_code, result.stdout, result.stderr

    return invoke


def test_operator_and_tenant_workflow(run, backend: BackendService) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run("tenants", "create", "acme", "--max-vrnics", "3", "--quota", "max_qps=8", "--json")
    assert code == 0
    tenant = json.loads(out)
    assert tenant["max_vrnics"] == 3 and tenant["default_quota"]["max_qps"] == 8
    code, out, _ = run("vrnics", "allocate", "--rate-cap", "500", "--json", token=tenant["token"])
    assert code == 0
    vrnic = json.loads(out)
    assert vrnic["attach"]["token"] and vrnic["qos"]["rate_cap_mbps"] == 500
    assert vrnic["id"] in backend.vrnic_ids()
    code, out, _ = run("vrnics", "list")
    assert code == 0 and vrnic["id"][:8] in out and "acme" in out and "allocated" in out
    code, out, _ = run("vrnics", "show", vrnic["id"], token=tenant["token"])
    assert code == 0 and vrnic["virtual_gid"] in out
    code, out, _ = run("devices", "list", "--json")
    assert code == 0 and {d["name"] for d in json.loads(out)} == {"fake0", "fake1"}
    code, out, _ = run("hosts", "list")
    assert code == 0 and "test-host" in out
    code, _, _ = run("vrnics", "attach", vrnic["id"], token=tenant["token"])
    assert code == 2  # no such command: vrnicd observes attachment, nobody reports it
    guest = backend.driver(VrnicMode.PARAVIRTUAL)
    assert isinstance(guest, FakeDriver)
    guest.guest_attached(vrnic["id"])
    code, out, _ = run("vrnics", "show", vrnic["id"], "--json", token=tenant["token"])
    assert code == 0 and json.loads(out)["state"] == "attached"
    code, _, err = run("vrnics", "release", vrnic["id"], token=tenant["token"])
    assert code == 1 and "disconnect the guest first" in err and "(current state: attached)" in err
    guest.guest_detached(vrnic["id"])
    code, out, _ = run("vrnics", "show", vrnic["id"], token=tenant["token"])
    assert code == 0 and "detached" in out
    code, out, _ = run("vrnics", "release", vrnic["id"], token=tenant["token"])
    assert code == 0 and f"released {vrnic['id']}" in out
    assert vrnic["id"] not in backend.vrnic_ids()
    code, out, _ = run("events", "list", "--subject", f"vrnic/{vrnic['id']}", "--json")
    assert [e["action"] for e in json.loads(out)] == ["vrnic.allocate", "vrnic.attach", "vrnic.detach",
                                                      "vrnic.release"]


def test_errors_are_one_line_with_a_non_zero_exit(run, api_url: str) -> None:  # type: ignore[no-untyped-def]
    run("tenants", "create", "acme")
    code, vrnic_out, _ = run("vrnics", "allocate", "--tenant", "acme", "--json")
    vid = json.loads(vrnic_out)["id"]
    run("vrnics", "release", vid)
    code, out, err = run("vrnics", "release", vid)
    assert code == 1 and out == ""
    assert err.strip() == "vrnic: 409 conflict: cannot release a vRNIC in state released: it is released " \
                          "(current state: released)"
    code, _, err = run("tenants", "list", token="vrt_wrong")
    assert code == 1 and err.strip() == "vrnic: 401 unauthenticated: invalid or revoked token"
    code, _, err = run("vrnics", "allocate", "--mode", "sriov", "--tenant", "acme")
    assert code == 1 and "not_supported" in err and len(err.strip().splitlines()) == 1


def test_engine_is_chosen_at_allocation_and_a_direct_vrnic_stays_out_of_vms(  # type: ignore[no-untyped-def]
        run, backend: BackendService, monkeypatch: pytest.MonkeyPatch) -> None:
    run("tenants", "create", "acme")
    code, out, _ = run("vrnics", "allocate", "--tenant", "acme", "--engine", "direct", "--json")
    assert code == 0
    direct = json.loads(out)
    assert direct["engine"] == "direct"
    code, out, _ = run("vrnics", "allocate", "--tenant", "acme", "--json")
    assert code == 0 and json.loads(out)["engine"] == "ring"
    code, out, _ = run("vrnics", "list")
    assert code == 0 and "engine" in out and "direct" in out and "ring" in out
    code, out, _ = run("vrnics", "show", direct["id"])
    assert code == 0 and "direct" in out
    code, _, err = run("vrnics", "allocate", "--tenant", "acme", "--mode", "sriov", "--engine", "direct")
    assert code == 1 and "the direct engine is for paravirtual vRNICs" in err and len(err.strip().splitlines()) == 1
    # vm attach: the API refuses before the domain's XML is touched
    defined: list[str] = []

    class Domain:
        name = "vm1"

        def persistent_xml(self) -> str:
            return "<domain type='kvm'><name>vm1</name><devices/></domain>"

        def is_active(self) -> bool:
            return False

    class Libvirt:
        def domain(self, name: str) -> Domain:
            return Domain()

        def define(self, domain_xml: str, name: str) -> None:
            defined.append(domain_xml)

    @contextmanager
    def connect(uri: str) -> Iterator[Libvirt]:
        yield Libvirt()

    monkeypatch.setattr(vm_cli, "connect", connect)
    code, _, err = run("vm", "attach", "vm1", "--vrnic", direct["id"])
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"400 invalid_argument: vRNIC {direct['id']} uses the direct engine, which a VM cannot use" in err
    assert defined == []
    code, out, _ = run("vrnics", "show", direct["id"], "--json")
    assert json.loads(out)["vm_domain"] is None


def test_unreachable_api_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRNIC_API_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    result = CliRunner().invoke(cli, ["hosts", "list"])
    assert result.exit_code == 1
    assert result.stderr.startswith("vrnic: cannot reach the vrnic API at http://127.0.0.1:9")
    assert len(result.stderr.strip().splitlines()) == 1


def test_security_rules_add_list_delete(run) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run("tenants", "create", "acme", "--vpc-cidr", "10.8.0.0/24", "--json")
    assert code == 0 and json.loads(out)["vpc_cidr"] == "10.8.0.0/24"
    acme = json.loads(out)["token"]
    run("tenants", "create", "globex")
    code, out, _ = run("security-rules", "add", "allow", "globex", "--json", token=acme)
    assert code == 0
    rule = json.loads(out)
    assert (rule["tenant"], rule["action"], rule["peer_tenant"]) == ("acme", "allow", "globex")
    code, out, _ = run("security-rules", "add", "deny", "*", "--tenant", "globex")
    assert code == 0 and "deny" in out
    code, out, _ = run("security-rules", "list", "--json", token=acme)
    assert code == 0 and [r["id"] for r in json.loads(out)] == [rule["id"]]
    code, out, _ = run("security-rules", "list", "--tenant", "globex")
    assert code == 0 and "globex" in out and "deny" in out and "acme" not in out
    code, _, err = run("security-rules", "add", "allow", "globex", token=acme)
    assert code == 1 and err.startswith("vrnic: 409 conflict:") and len(err.strip().splitlines()) == 1
    code, out, _ = run("security-rules", "delete", str(rule["id"]), token=acme)
    assert code == 0 and f"deleted security rule {rule['id']}" in out
    code, _, err = run("security-rules", "delete", str(rule["id"]), token=acme)
    assert code == 1 and f"404 not_found: no security rule {rule['id']}" in err
    code, out, _ = run("vrnics", "allocate", "--virtual-ip", "10.8.0.20", "--json", token=acme)
    assert code == 0 and json.loads(out)["virtual_ip"] == "10.8.0.20"
    code, out, _ = run("vrnics", "list")
    assert code == 0 and "10.8.0.20" in out


def test_the_operator_token_file_is_read_from_the_daemons_state_dir(api_url: str, operator_token: str, tmp_path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`vrnic daemon` writes its generated token into VRNIC_STATE_DIR; the CLI looks for it there too."""
    state = tmp_path / "custom-state"
    state.mkdir()
    monkeypatch.delenv("VRNIC_API_TOKEN", raising=False)
    monkeypatch.setenv("VRNIC_API_URL", api_url)
    monkeypatch.setenv("VRNIC_STATE_DIR", str(state))
    runner = CliRunner()
    refused = runner.invoke(cli, ["hosts", "list"])
    assert refused.exit_code == 1 and "401" in refused.stderr  # no token file there yet
    (state / "operator-token").write_text(operator_token + "\n")
    listed = runner.invoke(cli, ["hosts", "list", "--json"])
    assert listed.exit_code == 0, listed.stderr
    assert [h["name"] for h in json.loads(listed.stdout)] == ["test-host"]


def test_a_replayed_allocation_hints_at_new_token_which_prints_a_working_one(  # type: ignore[no-untyped-def]
        run, backend: BackendService) -> None:
    code, out, _ = run("tenants", "create", "acme", "--json")
    token = json.loads(out)["token"]
    code, out, _ = run("vrnics", "allocate", "--idempotency-key", "k1", "--json", token=token)
    first = json.loads(out)
    code, out, err = run("vrnics", "allocate", "--idempotency-key", "k1", "--json", token=token)
    assert code == 0 and json.loads(out)["attach"]["token"] is None
    assert f"vrnic vrnics new-token {first['id']}" in err
    code, out, _ = run("vrnics", "new-token", first["id"], token=token)
    fake = backend.driver(VrnicMode.PARAVIRTUAL)
    assert code == 0 and isinstance(fake, FakeDriver) and fake.accepts_token(first["id"], out.strip())
    assert out.strip() != first["attach"]["token"]


def test_set_qos_changes_a_live_vrnic_and_show_prints_its_counters(  # type: ignore[no-untyped-def]
        run, backend: BackendService, monkeypatch: pytest.MonkeyPatch) -> None:
    run("tenants", "create", "acme")
    code, out, _ = run("vrnics", "allocate", "--tenant", "acme", "--rate-cap", "80", "--json")
    vid = json.loads(out)["id"]
    code, out, _ = run("vrnics", "set-qos", vid, "--rate-cap", "40", "--guarantee", "10", "--weight", "2", "--json")
    assert code == 0 and json.loads(out)["qos"] == {"rate_cap_mbps": 40, "guarantee_mbps": 10, "weight": 2}
    fake = backend.driver(VrnicMode.PARAVIRTUAL)
    assert isinstance(fake, FakeDriver) and fake.qos[vid].rate_cap_mbps == 40  # it reached the backend
    code, _, err = run("vrnics", "set-qos", vid, "--rate-cap", "10", "--guarantee", "20")
    assert code == 1 and "422" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run("vrnics", "show", vid, "--json")
    assert json.loads(out)["qos"]["rate_cap_mbps"] == 40  # the refused change left it as it was
    # What the device's mechanism counts (rxe in the kernel tier) is what show prints.
    monkeypatch.setattr(backend, "qos_counters", lambda: {vid: {
        "tx_bytes": 123456, "tx_packets": 99, "rx_bytes": 654321, "rx_packets": 77}})
    code, out, _ = run("vrnics", "show", vid, "--json")
    counters = json.loads(out)["counters"]
    assert code == 0 and (counters["shaped"], counters["tx_bytes"], counters["rx_packets"]) == (True, 123456, 77)
    code, out, _ = run("vrnics", "show", vid)
    assert code == 0 and "123456" in out and "654321" in out
