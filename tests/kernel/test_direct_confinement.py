"""vrnicd confines a direct-engine guest when it attaches: rdma.max 0 on its cgroup, its memlock at the quota.

The process running the tests plays vrnicd (an in-process VerbsDriver with direct_containment="required")
from a cgroup of its own (`daemon`). A guest is a separate Python process the test moves into a sibling
cgroup (`guest`), as a container would be, before it attaches with the frontend; it is driven by JSON
lines over its stdin and stdout. Its peer for the data path is a ring-engine guest of the test process
itself (a direct one there would be refused: it shares vrnicd's cgroup).
"""

from __future__ import annotations

import errno
import itertools
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.containment import RdmaLimit, parse_rdma_file
from vrnic.core.specs import AttachInfo, DataEngine, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.core.verb_args import Attach
from vrnic.errors import Conflict
from vrnic.frontend import CQ, MR, PD, QP, Access, Context

from .cgroup_root import cgroup2_root_with_rdma, rmdir_when_free
from .conftest import wait_for_baseline
from .scripted_guest import ScriptedGuest

pytestmark = pytest.mark.kernel

PINNED = 48 << 20  # the direct vRNIC's quota.max_pinned_bytes: not a memlock limit anyone has by chance
PAYLOAD = b"confined but working " * 16

# The guest: attaches a direct vRNIC, RDMA-WRITEs to its peer, tries the bypass, detaches, on command.
GUEST = r"""
import ctypes, fcntl, json, resource, sys

from vrnic.core.queue_format.rxe import RDMA_VERBS_IOCTL, invoke_write
from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WcStatus, WrOpcode

ALLOC_PD = 3  # IB_USER_VERBS_CMD_ALLOC_PD


class Recording(Context):
    # The frontend keeps only some fields of the attach reply; this guest keeps all of it.
    def _open(self, arena, connect, attach):
        def record(channel):
            self.attach_reply = attach(channel)
            return self.attach_reply
        super()._open(arena, connect, record)


def say(**message):
    print(json.dumps(message), flush=True)


def hear():
    return json.loads(sys.stdin.readline())


def alloc_pd_bypass(fd):
    # INVOKE_WRITE(ALLOC_PD) through the ioctl path on the passed fd: an object vrnicd never sees.
    resp = ctypes.create_string_buffer(4)
    try:  # CORE_IN is 8 bytes (the unused response pointer), so it travels inline: 0
        fcntl.ioctl(fd, RDMA_VERBS_IOCTL, invoke_write(ALLOC_PD, (0, 8), (ctypes.addressof(resp), 4)))
    except OSError as e:
        return {"errno": e.errno}
    return {"ok": int.from_bytes(resp.raw, "little")}


say(ready=True)
info = AttachInfo(**hear())  # sent once the test has moved this process into its cgroup
ctx = Recording.attach(info, 1 << 20)
pd = PD(ctx)
cq = CQ(ctx, 64)
mr = MR(pd, 65536, Access.LOCAL_WRITE)
qp = QP(pd, cq, cq)
say(reply=ctx.attach_reply, engine=ctx.engine, direct=ctx.direct is not None, gid=ctx.gid, qpn=qp.qpn,
    memlock=list(resource.getrlimit(resource.RLIMIT_MEMLOCK)))
peer = hear()
qp.connect(peer["gid"], peer["qpn"])
payload = bytes.fromhex(peer["payload"])
mr.write(payload)
qp.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (mr.sge(0, len(payload)),), remote_addr=peer["addr"],
                         rkey=peer["rkey"]))
wc = cq.wait(1, timeout=30)[0]
say(status=WcStatus(wc.status).name, success=wc.status == WcStatus.SUCCESS, alloc_pd=alloc_pd_bypass(ctx.direct.fd))
hear()
for obj in (qp, mr, cq, pd, ctx):
    obj.close()
say(closed=True)
hear()
"""


# --- the cgroups ----------------------------------------------------------------------------------------

@dataclass
class Cgroups:
    root: Path    # the cgroup2 mount
    top: Path
    daemon: Path  # where this process (vrnicd) runs
    guest: Path   # the direct guest's cgroup, a container's stand-in

    def line(self, cgroup: Path, name: str, device: str) -> RdmaLimit | None:
        """The device's line of rdma.max or rdma.current (None: no line, or no such file: rdma not enabled)."""
        path = cgroup / name
        return parse_rdma_file(path.read_text()).get(device) if path.exists() else None


@pytest.fixture
def cgroups(device_pair: tuple[str, str]) -> Iterator[Cgroups]:
    device = device_pair[0]
    if not (Path("/sys/class/infiniband") / device / "parent").is_file():
        pytest.skip(f"{device} is not a soft-RoCE (rxe) device: the direct engine maps rxe's queues")
    hierarchy = cgroup2_root_with_rdma()
    root, own, root_enabled_rdma = hierarchy.root, hierarchy.own, hierarchy.was_enabled

    top = root / f"vrnic-confinement-{os.getpid()}"
    daemon, guest = top / "daemon", top / "guest"
    top.mkdir()
    daemon.mkdir()
    guest.mkdir()
    (daemon / "cgroup.procs").write_text("0")
    try:
        yield Cgroups(root, top, daemon, guest)
    finally:
        (root / own.lstrip("/") / "cgroup.procs").write_text("0")
        for d in (guest, daemon, top):
            rmdir_when_free(d)
        if not root_enabled_rdma and "rdma" in (root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("-rdma")


@pytest.fixture
def required(cgroups: Cgroups, tmp_path: Path) -> Iterator[Any]:
    """vrnicd, in-process, refusing direct guests it cannot contain; afterwards the kernel holds what it did."""
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    baseline = resource_counts()
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock", direct_containment="required")
    assert drv.direct_containment == "required"
    yield drv
    drv.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"


_serial = itertools.count(1)


def new_vrnic(drv: Any, device: str, engine: DataEngine, **quota: int) -> AttachInfo:
    """As conftest's make_vrnic, on this test's driver."""
    serial = next(_serial)
    spec = VrnicSpec(id=f"c{serial}", tenant="t1", vpc_id=1, quota=Quota(**quota),
                     virtual_gid=make_virtual_gid(1, serial), engine=engine)
    return drv.create_vrnic(spec, device)  # type: ignore[no-any-return]


# --- the guest process ----------------------------------------------------------------------------------

def memlock_of(pid: int) -> tuple[str, str]:
    """The soft and hard 'Max locked memory' of a process, as /proc/<pid>/limits reads."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max locked memory"):
            soft, hard = line[len("Max locked memory"):].split()[:2]
            return soft, hard
    raise AssertionError(f"no memlock line in /proc/{pid}/limits")


# --- the tests ------------------------------------------------------------------------------------------

def test_a_guest_in_its_own_cgroup_is_confined_while_attached_and_still_moves_data(
        cgroups: Cgroups, required: Any, device_pair: tuple[str, str], tmp_path: Path) -> None:
    device = device_pair[0]
    direct = new_vrnic(required, device, DataEngine.DIRECT, max_pinned_bytes=PINNED)
    ring = new_vrnic(required, device_pair[1], DataEngine.RING)
    # A direct attach opens its own device and confines the guest, so it opens on the guest's thread, never on
    # the channel's selector; a ring attach finds its device context idle and opens on the selector.
    assert not required.opens_quickly(Attach(token=direct.token or ""))
    assert required.opens_quickly(Attach(token=ring.token or ""))

    # The peer: a ring-engine guest of vrnicd's own process (not confined: vrnicd posts for it).
    peer = Context.attach(ring, 1 << 20)
    peer_pd = PD(peer)
    peer_cq = CQ(peer, 64)
    peer_mr = MR(peer_pd, 65536, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    peer_qp = QP(peer_pd, peer_cq, peer_cq)
    guest = ScriptedGuest(GUEST, tmp_path / "guest.stderr")
    try:
        assert guest.hear() == {"ready": True}
        (cgroups.guest / "cgroup.procs").write_text(str(guest.pid))  # as a container runtime would
        assert guest.pid in {int(p) for p in (cgroups.guest / "cgroup.procs").read_text().split()}
        limit_before = cgroups.line(cgroups.guest, "rdma.max", device)  # None when rdma is not enabled yet
        assert limit_before is None or limit_before.unlimited, limit_before
        memlock_before = memlock_of(guest.pid)
        assert memlock_before != (str(PINNED), str(PINNED))
        counts_before = resource_counts()

        guest.say(**direct.model_dump(mode="json"))
        attached = guest.hear()
        print(f"\nattach reply: {attached['reply']}")
        assert attached["reply"]["engine"] == "direct" and attached["engine"] == "direct" and attached["direct"]
        assert attached["reply"]["contained"] is True

        # vrnicd limited the guest's cgroup to nothing of its own on the device, and its locked memory.
        limit = cgroups.line(cgroups.guest, "rdma.max", device)
        lines = [line.strip() for line in (cgroups.guest / "rdma.max").read_text().splitlines()]
        print(f"guest cgroup rdma.max while attached: {lines}")
        assert limit == RdmaLimit(device, 0, 0)
        assert f"{device} hca_handle=0 hca_object=0" in lines
        assert memlock_of(guest.pid) == (str(PINNED), str(PINNED))
        assert attached["memlock"] == [PINNED, PINNED]  # as the guest itself sees it
        assert cgroups.line(cgroups.daemon, "rdma.max", device) in (None, RdmaLimit(device))  # vrnicd is free
        # Its PD, CQ, MR and QP are vrnicd's, made from vrnicd's cgroup: nothing is charged to the guest.
        assert cgroups.line(cgroups.guest, "rdma.current", device) == RdmaLimit(device, 0, 0)

        # The data path works: the guest writes into the peer's memory with the NIC's own queues.
        peer_qp.connect(attached["gid"], attached["qpn"])
        guest.say(gid=peer.gid, qpn=peer_qp.qpn, addr=peer_mr.addr, rkey=peer_mr.rkey, payload=PAYLOAD.hex())
        done = guest.hear()
        print(f"guest: RDMA WRITE {done['status']}, INVOKE_WRITE(ALLOC_PD) on the passed fd {done['alloc_pd']}")
        assert done["success"], done
        assert peer_mr.read(len(PAYLOAD)) == PAYLOAD
        # The bypass: an object of its own through the passed fd, which the cgroup refuses.
        assert done["alloc_pd"] == {"errno": errno.EAGAIN}, done
        assert cgroups.line(cgroups.guest, "rdma.current", device) == RdmaLimit(device, 0, 0)

        # Detach: vrnicd destroys the vRNIC's objects and lifts the limit before it replies.
        guest.say(detach=True)
        assert guest.hear() == {"closed": True}
        after = cgroups.line(cgroups.guest, "rdma.max", device)
        print(f"guest cgroup rdma.max after detach: {(cgroups.guest / 'rdma.max').read_text().strip()!r}")
        assert after == (limit_before or RdmaLimit(device)), after
        assert after is not None and after.unlimited
        assert memlock_of(guest.pid) == memlock_before  # and its memlock limit is back
        assert required.attached_ids() == {ring.vrnic_id}
        assert wait_for_baseline(counts_before) == counts_before, "the direct guest's objects outlived it"
        guest.finish()
    finally:
        guest.kill()
        for obj in (peer_qp, peer_mr, peer_cq, peer_pd, peer):
            obj.close()


def test_a_direct_guest_in_vrnicds_own_cgroup_is_refused_when_containment_is_required(
        cgroups: Cgroups, required: Any, device_pair: tuple[str, str]) -> None:
    device = device_pair[0]
    info = new_vrnic(required, device, DataEngine.DIRECT, max_pinned_bytes=PINNED)
    baseline = resource_counts()
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    daemon_limit = cgroups.line(cgroups.daemon, "rdma.max", device)

    with pytest.raises(Conflict, match="cannot be contained") as refused:
        Context.attach(info, 1 << 20)  # this process is vrnicd: a limit on its cgroup would bind vrnicd
    print(f"\nrefused: {refused.value}")
    assert "vrnicd's own cgroup" in str(refused.value)

    assert required.attached_ids() == set()
    assert cgroups.line(cgroups.daemon, "rdma.max", device) == daemon_limit  # nothing written
    assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == memlock  # vrnicd's memlock untouched
    assert wait_for_baseline(baseline) == baseline, "the refused attach left kernel objects"
    # vrnicd serves on: a ring-engine vRNIC attaches from this same process.
    ctx = Context.attach(new_vrnic(required, device, DataEngine.RING), 1 << 20)
    ctx.close()
