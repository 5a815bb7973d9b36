"""`vrnic vm attach|detach` against a real libvirtd on the host, with the REST API in process (fake driver).

The domain's persistent definition, as libvirtd keeps it, gains shared RAM, the vRNIC's channel and
its metadata, and detach gives back exactly what was there.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from vrnic.backend.driver import load_driver
from vrnic.backend.service import BackendService
from vrnic.cli.main import app
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import serve_in_process
from vrnic.vm.domain_edit import canonical
from vrnic.vm.domain_xml import DirectKernelBoot, DomainType, VmDomain

OPERATOR = "operator-token-of-the-libvirt-tier"
NAME = "vrnic-libvirt-tier-attach"


@pytest.fixture
def api_url(tmp_path: Path) -> Iterator[str]:
    settings = DaemonSettings(state_dir=tmp_path, operator_token=SecretStr(OPERATOR), host_name="libvirt-tier",
                              paravirtual_driver="fake", sriov_driver=None, listen_port=0)
    backend = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake")})
    try:
        with serve_in_process(settings, backend) as url:
            yield url
    finally:
        backend.close()


def _canon(text: str) -> str:
    return canonical(text)


def test_attach_and_detach_round_trip_the_persistent_xml(libvirt_conn: Any, api_url: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import libvirt

    operator = httpx.Client(base_url=f"{api_url}/api/v1", headers={"Authorization": f"Bearer {OPERATOR}"})
    token = operator.post("/tenants", json={"name": "acme"}).json()["token"]
    vrnic = httpx.post(f"{api_url}/api/v1/vrnics", json={}, headers={"Authorization": f"Bearer {token}"}).json()
    monkeypatch.setenv("VRNIC_API_URL", api_url)
    monkeypatch.setenv("VRNIC_API_TOKEN", token)
    spec = VmDomain(name=NAME, domain_type=DomainType.QEMU, shared_file_memory=False,
                    boot=DirectKernelBoot(kernel=Path("/boot/vmlinuz"), cmdline="console=ttyS0"))
    domain = libvirt_conn.defineXML(spec.to_xml())
    runner = CliRunner()
    try:
        original = domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        unknown = runner.invoke(app, ["vm", "attach", "vrnic-no-such-domain", "--vrnic", vrnic["id"]])
        assert unknown.exit_code == 1 and "no domain vrnic-no-such-domain" in unknown.output
        attached = runner.invoke(app, ["vm", "attach", NAME, "--vrnic", vrnic["id"]])
        assert attached.exit_code == 0, attached.output
        assert "takes effect when the domain starts" in attached.output
        kept = ET.fromstring(domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        assert kept.find("memoryBacking/access[@mode='shared']") is not None
        channel = kept.find("devices/channel/target[@name='org.vrnic.0']/../source")
        assert channel is not None and channel.get("path") == f"/run/vrnic/vm/{NAME}/org.vrnic.0.sock"
        assert vrnic["id"] in ET.tostring(kept.find("metadata"), encoding="unicode")  # type: ignore[arg-type]
        assert operator.get(f"/vrnics/{vrnic['id']}").json()["vm_domain"] == NAME
        detached = runner.invoke(app, ["vm", "detach", NAME])
        assert detached.exit_code == 0, detached.output
        assert _canon(domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == _canon(original)
        assert operator.get(f"/vrnics/{vrnic['id']}").json()["vm_domain"] is None
    finally:
        domain.undefine()
