"""A vRNIC in a VM against native pyverbs and against a container guest, in the same run (inside the lab).

The VM is a nested KVM guest under a real libvirtd, set up like an operator does
(vrnic.lab.vm_lab: vrnic daemon, hook, `vrnic vm attach`, `virsh start`). Its
partner is a container guest on the lab host, so each number crosses vrnicd
twice, as the container baseline (two container guests) does.

- vm.attach_ms: the libvirt hook's `started` (the hook process asks the daemon, vrnicd maps the RAM
  and connects the channel), as the hook logs it, plus the guest's own attach over the channel.
- vm.send_lat_64b: half the round trip of a 64-byte SEND ping-pong, VM <-> container guest.
- vm.rdma_write_64k: RDMA WRITE throughput from the VM, 64 KiB per write, 16 in flight.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from bench.harness import Record
from vrnic.core.specs import AttachInfo
from vrnic.lab.vm_guest import HostPeer
from vrnic.lab.vm_lab import VmLab

DOMAIN = "bench-vm"
LATENCY_ITERATIONS = 200
WRITES = 400


def run(native_records: list[Record], paravirt_records: list[Record]) -> list[Record]:
    native = {r.name: r.value for r in native_records}
    container = {r.name: r.value for r in paravirt_records}
    with tempfile.TemporaryDirectory(prefix="vrnic-bench-vm-", dir="/run") as tmp, VmLab(Path(tmp)) as lab:
        token = lab.tenant("bench")
        vm_vrnic = lab.allocate(token, "rxe0")
        peer_vrnic = lab.allocate(token, "rxe1")
        files = lab.define_vm(DOMAIN)
        lab.vrnic("vm", "attach", DOMAIN, "--vrnic", vm_vrnic["id"], token=token)
        started = lab.virsh("start", DOMAIN)
        if started.returncode != 0:
            raise RuntimeError(f"virsh start: {started.stderr.strip()}")
        control = lab.control(files)
        peer = HostPeer(AttachInfo(**peer_vrnic["attach"]))
        try:
            vm = control.ready(timeout=180)
            hook = [e for e in lab.hook_events(DOMAIN) if e.get("op") == "started"]
            attach_ms = float(hook[-1]["duration_ms"]) + float(vm["attach_ms"])
            control.call("connect", **peer.info())
            peer.connect(vm)
            echo = threading.Thread(target=peer.echo, args=(LATENCY_ITERATIONS,), daemon=True)
            echo.start()
            round_trip_us = control.call("ping", iterations=LATENCY_ITERATIONS)["round_trip_us"]
            echo.join(timeout=60)
            stream = control.call("write_stream", size=64 * 1024, iterations=WRITES, depth=16)
        finally:
            peer.close()
            control.close()
            lab.virsh("destroy", DOMAIN)
    latency = round_trip_us / 2
    throughput = float(stream["mb_per_s"])
    return [
        Record("vm.attach_ms", "ms", attach_ms),
        Record("vm.send_lat_64b", "us", latency, native["native.send_lat_64b"]),
        Record("vm.send_lat_64b_vs_container", "us", latency, container["paravirt.send_lat_64b"]),
        Record("vm.rdma_write_64k", "MB/s", throughput, native["native.rdma_write_64k"], better="higher"),
        Record("vm.rdma_write_64k_vs_container", "MB/s", throughput, container["paravirt.rdma_write_64k"],
               better="higher"),
    ]
