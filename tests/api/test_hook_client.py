"""The libvirt hook as libvirtd runs it (the installed wrapper script, a bare environment, the domain XML on stdin)
against a served API: its REST client on http.client admits, binds and unbinds, and every refusal reaches
`virsh` as a sentence. A call that asks the API imports neither httpx nor pydantic."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from vrnic.api.app import create_app
from vrnic.backend.service import BackendService
from vrnic.config import PROJECT_DIR, DaemonSettings
from vrnic.core.specs import VmBinding
from vrnic.daemon import serve_in_thread
from vrnic.errors import ApiError, InvalidArgument, Unavailable
from vrnic.vm.hook import hook_wrapper_script
from vrnic.vm.hook_client import HookClient, HookClientSettings

pytestmark = pytest.mark.api

DOMAIN_XML = """<domain type='kvm' id='3'>
  <name>vm1</name>
  <uuid>757fef6f-c10c-4ed2-b625-46ea44233d94</uuid>
  <metadata><v:vrnics xmlns:v="https://vrnic.dev/xmlns/vrnic/1"><v:vrnic id="{vrnic}" channel="org.vrnic.0"/>
  </v:vrnics></metadata>
  <memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>
  <os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>
  <devices>
    <channel type='unix'><source mode='bind' path='{sockets}/vm1.sock'/><target type='virtio' name='org.vrnic.0'/>
    </channel>
  </devices>
</domain>"""


@dataclass
class Hook:
    """The installed hook script; run(op, vrnic) -> (exit status, stderr, the log record)."""

    script: Path
    log: Path
    sockets: Path

    def run(self, op: str, vrnic: str, importtime: bool = False) -> tuple[int, str, dict[str, Any]]:
        env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LC_ALL": "C"}  # all libvirtd hands a hook
        if importtime:
            env["PYTHONPROFILEIMPORTTIME"] = "1"
        done = subprocess.run([str(self.script), "vm1", op, "begin", "-"], env=env, capture_output=True, text=True,
                              input=DOMAIN_XML.format(vrnic=vrnic, sockets=self.sockets), timeout=120)
        records = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        return done.returncode, done.stderr, records[-1] if records else {}


def _hook(tmp_path: Path, api_url: str, token: str) -> Hook:
    token_file = tmp_path / "operator-token"
    token_file.write_text(token + "\n")
    log, sockets = tmp_path / "hook.jsonl", tmp_path / "sockets"
    script = tmp_path / "qemu"
    script.write_text(hook_wrapper_script(Path(sys.executable), PROJECT_DIR, api_url, token_file, tmp_path / "ram",
                                          log))
    script.chmod(0o755)
    return Hook(script, log, sockets)


@pytest.fixture
def served(migrated: Engine, settings: DaemonSettings, backend: BackendService) -> Iterator[tuple[str, TestClient]]:
    app = create_app(settings, backend, engine=migrated)
    assert settings.operator_token is not None
    operator = {"Authorization": f"Bearer {settings.operator_token.get_secret_value()}"}
    with serve_in_thread(app) as url, TestClient(app, headers=operator) as client:
        yield url, client


def _vrnic(client: TestClient) -> str:
    tenant = client.post("/api/v1/tenants", json={"name": "acme"}).json()
    made = client.post("/api/v1/vrnics", json={}, headers={"Authorization": f"Bearer {tenant['token']}"})
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def test_the_hook_admits_binds_and_unbinds_through_the_api(served: tuple[str, TestClient], backend: BackendService,
                                                           operator_token: str, tmp_path: Path) -> None:
    url, client = served
    vrnic = _vrnic(client)
    hook = _hook(tmp_path, url, operator_token)
    rc, err, record = hook.run("prepare", vrnic, importtime=True)
    assert (rc, record["outcome"]) == (0, "allowed"), err
    imported = {line.split("|")[-1].strip().split(".")[0] for line in err.splitlines()
                if line.startswith("import time:")}
    assert "vrnic" in imported and not imported & {"httpx", "pydantic", "pydantic_core", "typer", "rich"}
    assert hook.sockets.is_dir()  # QEMU binds the channel there
    assert 0 <= record["duration_ms"] <= record["process_ms"]  # the call, within the process libvirtd waits for
    rc, err, record = hook.run("started", vrnic)
    assert (rc, record["outcome"]) == (0, "bound"), err
    binding = backend.vm_bindings()["vm1"]
    assert binding.ram_path == str(tmp_path / "ram" / "libvirt/qemu/3-vm1/pc.ram") and binding.machine == "pc-q35-7.2"
    assert [v.vrnic_id for v in binding.vrnics] == [vrnic]
    assert client.get(f"/api/v1/vrnics/{vrnic}").json()["vm_domain"] == "vm1"
    rc, err, record = hook.run("stopped", vrnic)
    assert (rc, record["outcome"]) == (0, "unbound"), err
    assert backend.vm_bindings() == {}
    rc, err, record = hook.run("release", vrnic)
    assert (rc, record["outcome"]) == (0, "passed"), err  # nothing left to unbind


def test_refusals_reach_virsh_as_the_apis_sentence(served: tuple[str, TestClient], operator_token: str,
                                                   tmp_path: Path) -> None:
    url, client = served
    unknown = f"vr-{'0' * 32}"
    rc, err, record = _hook(tmp_path, url, operator_token).run("prepare", unknown)
    assert rc == 1 and record["outcome"] == "refused"
    assert f"vrnic: vRNIC {unknown} does not exist; refusing to start vm1" in err
    (tmp_path / "other").mkdir()
    rc, err, record = _hook(tmp_path / "other", url, "vro_not-a-token").run("prepare", _vrnic(client))
    assert rc == 1 and record["outcome"] == "refused" and err.strip() == "vrnic: invalid or revoked token", err


def test_an_unreachable_api_refuses_the_start_and_never_the_stop(tmp_path: Path, operator_token: str) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    hook = _hook(tmp_path, url, operator_token)
    rc, err, record = hook.run("prepare", f"vr-{'1' * 32}")
    assert rc == 1 and record["outcome"] == "refused" and "vrnicd is not reachable" in err
    rc, err, record = hook.run("stopped", f"vr-{'1' * 32}")
    assert rc == 0 and record["outcome"] == "error" and "could not unbind vm1" in err


def test_the_client_reads_answers_as_the_clis_client(served: tuple[str, TestClient], operator_token: str) -> None:
    url, _ = served
    client = HookClient(HookClientSettings(url=url, token=operator_token, timeout=10))
    assert client.request("GET", "/health")["status"] == "ok"
    assert client.request("DELETE", "/vms/vm9/binding") == {"domain": "vm9", "unbound": []}
    with pytest.raises(ApiError) as refused:
        client.request("POST", "/vms/vm9/admission", json_body={"vrnic_ids": []})
    assert refused.value.status == 422 and refused.value.problem["code"]
    with pytest.raises(ApiError) as unauthenticated:
        HookClient(HookClientSettings(url=url, token=None, timeout=10)).request("GET", "/vms")
    assert unauthenticated.value.status == 401
    assert client.with_url(url + "/").request("GET", "/vms") == {"items": []}  # the same token elsewhere


def test_settings_come_from_the_wrapper_scripts_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("vro_abc\n")
    read = HookClientSettings.from_environ({"VRNIC_API_URL": "http://10.0.0.1:9", "VRNIC_API_TOKEN_FILE":
                                            str(token_file), "VRNIC_API_TIMEOUT": "7"})
    assert read == HookClientSettings(url="http://10.0.0.1:9", token="vro_abc", timeout=7.0)
    assert HookClientSettings.from_environ({"VRNIC_API_TOKEN": "vro_x", "VRNIC_API_TOKEN_FILE": str(token_file)}) \
        == HookClientSettings(url="http://127.0.0.1:8470", token="vro_x", timeout=30.0)
    (tmp_path / "operator-token").write_text("vro_state\n")
    assert HookClientSettings.from_environ({"VRNIC_STATE_DIR": str(tmp_path)}).token == "vro_state"
    with pytest.raises(InvalidArgument, match="VRNIC_API_TIMEOUT"):
        HookClientSettings.from_environ({"VRNIC_API_TIMEOUT": "soon"})
    with pytest.raises(InvalidArgument, match="http"):
        HookClient(HookClientSettings(url="unix:///run/vrnic.sock", token=None, timeout=1))
    with pytest.raises(Unavailable):
        HookClient(HookClientSettings(url="http://127.0.0.1:1", token=None, timeout=1)).request("GET", "/health")


def test_the_binding_it_sends_is_a_vm_binding() -> None:
    from vrnic.vm.hook import binding_for, parse_hook_call

    event = parse_hook_call(["vm1", "started", "begin", "-"], DOMAIN_XML.format(vrnic="v-1", sockets="/run/s"))
    sent = binding_for(event, Path("/ram"))
    assert VmBinding.model_validate(sent).model_dump(mode="json") == sent
