"""`make demo-vm`: a vRNIC in a real VM, shown inside the lab (nested KVM under a real libvirtd).

Run inside the lab: `vrnic lab run -- python -m vrnic.lab.vm_demo`.
1. a VM host: libvirtd, `vrnic daemon` (REST API + vrnicd on rxe), `vrnic hook install`;
2. a domain, and two vRNICs of one tenant allocated through the API (one for the VM, one for a
   container guest on this host);
3. `vrnic vm attach`: the domain's definition gains shared RAM, the vRNIC's channel and its metadata;
4. `virsh start`: the hook admits the domain (prepare) and vrnicd binds it (started);
5. inside the VM a guest program does SEND/RECV, RDMA WRITE and READ with the container guest, both
   directions, bytes verified; the container guest's RDMA WRITE lands in the VM's own buffer;
6. `virsh shutdown`, and `rdma res` back at its baseline.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.specs import AttachInfo
from vrnic.errors import VrnicError
from vrnic.lab.vm_guest import HostPeer
from vrnic.lab.vm_lab import VmLab

DOMAIN = "demo-vm"


def _wait(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def run(console: Console, workdir: Path) -> int:
    devices = rdma_devices()
    if not devices:
        console.print("demo-vm needs an RDMA device (the lab's Soft-RoCE)")
        return 1
    step = 0

    def say(text: str) -> None:
        console.print(f"   {text}", markup=False, highlight=False)

    def title(text: str) -> None:
        nonlocal step
        step += 1
        console.print(f"[bold]{step}. {text}[/bold]")

    baseline = resource_counts()
    title("A VM host: libvirtd, vrnic daemon, the libvirt hook")
    with VmLab(workdir, say) as lab:
        title("A domain, and two vRNICs of tenant acme allocated through the REST API")
        token = lab.tenant("acme")
        vm_vrnic = lab.allocate(token, devices[0])
        peer_vrnic = lab.allocate(token, devices[-1])
        files = lab.define_vm(DOMAIN)
        say(f"domain {DOMAIN} defined; vRNIC {vm_vrnic['id']} for the VM ({vm_vrnic['virtual_gid']}), "
            f"{peer_vrnic['id']} for a container guest ({peer_vrnic['virtual_gid']})")
        title(f"vrnic vm attach {DOMAIN} --vrnic {vm_vrnic['id']}")
        say(lab.vrnic("vm", "attach", DOMAIN, "--vrnic", vm_vrnic["id"], token=token).strip())
        title(f"virsh start {DOMAIN}: the hook admits it and vrnicd binds it")
        t0 = time.monotonic()
        started = lab.virsh("start", DOMAIN)
        if started.returncode != 0:
            console.print(f"[red]virsh start failed:[/red] {started.stderr.strip()}")
            return 1
        say(f"{started.stdout.strip()} ({time.monotonic() - t0:.1f} s)")
        for event in lab.hook_events(DOMAIN):
            say(f"hook {event.get('op')}: {event.get('outcome', '')} {event.get('duration_ms', 0):.0f} ms")
        title("Inside the VM: RDMA with a container guest on this host, both directions")
        control = lab.control(files)
        peer = None
        try:
            vm = control.ready(timeout=180)
            say(f"the VM's guest program attached in {vm['attach_ms']:.0f} ms "
                f"(arena on {'2 MiB hugepages' if vm['hugepages'] else '4 KiB pages'}), virtual GID {vm['gid']}")
            peer = HostPeer(AttachInfo(**peer_vrnic["attach"]))
            control.call("connect", **peer.info())
            peer.connect(vm)
            message = b"SEND from the VM " + secrets.token_hex(4).encode()
            peer.post_recv()
            control.call("send", data=message.hex())
            peer.cq.wait(1, timeout=30)
            assert peer.mr.read(len(message)) == message, "SEND VM -> host: wrong bytes"
            say(f"VM -> container SEND: {message.decode()!r} received")
            reply = b"SEND from the container " + secrets.token_hex(4).encode()
            control.call("post_recv", count=1)
            peer.send(reply)
            assert control.call("wait_recv", count=1)["received"] == [reply.hex()], "SEND host -> VM: wrong bytes"
            say(f"container -> VM SEND: {reply.decode()!r} received")
            into = b"RDMA WRITE into the VM's buffer " + secrets.token_hex(4).encode()
            peer.write_into_vm(into, vm_offset=65536)
            assert control.call("peek", offset=65536, length=len(into))["data"] == into.hex()
            say(f"container -> VM RDMA WRITE: the VM reads {into.decode()!r} in its own memory")
            out = b"RDMA WRITE from the VM " + secrets.token_hex(4).encode()
            control.call("write", data=out.hex(), remote_offset=32768)
            assert peer.mr.read(len(out), 32768) == out
            read = bytes.fromhex(control.call("read", length=len(out), remote_offset=32768)["data"])
            assert read == out
            say(f"VM -> container RDMA WRITE then READ back: {read.decode()!r}")
        except (VrnicError, AssertionError, OSError) as exc:
            console.print(f"[red]RDMA with the VM failed:[/red] {exc}")
            console.print((files / "console.log").read_text()[-3000:], markup=False)
            return 1
        finally:
            if peer is not None:
                peer.close()
        title(f"virsh shutdown {DOMAIN}, then the kernel's RDMA objects")
        say(lab.virsh("shutdown", DOMAIN).stdout.strip())
        if not _wait(lambda: DOMAIN not in lab.host.running_domains(), 60):
            console.print("[red]the VM did not shut down within 60 s[/red]")
            return 1
        control.close()
        say("the VM is off; the hook's stopped/release unbound it")
        if not _wait(lambda: resource_counts() == baseline, 15):
            console.print(f"[red]kernel objects leaked:[/red] before {baseline}, after {resource_counts()}")
            return 1
        counts = "; ".join(f"{device}: " + " ".join(f"{kind} {count[kind]}" for kind in ("pd", "cq", "qp", "mr"))
                           for device, count in resource_counts().items())
        say(f"rdma res show: {counts} (the baseline)")
    console.print("[green]demo-vm: ok[/green]")
    return 0


def main() -> int:
    console = Console(highlight=False, soft_wrap=True)  # long ids and paths stay on one line
    with tempfile.TemporaryDirectory(prefix="vrnic-demo-vm-", dir="/run") as tmp:
        return run(console, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
