"""The rdma cgroup edge (vrnic.backend.rdma_cgroup) over a fake /proc and cgroup tree.

Plain files cannot enforce the kernel's rules; these tests check what the edge reads, what it writes
and in which order, and what it refuses to touch. tests/kernel/test_rdma_cgroup.py runs it on the real
kernel.
"""

from __future__ import annotations

import errno
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from vrnic.backend.rdma_cgroup import confine, limit_memlock
from vrnic.core.containment import RdmaLimit
from vrnic.errors import Conflict, DeviceError, InvalidArgument

pytestmark = pytest.mark.unit

GUEST_PID = 4242
UNLIMITED = "rxe0 hca_handle=max hca_object=max \nrxe1 hca_handle=max hca_object=max \n"


class Tree:
    """/proc/self, /proc/<guest> and a cgroup2 mount with / -> /guests -> /guests/g1 and /vrnicd."""

    def __init__(self, root: Path) -> None:
        self.proc = root / "proc"
        self.cg = root / "cg"
        (self.proc / "self").mkdir(parents=True)
        (self.proc / str(GUEST_PID)).mkdir()
        (self.proc / "self" / "mountinfo").write_text(
            f"22 1 0:21 / / rw - ext4 /dev/vda1 rw\n26 22 0:23 / {self.cg} rw - cgroup2 cgroup2 rw\n")
        self.place("self", "/vrnicd")
        self.place(GUEST_PID, "/guests/g1")
        self.cgroup("/", controllers="cpu memory rdma", subtree="memory", procs="1\n")
        self.cgroup("/vrnicd", controllers="memory", procs="99\n")
        self.cgroup("/guests", controllers="memory")
        self.cgroup("/guests/g1", controllers="", procs=f"{GUEST_PID}\n", rdma_max=UNLIMITED)

    def place(self, pid: int | str, cgroup: str) -> None:
        (self.proc / str(pid) / "cgroup").write_text(f"4:memory:/x\n0::{cgroup}\n")

    def dir(self, cgroup: str) -> Path:
        return self.cg / cgroup.lstrip("/")

    def cgroup(self, path: str, controllers: str, subtree: str = "", procs: str = "", kind: str = "domain",
               rdma_max: str | None = None) -> None:
        d = self.dir(path)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text(controllers + "\n")
        (d / "cgroup.subtree_control").write_text(subtree + "\n")
        (d / "cgroup.procs").write_text(procs)
        if path != "/":
            (d / "cgroup.type").write_text(kind + "\n")
        if rdma_max is not None:
            (d / "rdma.max").write_text(rdma_max)
            (d / "rdma.current").write_text("rxe0 hca_handle=0 hca_object=2 \nrxe1 hca_handle=0 hca_object=0 \n")

    def read(self, cgroup: str, name: str) -> str:
        return (self.dir(cgroup) / name).read_text()


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)


def test_confine_enables_rdma_top_down_sets_zero_and_release_restores(tree: Tree) -> None:
    c = confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert c.cgroup == "/guests/g1" and c.directory == tree.dir("/guests/g1")
    assert c.enabled_in == ("/", "/guests")
    assert tree.read("/", "cgroup.subtree_control") == "+rdma"
    assert tree.read("/guests", "cgroup.subtree_control") == "+rdma"
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=0 hca_object=0"
    assert c.previous == RdmaLimit("rxe0")
    assert c.usage_at_confine == RdmaLimit("rxe0", 0, 2)  # what it held already is reported, not revoked
    c.release()
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=max hca_object=max"
    assert c.released
    c.release()  # idempotent


def test_nothing_is_enabled_where_rdma_already_is(tree: Tree) -> None:
    tree.cgroup("/", controllers="cpu memory rdma", subtree="memory rdma")
    tree.cgroup("/guests", controllers="memory rdma", subtree="rdma")
    with confine(GUEST_PID, "rxe0", proc=tree.proc) as c:
        assert c.enabled_in == ()
        assert tree.read("/", "cgroup.subtree_control") == "memory rdma\n"
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=max hca_object=max"


def test_a_previous_finite_limit_comes_back(tree: Tree) -> None:
    (tree.dir("/guests/g1") / "rdma.max").write_text("rxe0 hca_handle=2 hca_object=100 \n")
    confine(GUEST_PID, "rxe0", proc=tree.proc).release()
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=2 hca_object=100"


def test_two_holders_share_the_limit_until_the_last_lets_go(tree: Tree) -> None:
    first = confine(GUEST_PID, "rxe0", proc=tree.proc)
    second = confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert second.previous == RdmaLimit("rxe0")  # not the zero limit the first one set
    first.release()
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=0 hca_object=0"
    second.release()
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=max hca_object=max"


def test_a_limit_lifted_by_someone_else_is_reasserted_by_the_next_holder(tree: Tree) -> None:
    first = confine(GUEST_PID, "rxe0", proc=tree.proc)
    (tree.dir("/guests/g1") / "rdma.max").write_text(UNLIMITED)
    second = confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert tree.read("/guests/g1", "rdma.max") == "rxe0 hca_handle=0 hca_object=0"
    second.release()
    first.release()


def test_a_guest_in_vrnicds_cgroup_is_refused_and_nothing_is_written(tree: Tree) -> None:
    tree.place(GUEST_PID, "/vrnicd")
    with pytest.raises(Conflict, match="shares vrnicd's own cgroup /vrnicd"):
        confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert tree.read("/", "cgroup.subtree_control") == "memory\n"


def test_a_guest_in_the_root_cgroup_is_refused(tree: Tree) -> None:
    tree.place(GUEST_PID, "/")
    with pytest.raises(Conflict, match="root cgroup"):
        confine(GUEST_PID, "rxe0", proc=tree.proc)


def test_an_ancestor_with_processes_is_refused_before_anything_is_written(tree: Tree) -> None:
    (tree.dir("/guests") / "cgroup.procs").write_text("77\n")
    with pytest.raises(Conflict, match="no-internal-processes"):
        confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert tree.read("/", "cgroup.subtree_control") == "memory\n"
    assert tree.read("/guests/g1", "rdma.max") == UNLIMITED


def test_a_threaded_guest_cgroup_is_refused(tree: Tree) -> None:
    (tree.dir("/guests/g1") / "cgroup.type").write_text("threaded\n")
    with pytest.raises(Conflict, match="threaded"):
        confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert tree.read("/", "cgroup.subtree_control") == "memory\n"


def test_an_unknown_device_is_a_device_error_with_enodev(tree: Tree) -> None:
    with pytest.raises(DeviceError, match="mlx5_0 is not registered") as info:
        confine(GUEST_PID, "mlx5_0", proc=tree.proc)
    assert info.value.errno == errno.ENODEV
    assert str(tree.dir("/guests/g1") / "rdma.max") in str(info.value)


def test_a_gone_guest_is_a_conflict(tree: Tree) -> None:
    with pytest.raises(Conflict, match=r"pid 999999\) is gone .*ENOENT"):
        confine(999999, "rxe0", proc=tree.proc)


def test_a_bad_device_name_is_refused_before_anything_is_read(tree: Tree) -> None:
    with pytest.raises(InvalidArgument):
        confine(GUEST_PID, "rxe0 hca_handle=max", proc=tree.proc)


def test_a_missing_cgroup_file_is_a_device_error_naming_path_and_errno(tree: Tree) -> None:
    (tree.dir("/guests") / "cgroup.controllers").unlink()
    with pytest.raises(DeviceError, match=r"guests/cgroup.controllers.*ENOENT, errno 2") as info:
        confine(GUEST_PID, "rxe0", proc=tree.proc)
    assert info.value.errno == errno.ENOENT


def test_release_after_the_cgroup_is_gone_is_quiet(tree: Tree) -> None:
    c = confine(GUEST_PID, "rxe0", proc=tree.proc)
    shutil.rmtree(tree.dir("/guests/g1"))
    c.release()
    assert c.released


# --- RLIMIT_MEMLOCK ---

def test_limit_memlock_sets_soft_and_hard_and_returns_the_previous() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        before = resource.prlimit(child.pid, resource.RLIMIT_MEMLOCK)
        assert limit_memlock(child.pid, 0) == before
        assert resource.prlimit(child.pid, resource.RLIMIT_MEMLOCK) == (0, 0)
        limits = Path(f"/proc/{child.pid}/limits").read_text()
        assert any(line.startswith("Max locked memory") and line.split()[3:5] == ["0", "0"]
                   for line in limits.splitlines())
    finally:
        child.kill()
        child.wait()


def test_limit_memlock_of_a_gone_process_is_a_conflict() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    with pytest.raises(Conflict, match="ESRCH"):
        limit_memlock(child.pid, 0)


def test_limit_memlock_refuses_negative_sizes() -> None:
    with pytest.raises(InvalidArgument):
        limit_memlock(1, -5)
