"""`vrnic vm attach|detach|list` and `vrnic hook install|uninstall`: vRNICs of libvirt domains.

attach: the API records the domain (tenant checks there), then the domain's persistent XML gains
what the vRNIC needs (libvirt-python). If the XML step fails, the record is undone.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Annotated, Any

import typer

from vrnic.cli.client import ApiClient, ClientSettings, JsonFlag, api, fail, show
from vrnic.errors import VrnicError
from vrnic.vm.domain_edit import (
    attach_hostdev,
    attach_vrnic,
    detach_vrnic,
    hostdev_alias,
    note_added_controllers,
    vrnics_in,
)
from vrnic.vm.domain_xml import DEFAULT_CHANNEL
from vrnic.vm.hook import CHAINED_SUFFIX, DEFAULT_MEMORY_BACKING_DIR, MARKER, hook_wrapper_script
from vrnic.vm.libvirt_edge import DEFAULT_URI, Domain, connect

app = typer.Typer(help="vRNICs of libvirt/QEMU VMs: attach, detach, list.", no_args_is_help=True)
hook_app = typer.Typer(help="The libvirt qemu hook that binds VMs to vrnicd.", no_args_is_help=True)

CHANNEL_DIR = Path("/run/vrnic/vm")
UriOpt = Annotated[str, typer.Option("--connect", "-c", help="libvirt URI.")]


def channel_socket(domain: str, port: str = DEFAULT_CHANNEL) -> Path:
    """Where QEMU listens for the vRNIC's channel (the hook re-creates the directory at prepare)."""
    return CHANNEL_DIR / domain / f"{port}.sock"


@app.command()
def attach(domain: Annotated[str, typer.Argument(help="libvirt domain name.")],
           vrnic: Annotated[str, typer.Option("--vrnic", help="The vRNIC id.")],
           uri: UriOpt = DEFAULT_URI) -> None:
    """Attach a vRNIC to a domain: its persistent definition changes; a running domain gets it at its next
    start (paravirtual: shared RAM cannot be hot-plugged) or at once (SR-IOV: the VF is hot-plugged)."""
    try:
        with connect(uri) as libvirt, api() as client:
            target = libvirt.domain(domain)
            found = client.request("GET", f"/vrnics/{vrnic}")
            client.request("PUT", f"/vrnics/{vrnic}/vm", json_body={"domain": domain})
            try:
                message = _attach_xml(libvirt, target, client, found)
            except BaseException:
                client.request("DELETE", f"/vrnics/{vrnic}/vm")  # undo the record: nothing half-attached
                raise
    except VrnicError as exc:
        fail(str(exc))
    typer.echo(message)


def _attach_xml(libvirt: Any, target: Domain, client: ApiClient, vrnic: dict[str, Any]) -> str:
    xml = target.persistent_xml()
    running = target.is_active()
    if vrnic["mode"] == "sriov":
        alias = hostdev_alias(vrnic["id"])
        interface = client.request_text("GET", f"/vrnics/{vrnic['id']}/hostdev", params={"alias": alias})
        if running:
            target.attach_device_live(interface)  # live and persistent
            xml = target.persistent_xml()
        libvirt.define(attach_hostdev(xml, vrnic["id"], interface), target.name)
        when = "hot-plugged now" if running else "at the next start"
        return f"vRNIC {vrnic['id']} (SR-IOV VF) attached to {target.name}: {when}"
    socket = channel_socket(target.name)
    socket.parent.mkdir(parents=True, exist_ok=True)
    libvirt.define(attach_vrnic(xml, vrnic["id"], socket), target.name)
    noted = note_added_controllers(xml, target.persistent_xml(), vrnic["id"])
    if noted is not None:  # what libvirt added for the channel goes again at detach
        libvirt.define(noted, target.name)
    when = ("the domain is running: this takes effect at its next start" if running
            else "it takes effect when the domain starts")
    return f"vRNIC {vrnic['id']} attached to {target.name} (channel {socket}); {when}"


@app.command()
def detach(domain: Annotated[str, typer.Argument(help="libvirt domain name.")],
           vrnic: Annotated[str | None, typer.Option("--vrnic", help="Only this vRNIC (default: all).")] = None,
           uri: UriOpt = DEFAULT_URI) -> None:
    """Detach vRNICs from a domain. A running VM loses the vRNIC's service now; the channel device goes
    at its next start."""
    try:
        with connect(uri) as libvirt, api() as client:
            target = libvirt.domain(domain)
            xml = target.persistent_xml()
            running = target.is_active()
            entries = {e.vrnic_id: e for e in vrnics_in(xml)}
            new_xml, removed = detach_vrnic(xml, vrnic)
            for vrnic_id in removed:
                if entries[vrnic_id].mode == "sriov" and running:  # the VF leaves the running VM too
                    for interface in _interfaces_with_alias(xml, hostdev_alias(vrnic_id)):
                        target.detach_device_live(interface)
            libvirt.define(new_xml, domain)
            for vrnic_id in removed:
                client.request("DELETE", f"/vrnics/{vrnic_id}/vm")
    except VrnicError as exc:
        fail(str(exc))
    if not removed:
        typer.echo(f"{domain} has no vRNIC")
    for vrnic_id in removed:
        typer.echo(f"vRNIC {vrnic_id} detached from {domain}")


def _interfaces_with_alias(domain_xml: str, alias: str) -> list[str]:
    root = ET.fromstring(domain_xml)
    return [ET.tostring(i, encoding="unicode") for i in root.findall("devices/interface")
            if (a := i.find("alias")) is not None and a.get("name") == alias]


@app.command("list")
def list_(as_json: JsonFlag = False) -> None:
    """Operator: the running VMs vrnicd serves."""
    with api() as client:
        items = client.request("GET", "/vms")["items"]
    show(items, as_json, ["domain", "machine", ("vrnics", lambda b: [v["vrnic_id"] for v in b["vrnics"]]),
                          "ram_path"])


@hook_app.command("install")
def hook_install(
    hooks_dir: Annotated[Path, typer.Option(help="libvirt's hooks directory.")] = Path("/etc/libvirt/hooks"),
    memory_backing_dir: Annotated[Path, typer.Option(help="qemu.conf memory_backing_dir.")]
        = DEFAULT_MEMORY_BACKING_DIR,
    api_url: Annotated[str | None, typer.Option(help="The vrnic API (default: VRNIC_API_URL or local).")] = None,
    token_file: Annotated[Path | None, typer.Option(help="The operator token file the hook reads.")] = None,
    log: Annotated[Path | None, typer.Option(help="Append each hook call as a JSON line here.")] = None,
) -> None:
    """Install the qemu hook (idempotent). A hook already there is kept and runs first."""
    settings = ClientSettings()
    hooks_dir.mkdir(parents=True, exist_ok=True)
    hook = hooks_dir / "qemu"
    chained = hook.with_name(hook.name + CHAINED_SUFFIX)
    if hook.exists() and MARKER not in hook.read_text(errors="replace"):
        if chained.exists():
            fail(f"{hook} is not vrnic's and {chained} exists too; resolve by hand")
        hook.rename(chained)
        typer.echo(f"kept the existing hook as {chained}; it runs first")
    pythonpath = None if _importable_without_path() else Path(__file__).resolve().parents[2]
    text = hook_wrapper_script(Path(sys.executable), pythonpath, api_url or settings.url,
                               token_file or settings.token_file, memory_backing_dir, log,
                               chained if chained.exists() else None)
    if hook.exists() and hook.read_text() == text:
        typer.echo(f"{hook} is up to date")
        return
    partial = hook.with_name(".qemu.vrnic-new")
    partial.write_text(text)
    partial.chmod(0o755)
    partial.replace(hook)
    typer.echo(f"installed {hook}; libvirtd reads hooks when it starts: restart it if it runs")


@hook_app.command("uninstall")
def hook_uninstall(hooks_dir: Annotated[Path, typer.Option(help="libvirt's hooks directory.")]
                   = Path("/etc/libvirt/hooks")) -> None:
    """Remove vrnic's hook and put back the one it chained, if any."""
    hook = hooks_dir / "qemu"
    chained = hook.with_name(hook.name + CHAINED_SUFFIX)
    if not hook.exists() or MARKER not in hook.read_text(errors="replace"):
        typer.echo(f"{hook} is not vrnic's; nothing to do")
        return
    if chained.exists():
        chained.replace(hook)
        typer.echo(f"restored the earlier hook at {hook}")
    else:
        hook.unlink()
        typer.echo(f"removed {hook}")


def _importable_without_path() -> bool:
    """True when vrnic is an installed package; a checkout (or an editable install) needs PYTHONPATH."""
    return "site-packages" in Path(__file__).resolve().parts or "dist-packages" in Path(__file__).resolve().parts
