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
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.config import lab_output_dir
from vrnic.lab.migration_rig import WRITE_AT, identity, largest_gap_ms
from vrnic.lab.two_hosts.rig import Rig, nested_kvm_on_both
from vrnic.lab.two_hosts.vm_move import MovingVm

from .support import Rigs, eventually, migratable_image, once_moved, release

SHARED = lab_output_dir("two-hosts", "xvm")
DOMAIN = "xmig"
PORT = 18651
MR_BYTES = 1 << 20


DIAGNOSE = ("sh", "-c", "rdma res show qp; for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do "
            "echo $(basename $f) $(cat $f); done")


@pytest.fixture(scope="module")
def rig(rigs: Rigs) -> Rig:
    """The two agents, with a long heartbeat window: the loaded lab misses beats for seconds, and a host marked
    down is unreachable to peers (the locator names up hosts only)."""
    return rigs.get(agent_env={"VRNIC_HOST_DOWN_AFTER_S": "120"})


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


@pytest.fixture(scope="module")
def booting(rig: Rig) -> tuple[Path, Literal["kvm", "tcg"]]:
    """The migratable image, and the accelerator both hosts offer nested VMs."""
    for tool in ("qemu-system-x86_64", "cpio", "ldd"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    accel: Literal["kvm", "tcg"] = "kvm" if nested_kvm_on_both(rig.control) else "tcg"
    print(f"\nnested VMs under {accel}")
    SHARED.mkdir(parents=True, exist_ok=True)
    return migratable_image(MR_BYTES), accel


@dataclass
class Scene:
    moving: MovingVm
    moved: dict[str, dict[str, int]]  # what a's rdma res should show once the VM's vRNIC has left for b


@pytest.fixture
def scene(rig: Rig, booting: tuple[Path, Literal["kvm", "tcg"]], tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[Scene]:
    token = rig.make_tenant(f"mover-{request.node.name[-20:].strip('_')}")
    vm_row, peer_row = rig.allocate("a", token), rig.allocate("a", token)
    baseline = resource_counts()
    api = rig.client("a")
    moving = None
    try:
        moving = MovingVm.start(rig, api, DOMAIN, booting[0], booting[1], tmp_path, vm_row, peer_row)
        time.sleep(1.0)  # traffic before
        yield Scene(moving, once_moved(baseline, vm_row))
    finally:
        if moving is not None:
            print(f"{request.node.name}: {json.dumps(moving.timings, default=str)}")
            moving.close()
        api.close()
        release(rig, vm_row, peer_row)


def refused_without_vrnicd_at_b(rig: Rig, moving: MovingVm) -> None:
    """With b's agent stopped the move is refused, the VM keeps its vRNIC on a and streams on, and nothing is set
    up or left pending: with b back the move can be prepared and called off again."""
    objects = resource_counts()
    before = moving.stream.peer.ask({"op": "progress"})
    target = moving.start_destination(PORT)
    rig.agents["b"].stop()
    try:
        refused = moving.prepare(target)
        assert refused.status_code == 503, refused.text
        assert "cannot be reached" in refused.json()["detail"], refused.json()
    finally:
        rig.agents["b"].start()
    assert moving.stream.vm.qmp.execute("query-status")["running"]  # the VM never stopped
    assert resource_counts() == objects  # nothing was set up for the move on a, and nothing is left
    again = moving.prepare(target)
    assert again.status_code == 200, again.text
    called_off = moving.api.delete(f"/vms/{DOMAIN}/handover")
    assert called_off.status_code == 200, called_off.text
    assert eventually(lambda: resource_counts() == objects, timeout=10), (resource_counts(), objects)
    assert moving.api.get(f"/vrnics/{moving.vrnic_id}").json()["host"] == "a"
    time.sleep(1.0)
    after = moving.stream.peer.ask({"op": "progress"})
    assert after["errors"] == [] and after["completed"] > before["completed"], (before, after)


def test_a_move_refused_then_made_under_traffic_takes_the_vm_and_its_vrnic_to_b(rig: Rig, scene: Scene) -> None:
    """One VM for both (a nested boot is 1-2 min of the stage): first the refused move, then the move itself, whose
    checks cover every write and SEND of the stream, those made while the refused move was tried included."""
    moving = scene.moving
    try:
        refused_without_vrnicd_at_b(rig, moving)
        timings = moving.move(PORT)
        time.sleep(1.5)  # traffic after, to the VM on b
        done = moving.stream.peer.ask({"op": "stop"})
        if done["errors"]:
            diagnose(rig)
        assert moving.problems(done) == []
        writes, sends = done["writes"], done["sends"]
        assert len(writes) > 20
        assert any(t > timings["resumed"] for t in done["times"]), "no write completed after the VM resumed on b"
        assert moving.dest is not None
        saved = SHARED / "xmig-slots.bin"
        saved.unlink(missing_ok=True)
        moving.dest.call("pmemsave", address=moving.stream.info["addr"] + WRITE_AT, size=8 * (len(writes) + 1),
                         path=str(saved))
        raw = saved.read_bytes()
        assert [int.from_bytes(raw[8 * s:8 * s + 8], "little") for s in writes] == writes  # and through QMP on b
        report = timings["report"]
        assert report["peers_repointed"] >= 1 and report["broken_qps"] == 0, report
        assert moving.api.get(f"/vrnics/{moving.vrnic_id}").json()["host"] == "b"
        timings.update(peer_blackout_ms=largest_gap_ms(done["times"]), writes=len(writes), sends=len(sends))
        moving.stream.peer.close()
        # a keeps nothing of the VM: with the peer gone, rxe0 is as before, less the moved vRNIC
        back = eventually(lambda: resource_counts() == scene.moved, timeout=30)
        assert back, (resource_counts(), scene.moved)
    finally:
        (SHARED.parent / "vm-handover-rxe.json").write_text(json.dumps(moving.timings, indent=2, default=str))


def test_a_peer_killed_during_the_move_breaks_only_its_qp(rig: Rig, scene: Scene) -> None:
    moving = scene.moving
    peer = moving.stream.peer
    killer = threading.Timer(0.5, lambda: os.kill(peer.proc.pid, signal.SIGKILL))
    try:
        timings = moving.move(PORT, prepared_then=killer.start)  # its shadow QP made, QEMU migrating
    finally:
        killer.cancel()
    assert peer.proc.wait(10) == -signal.SIGKILL
    report = timings["report"]
    assert report["broken_qps"] == 1, report
    assert moving.dest is not None
    assert identity(moving.dest.call("control", verb="whoami")) == identity(moving.who)  # it runs on b, unchanged
    stream = moving.dest.call("control", verb="recv_stream_stop", args={"expect": 10 ** 6, "timeout": 5})
    assert any("FLUSH" in e for e in stream["errors"]), stream  # a defined error, not silence
    assert moving.api.get(f"/vrnics/{moving.vrnic_id}").json()["host"] == "b"
    back = eventually(lambda: resource_counts() == scene.moved, timeout=30)
    assert back, (resource_counts(), scene.moved)
