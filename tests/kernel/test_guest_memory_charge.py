"""A container guest's registered memory is charged to the guest's memory cgroup, never to vrnicd's.

A shmem page is charged to the memory cgroup of the task that allocates it (mm/shmem.c). vrnicd registers MRs
over the guest's memfd through its own mapping, so a page the guest never touched would be allocated by that
registration and charged to vrnicd: memory outside the guest's limit. The frontend faults a buffer's pages in
(MADV_POPULATE_WRITE) before it registers it, and vrnicd refuses a registration over pages the guest never
allocated.

The process running the tests plays vrnicd (an in-process VerbsDriver) from a cgroup of its own (`daemon`); the
guest is a separate Python process moved into a sibling cgroup (`guest`), as a container would be. Both have the
memory controller. First the hazard itself, on the real kernel: a native registration from `daemon` over an
untouched memfd charges `daemon`. Then vrnicd with a guest: the guest's 32 MiB MR is charged to `guest`, and a
raw reg_mr over 32 MiB the guest never touched is refused.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.specs import Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid

from .cgroup_root import cgroup2_root_with, rmdir_when_free
from .conftest import wait_for_baseline
from .scripted_guest import ScriptedGuest

pytestmark = pytest.mark.kernel

MiB = 1 << 20
SIZE = 32 * MiB  # far above what either process allocates by itself while it is measured

GUEST = r"""
import json, sys

from vrnic.core.specs import AttachInfo
from vrnic.errors import InvalidArgument
from vrnic.frontend import MR, PD, Access, Context


def say(**message):
    print(json.dumps(message), flush=True)


def hear():
    return json.loads(sys.stdin.readline())


say(ready=True)
info, size = AttachInfo(**hear()["info"]), 32 << 20
ctx = Context.attach(info, 3 * size)
pd = PD(ctx)
say(attached=True)
hear()
mr = MR(pd, size, Access.LOCAL_WRITE)
say(registered=True)
hear()
untouched = ctx.alloc(size, align=4096)
try:
    ctx.call("reg_mr", pd=pd.handle, addr=untouched.addr, length=size, access=int(Access.LOCAL_WRITE))
    say(refused=None)
except InvalidArgument as e:
    say(refused=str(e))
hear()
for obj in (mr, pd, ctx):
    obj.close()
say(closed=True)
hear()
"""


@dataclass
class Cgroups:
    daemon: Path  # where this process (vrnicd) runs
    guest: Path   # the guest's cgroup, a container's stand-in


def current(cgroup: Path) -> int:
    return int((cgroup / "memory.current").read_text())


@pytest.fixture
def cgroups(device_pair: tuple[str, str]) -> Iterator[Cgroups]:
    hierarchy = cgroup2_root_with("memory", "it creates cgroups")
    root = hierarchy.root
    (root / "cgroup.subtree_control").write_text("+memory")
    top = root / f"vrnic-memcharge-{os.getpid()}"
    daemon, guest = top / "daemon", top / "guest"
    top.mkdir()
    (top / "cgroup.subtree_control").write_text("+memory")
    daemon.mkdir()
    guest.mkdir()
    (daemon / "cgroup.procs").write_text("0")
    try:
        yield Cgroups(daemon, guest)
    finally:
        (root / hierarchy.own.lstrip("/") / "cgroup.procs").write_text("0")
        for d in (guest, daemon, top):
            rmdir_when_free(d)
        if not hierarchy.was_enabled:
            (root / "cgroup.subtree_control").write_text("-memory")


def test_a_native_registration_over_untouched_shmem_charges_the_registering_cgroup(
        cgroups: Cgroups, device_pair: tuple[str, str]) -> None:
    """Why vrnicd refuses such a registration: the kernel charges whoever faults the pages in, here `daemon`."""
    import pyverbs.enums as e
    from pyverbs.device import Context as NativeContext
    from pyverbs.mr import MR as NativeMR
    from pyverbs.pd import PD as NativePD

    fd = os.memfd_create("untouched", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    mapping = mmap.mmap(fd, SIZE)
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor
    try:
        with NativeContext(name=device_pair[0]) as ctx, NativePD(ctx) as pd:
            before = current(cgroups.daemon)
            with NativeMR(pd, SIZE, e.IBV_ACCESS_LOCAL_WRITE, address=address):
                grew = current(cgroups.daemon) - before
        print(f"native reg_mr of {SIZE >> 20} MiB untouched: daemon's cgroup grew {grew / MiB:.1f} MiB")
        assert grew >= SIZE * 0.9, grew
    finally:
        mapping.close()
        os.close(fd)


def test_a_guests_mr_is_charged_to_the_guest_and_untouched_pages_are_refused(
        cgroups: Cgroups, device_pair: tuple[str, str], tmp_path: Path) -> None:
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    baseline = resource_counts()
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock")
    guest = ScriptedGuest(GUEST, tmp_path / "guest.stderr", timeout=120)
    try:
        spec = VrnicSpec(id="m1", tenant="t1", vpc_id=1, quota=Quota(max_pinned_bytes=4 * SIZE),
                         virtual_gid=make_virtual_gid(1, 1))
        info = drv.create_vrnic(spec, device_pair[0])
        assert guest.hear() == {"ready": True}
        (cgroups.guest / "cgroup.procs").write_text(str(guest.pid))  # as a container runtime would
        guest.say(info=info.model_dump(mode="json"))
        assert guest.hear() == {"attached": True}
        daemon_before, guest_before = current(cgroups.daemon), current(cgroups.guest)
        guest.say(go=True)
        assert guest.hear() == {"registered": True}
        daemon_grew, guest_grew = current(cgroups.daemon) - daemon_before, current(cgroups.guest) - guest_before
        print(f"a guest's {SIZE >> 20} MiB MR: guest's cgroup grew {guest_grew / MiB:.1f} MiB, "
              f"daemon's {daemon_grew / MiB:.1f} MiB")
        assert guest_grew >= SIZE * 0.9, guest_grew
        assert daemon_grew < SIZE // 4, daemon_grew
        daemon_before = current(cgroups.daemon)
        guest.say(go=True)
        refused = guest.hear()["refused"]
        assert refused is not None and "never allocated" in refused, refused
        assert current(cgroups.daemon) - daemon_before < SIZE // 4  # the refusal allocated nothing for it
        guest.say(go=True)
        assert guest.hear() == {"closed": True}
        guest.say(go=True)
        assert guest.proc.wait(120) == 0, guest.stderr_path.read_text()
    finally:
        guest.kill()
        drv.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"
