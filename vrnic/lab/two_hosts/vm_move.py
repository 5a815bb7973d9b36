"""A VM under RDMA traffic on host a, moved to host b by the operator's REST calls: the two-hosts tests and bench
share it.

The VM (raw QEMU, the migratable image) runs on a, bound through a's API (PUT /vms/{domain}/binding, as the
libvirt hook does); a peer process on a streams sequence-numbered RDMA WRITEs and SENDs into it
(vrnic.lab.migration_rig). A move: b starts an incoming QEMU (vrnic.lab.two_hosts.vm_target through b's control
server), a's API prepares the hand-over (POST /vms/{domain}/handover), a's QEMU migrates to b's, and once b's
QEMU is paused a's API switches the vRNIC over (POST .../switchover) and b's QEMU runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from vrnic.core.specs import AttachInfo, VmBinding, VmVrnic
from vrnic.errors import LabError
from vrnic.lab.migration_rig import (
    WRITE_AT,
    Streaming,
    boot_and_stream,
    identity,
    start_vm,
    stream_problems,
)
from vrnic.lab.two_hosts.rig import Rig, lab_addrs
from vrnic.lab.two_hosts.vm_target import RemoteVm, migrate_source_only

PAUSED_TIMEOUT_S = 60.0  # b finishes loading a moment after a says completed


class RestBinder:
    """stream_into_vm's bind_vm, as the libvirt hook does it: PUT /vms/{domain}/binding on a's API."""

    def __init__(self, api: httpx.Client) -> None:
        self.api = api

    def bind_vm(self, binding: VmBinding) -> None:
        reply = self.api.put(f"/vms/{binding.domain}/binding", json=binding.model_dump(mode="json"))
        if reply.status_code != 200:
            raise LabError(f"binding VM {binding.domain}: {reply.status_code} {reply.text}")


@dataclass
class MovingVm:
    """A VM streaming on a, and the QEMU on b it moves to."""

    rig: Rig
    api: httpx.Client  # a's API, as the operator
    domain: str
    image: Path
    accel: Literal["kvm", "tcg"]
    vrnic_id: str
    stream: Streaming
    who: dict[str, Any]  # the program's whoami before the move
    memory_mib: int
    dest: RemoteVm | None = None
    timings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, rig: Rig, api: httpx.Client, domain: str, image: Path, accel: Literal["kvm", "tcg"],
              workdir: Path, vm_row: dict[str, Any], peer_row: dict[str, Any], memory_mib: int = 256) -> MovingVm:
        vm_info, peer_info = (AttachInfo.model_validate(row["attach"]) for row in (vm_row, peer_row))

        # a loaded lab: the nested VM reached /init after 97 s once
        stream = boot_and_stream(RestBinder(api), lambda: api.delete(f"/vms/{domain}/binding"), domain,
                                 lambda boot_dir: start_vm(f"{domain}-a", image, boot_dir, accel,
                                                           memory_mib=memory_mib),
                                 workdir, vm_info, peer_info, ready_timeout=600)
        moving = cls(rig, api, domain, image, accel, str(vm_row["id"]), stream, stream.control.call("whoami"),
                     memory_mib)
        moving.timings["boot_to_ready_s"] = stream.ready_s
        return moving

    def start_destination(self, port: int) -> VmBinding:
        """An incoming QEMU on b (one per move); the binding a's API hands over to."""
        if self.dest is not None:
            self.dest.close()
        self.dest = RemoteVm(self.rig.control)
        started = self.dest.call("start_migratable", name=f"{self.domain}-b", workdir=f"/tmp/{self.domain}-b",
                                 image=str(self.image), accel=self.accel, incoming=f"tcp:{lab_addrs()['b']}:{port}",
                                 memory_mib=self.memory_mib)
        return VmBinding(domain=self.domain, ram_path=started["ram_path"], machine="q35",
                         vrnics=[VmVrnic(vrnic_id=self.vrnic_id, channel_socket=started["channel_socket"])])

    def prepare(self, target: VmBinding) -> httpx.Response:
        return self.api.post(f"/vms/{self.domain}/handover",
                             json={"host": "b", "binding": target.model_dump(mode="json")})

    def move(self, port: int, prepared_then: Callable[[], None] | None = None) -> dict[str, Any]:
        """The whole move; its numbers (also kept in self.timings). LabError if any step fails. prepared_then runs
        once the hand-over is prepared, as QEMU starts migrating."""
        target = self.start_destination(port)
        assert self.dest is not None
        t0 = time.monotonic()
        prepared = self.prepare(target)
        if prepared.status_code != 200:
            raise LabError(f"prepare: {prepared.status_code} {prepared.text}")
        self.timings["prepare_ms"] = (time.monotonic() - t0) * 1000
        if prepared_then is not None:
            prepared_then()
        qemu = migrate_source_only(self.stream.vm, f"tcp:{lab_addrs()['b']}:{port}", timeout=600)
        t_completed = time.monotonic()
        deadline = time.monotonic() + PAUSED_TIMEOUT_S
        while (state := self.dest.call("status"))["status"] != "paused":
            if time.monotonic() > deadline:
                raise LabError(f"b's QEMU is {state['status']}, not paused, {PAUSED_TIMEOUT_S:.0f} s after the "
                               "migration completed")
            time.sleep(0.02)
        t_switch = time.monotonic()
        switched = self.api.post(f"/vms/{self.domain}/handover/switchover")
        if switched.status_code != 200:
            raise LabError(f"switchover: {switched.status_code} {switched.text}")
        self.dest.call("cont")
        t_resumed = time.monotonic()
        self.stream.vm.stop()
        report = switched.json()
        self.timings.update(qemu_total_ms=qemu["total_ms"], qemu_downtime_ms=qemu["downtime_ms"],
                            switchover_ms=report["total_ms"], switchover_wall_ms=(t_resumed - t_switch) * 1000,
                            total_ms=(t_resumed - t0) * 1000, transferred=qemu["transferred"], report=report,
                            started=t0, completed=t_completed, switch_started=t_switch, resumed=t_resumed)
        return self.timings

    def problems(self, done: dict[str, Any]) -> list[str]:
        """What the moved VM got wrong, given the peer's stop report: every write the peer saw complete must be
        in b's guest RAM (the program's reading and QMP's), every SEND received once, in order, and the program
        must be the same one. Empty if nothing."""
        assert self.dest is not None
        writes, sends = done["writes"], done["sends"]
        same = identity(self.dest.call("control", verb="whoami")) == identity(self.who)
        received = self.dest.call("control", verb="recv_stream_stop", args={"expect": len(sends), "timeout": 30})
        slots = self.dest.call("control", verb="check_slots",
                               args={"offset": WRITE_AT, "count": len(writes) + 1, "size": 8})["seqs"]
        found = stream_problems(done, received, slots)
        return found if same else ["the program on b is not the one that ran on a", *found]

    def close(self) -> None:
        self.stream.close()
        for host in ("b", "a"):
            with self.rig.client(host) as api:
                api.delete(f"/vms/{self.domain}/binding")
        if self.dest is not None:
            self.dest.close()
        self.stream.vm.stop()
