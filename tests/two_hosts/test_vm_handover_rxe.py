"""Issue 11 across hosts on real rxe: a VM whose program is in the middle of RDMA traffic live-migrates from host a
to host b (raw QEMU over the lab link), and its vRNIC moves from a's `vrnic daemon` to b's through the operator's
REST calls (POST /vms/{domain}/handover, .../switchover); the peer on a is re-pointed by a's agent, which finds
the VM on b through the database.

The VM runs the migratable image (vrnic.lab.vm_guest) under nested KVM where the lab guests offer it; the peer
(vrnic.lab.migration_peer) streams sequence-numbered RDMA WRITEs into the VM's MR and every fourth number also
as a SEND. Checked: every write the peer saw complete is in the destination's guest RAM (QMP pmemsave on b and the
program's own reading), the SENDs arrived in order, none lost or duplicated, the program never restarted, and
`rdma res` on a is back to its baseline once the peer is gone. Numbers go to .lab/two-hosts/vm-handover-rxe.json.

Run: vrnic lab run --topology two-hosts --timeout 900 -- python -m vrnic.lab.two_hosts -- \
     env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -m two_hosts -p no:cacheprovider -s \
     tests/two_hosts/test_vm_handover_rxe.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.config import PROJECT_DIR, lab_output_dir
from vrnic.core.specs import AttachInfo, VmBinding, VmVrnic
from vrnic.lab.migration_rig import WRITE_AT, identity, largest_gap_ms, start_vm, stream_into_vm
from vrnic.lab.two_hosts.rig import Rig, lab_addrs
from vrnic.lab.two_hosts.vm_target import RemoteVm, migrate_source_only
from vrnic.lab.vm_guest import build_migratable_initramfs
from vrnic.lab.vm_host import ensure_kvm

from .support import eventually, release

SHARED = lab_output_dir("two-hosts", "xvm")
DOMAIN = "xmig"
PORT = 18651
MR_BYTES = 1 << 20


DIAGNOSE = ("sh", "-c", "rdma res show qp; for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do "
            "echo $(basename $f) $(cat $f); done")


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    """The two agents, with a long heartbeat window: the loaded lab misses beats for seconds, and a host marked
    down is unreachable to peers (the locator names up hosts only)."""
    with Rig.start(agent_env={"VRNIC_HOST_DOWN_AFTER_S": "120"}) as started:
        yield started


def diagnose(rig: Rig) -> None:
    """Both hosts' QPs and rxe counters, and a debug dump (SIGUSR1) of both agents into their logs."""
    print("---- a:", subprocess.run(DIAGNOSE, capture_output=True, text=True, check=False).stdout)
    print("---- b:", rig.run_on_b(list(DIAGNOSE)).get("stdout"))
    pid = rig.agents["a"].pid  # type: ignore[attr-defined]
    if pid:
        os.kill(pid, signal.SIGUSR1)
    status = rig.control.call("agent.status")
    if status.get("pid"):
        rig.run_on_b(["kill", "-USR1", str(status["pid"])])
    time.sleep(2)


class RestBinder:
    """stream_into_vm's bind_vm, as the libvirt hook does it: PUT /vms/{domain}/binding on a's API."""

    def __init__(self, api: httpx.Client) -> None:
        self.api = api

    def bind_vm(self, binding: VmBinding) -> None:
        reply = self.api.put(f"/vms/{binding.domain}/binding", json=binding.model_dump(mode="json"))
        assert reply.status_code == 200, reply.text


def test_a_vm_under_traffic_moves_to_host_b_with_its_vrnic(rig: Rig, tmp_path: Path) -> None:
    for tool in ("qemu-system-x86_64", "cpio", "ldd"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    kvm_b = rig.run_on_b([sys.executable, "-c", "from vrnic.lab.vm_host import ensure_kvm; print(ensure_kvm())"])
    accel = "kvm" if ensure_kvm() and str(kvm_b.get("stdout", "")).strip() == "True" else "tcg"
    print(f"\nnested VMs under {accel}")
    SHARED.mkdir(parents=True, exist_ok=True)
    image = build_migratable_initramfs(os.uname().release, SHARED / "migratable.cpio.gz", PROJECT_DIR,
                                       program_args=("--mr-bytes", str(MR_BYTES)))
    token = rig.make_tenant("mover")
    vm_row, peer_row = rig.allocate("a", token), rig.allocate("a", token)
    baseline = resource_counts()
    timings: dict[str, Any] = {"accel": accel}
    dest = RemoteVm(rig.control)
    source = stream = None
    api = rig.client("a")
    try:
        source = start_vm("src", image, tmp_path, accel)  # type: ignore[arg-type]
        stream = stream_into_vm(RestBinder(api), DOMAIN, source, AttachInfo.model_validate(vm_row["attach"]),
                                AttachInfo.model_validate(peer_row["attach"]),
                                ready_timeout=600)  # a loaded lab: the nested VM reached /init after 97 s once
        timings["boot_to_ready_s"] = stream.ready_s
        who = stream.control.call("whoami")
        time.sleep(1.0)  # traffic before
        b = lab_addrs()["b"]
        started = dest.call("start_migratable", name="dst", workdir="/tmp/xvm-b", image=str(image), accel=accel,
                            incoming=f"tcp:{b}:{PORT}")
        target = VmBinding(domain=DOMAIN, ram_path=started["ram_path"], machine="q35",
                           vrnics=[VmVrnic(vrnic_id=vm_row["id"], channel_socket=started["channel_socket"])])
        t0 = time.monotonic()
        prepared = api.post(f"/vms/{DOMAIN}/handover", json={"host": "b", "binding": target.model_dump(mode="json")})
        assert prepared.status_code == 200, prepared.text
        timings["prepare_ms"] = (time.monotonic() - t0) * 1000
        qemu = migrate_source_only(source, f"tcp:{b}:{PORT}", timeout=600)
        paused = eventually(lambda: dest.call("status")["status"] == "paused", timeout=60, every=0.05)
        assert paused, dest.call("status")
        t_switch = time.monotonic()
        switched = api.post(f"/vms/{DOMAIN}/handover/switchover")
        assert switched.status_code == 200, switched.text
        dest.call("cont")
        t_resumed = time.monotonic()
        report = switched.json()
        timings.update(qemu_total_ms=qemu["total_ms"], qemu_downtime_ms=qemu["downtime_ms"],
                       switchover_ms=report["total_ms"], switchover_wall_ms=(t_resumed - t_switch) * 1000,
                       total_ms=(t_resumed - t0) * 1000, transferred=qemu["transferred"], report=report)
        source.stop()
        time.sleep(1.5)  # traffic after, to the VM on b
        done = stream.peer.ask({"op": "stop"})
        if done["errors"]:
            diagnose(rig)
        assert not done["errors"], done["errors"]
        writes, sends = done["writes"], done["sends"]
        assert len(writes) > 20 and writes == list(range(1, len(writes) + 1))
        assert any(t > t_resumed for t in done["times"]), "no write completed after the VM resumed on b"
        stream.control.close()
        assert identity(dest.call("control", verb="whoami")) == identity(who)  # the same program, never restarted
        got = dest.call("control", verb="recv_stream_stop", args={"expect": len(sends), "timeout": 30})
        assert got["errors"] == [] and got["seqs"] == sends, (got, sends)
        slots = dest.call("control", verb="check_slots", args={"offset": WRITE_AT, "count": len(writes) + 1,
                                                             "size": 8})["seqs"]
        assert slots[1:] == writes  # every completed write, in b's guest RAM, as the program reads it
        saved = SHARED / "xmig-slots.bin"
        saved.unlink(missing_ok=True)
        dest.call("pmemsave", address=stream.info["addr"] + WRITE_AT, size=8 * (len(writes) + 1), path=str(saved))
        raw = saved.read_bytes()
        assert [int.from_bytes(raw[8 * s:8 * s + 8], "little") for s in writes] == writes  # and through QMP on b
        assert report["peers_repointed"] >= 1 and report["broken_qps"] == 0, report
        row = api.get(f"/vrnics/{vm_row['id']}").json()
        assert row["host"] == "b", row
        timings.update(peer_blackout_ms=largest_gap_ms(done["times"]), writes=len(writes), sends=len(sends))
        stream.peer.close()
        # a keeps nothing of the VM: with the peer gone, its rxe0 is back to where it was before the test
        back = eventually(lambda: resource_counts() == baseline, timeout=30)
        assert back, (resource_counts(), baseline)
    finally:
        (SHARED.parent / "vm-handover-rxe.json").write_text(json.dumps(timings, indent=2, default=str))
        print(f"cross-host hand-over: {json.dumps(timings, default=str)}")
        if stream is not None:
            stream.close()
        with rig.client("b") as api_b:
            api_b.delete(f"/vms/{DOMAIN}/binding")
        api.delete(f"/vms/{DOMAIN}/binding")
        dest.close()
        if source is not None:
            source.stop()
        api.close()
        release(rig, vm_row, peer_row)
