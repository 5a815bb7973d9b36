"""Containment of a direct-path guest by the rdma cgroup: the pure rules (vrnic.core.containment)."""

from __future__ import annotations

import pytest

from vrnic.core.containment import (
    Cgroup2Mount,
    CgroupNode,
    ConfinementLedger,
    RdmaLimit,
    ancestors,
    cgroup2_mounts,
    containment_refusal,
    enable_plan,
    guest_type_refusal,
    is_same_or_ancestor,
    parse_rdma_file,
    parse_rdma_line,
    pick_cgroup2_mount,
    require_containable,
    unified_cgroup_path,
    zero_limit,
)
from vrnic.errors import Conflict, InvalidArgument

pytestmark = pytest.mark.unit

HYBRID = """12:rdma:/
9:name=systemd:/
4:memory:/process_api/6cbc13fd
1:cpu:/
0::/user.slice/user-0.slice/session-3.scope
"""

# A hybrid host (v1 controllers plus a unified hierarchy at /sys/fs/cgroup/unified) and a pure v2 one.
MOUNTINFO_HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
MOUNTINFO_V2 = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
26 23 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""


# --- /proc/<pid>/cgroup ---

def test_the_unified_line_is_picked_among_v1_lines() -> None:
    assert unified_cgroup_path(HYBRID) == "/user.slice/user-0.slice/session-3.scope"


def test_a_pure_v2_process() -> None:
    assert unified_cgroup_path("0::/system.slice/docker-1f2e.scope\n") == "/system.slice/docker-1f2e.scope"
    assert unified_cgroup_path("0::/\n") == "/"


def test_trailing_slashes_are_normalized() -> None:
    assert unified_cgroup_path("0::/a/b/\n") == "/a/b"


def test_no_unified_line_is_a_conflict_naming_v2() -> None:
    with pytest.raises(Conflict, match="no cgroup v2 membership"):
        unified_cgroup_path("4:memory:/x\n1:cpu:/\n", "guest process")


def test_a_v1_line_with_hierarchy_0_and_controllers_is_not_the_unified_one() -> None:
    with pytest.raises(Conflict):
        unified_cgroup_path("0:rdma:/x\n")


def test_a_removed_cgroup_cannot_be_limited() -> None:
    with pytest.raises(Conflict, match="removed.*/gone"):
        unified_cgroup_path("0::/gone (deleted)\n", "guest process")


def test_a_cgroup_outside_our_namespace_cannot_be_limited() -> None:
    for path in ("/..", "/../../other.scope"):
        with pytest.raises(Conflict, match="outside vrnicd's cgroup namespace"):
            unified_cgroup_path(f"0::{path}\n")


def test_a_relative_path_is_malformed() -> None:
    with pytest.raises(InvalidArgument):
        unified_cgroup_path("0::relative\n")


# --- who may be limited ---

def test_a_sibling_cgroup_is_containable() -> None:
    assert containment_refusal("/system.slice/docker-1.scope", "/system.slice/vrnicd.service") is None
    require_containable("/guests/g1", "/vrnicd")


def test_a_cgroup_below_vrnicd_is_containable_by_these_rules() -> None:
    # (enable_plan then refuses if vrnicd's own cgroup, holding vrnicd, must enable the controller)
    assert containment_refusal("/vrnicd/guest", "/vrnicd") is None


def test_the_root_cgroup_is_refused() -> None:
    reason = containment_refusal("/", "/vrnicd")
    assert reason is not None and "root cgroup" in reason


def test_vrnicds_own_cgroup_is_refused() -> None:
    reason = containment_refusal("/user.slice/session-3.scope", "/user.slice/session-3.scope")
    assert reason is not None and "shares vrnicd's own cgroup" in reason
    with pytest.raises(Conflict, match="cannot contain the guest: the guest shares vrnicd's own cgroup"):
        require_containable("/x", "/x")


def test_a_cgroup_that_contains_vrnicd_is_refused_the_limit_is_hierarchical() -> None:
    reason = containment_refusal("/system.slice", "/system.slice/vrnicd.service")
    assert reason is not None and "hierarchical" in reason


def test_a_name_prefix_is_not_an_ancestor() -> None:
    assert not is_same_or_ancestor("/a", "/ab")
    assert is_same_or_ancestor("/a", "/a/b")
    assert is_same_or_ancestor("/", "/anything")
    assert containment_refusal("/guest", "/guest-daemon") is None


def test_ancestors_root_first() -> None:
    assert ancestors("/a/b/c") == ["/", "/a", "/a/b"]
    assert ancestors("/a") == ["/"]
    assert ancestors("/") == []


# --- the cgroup2 mount ---

def test_the_unified_mount_of_a_hybrid_host() -> None:
    assert cgroup2_mounts(MOUNTINFO_HYBRID) == [Cgroup2Mount("/", "/sys/fs/cgroup/unified")]
    mount = pick_cgroup2_mount(MOUNTINFO_HYBRID, "/a/b")
    assert mount.directory("/a/b") == "/sys/fs/cgroup/unified/a/b"
    assert mount.directory("/") == "/sys/fs/cgroup/unified"


def test_sys_fs_cgroup_is_preferred_when_mounted_twice() -> None:
    text = MOUNTINFO_V2 + "90 22 0:23 / /mnt/cg rw - cgroup2 cgroup2 rw\n"
    assert pick_cgroup2_mount(text, "/x").mount_point == "/sys/fs/cgroup"


def test_no_cgroup2_mount_is_a_conflict_that_says_how_to_mount_it() -> None:
    with pytest.raises(Conflict, match="mount -t cgroup2"):
        pick_cgroup2_mount("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n", "/x")


def test_escaped_mount_points_are_decoded() -> None:
    (mount,) = cgroup2_mounts("50 1 0:40 / /mnt/my\\040cgroup rw - cgroup2 none rw\n")
    assert mount.mount_point == "/mnt/my cgroup"


def test_a_mount_of_a_subtree_maps_only_cgroups_below_its_root() -> None:
    mount = Cgroup2Mount(root="/ns/c1", mount_point="/sys/fs/cgroup")
    assert mount.directory("/ns/c1/guest") == "/sys/fs/cgroup/guest"
    assert mount.directory("/ns/c1") == "/sys/fs/cgroup"
    with pytest.raises(Conflict, match="not visible"):
        mount.directory("/ns/c2/guest")
    with pytest.raises(Conflict):
        pick_cgroup2_mount("26 23 0:23 /ns/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", "/other")


# --- enabling the controller ---

ALL = frozenset({"cpu", "memory", "pids", "rdma"})


def _node(path: str, controllers: frozenset[str] = ALL, subtree: frozenset[str] = frozenset(),
          procs: bool = False, kind: str = "domain") -> CgroupNode:
    return CgroupNode(path, controllers, subtree, procs, kind)


def test_nothing_to_do_when_every_ancestor_enables_rdma() -> None:
    chain = [_node("/", subtree=ALL, procs=True), _node("/a", subtree=frozenset({"rdma"}))]
    assert enable_plan(chain) == []


def test_enabling_goes_top_down_from_the_first_gap() -> None:
    chain = [_node("/", subtree=frozenset({"memory", "rdma"}), procs=True),
             _node("/a", subtree=frozenset({"memory"})),
             _node("/a/b", controllers=frozenset({"memory"}))]
    assert enable_plan(chain) == ["/a", "/a/b"]


def test_the_root_may_hold_processes() -> None:
    assert enable_plan([_node("/", procs=True)]) == ["/"]


def test_an_ancestor_with_processes_of_its_own_is_refused_naming_the_rule() -> None:
    chain = [_node("/", subtree=ALL), _node("/vrnicd", procs=True)]
    with pytest.raises(Conflict, match="no-internal-processes"):
        enable_plan(chain)


def test_an_ancestor_with_processes_that_already_enables_rdma_is_fine() -> None:
    # (cgroup v2 never lets that happen for a domain controller, but nothing needs writing there)
    assert enable_plan([_node("/", subtree=ALL), _node("/a", subtree=ALL, procs=True)]) == []


@pytest.mark.parametrize("kind", ["threaded", "domain threaded", "domain invalid"])
def test_a_threaded_ancestor_is_refused(kind: str) -> None:
    with pytest.raises(Conflict, match="threaded subtree"):
        enable_plan([_node("/", subtree=ALL), _node("/t", kind=kind)])


def test_rdma_missing_on_the_root_means_no_controller() -> None:
    with pytest.raises(Conflict, match="not available on the cgroup2 hierarchy"):
        enable_plan([_node("/", controllers=frozenset({"cpu", "memory"}))])


def test_a_mounted_subtree_whose_top_lacks_rdma_is_refused() -> None:
    with pytest.raises(Conflict, match="outside the cgroup2 mount"):
        enable_plan([_node("/ns/c1", controllers=frozenset({"memory"}))])


def test_nothing_visible_above_the_guest_plans_nothing() -> None:
    assert enable_plan([]) == []


def test_enabling_another_controller() -> None:
    assert enable_plan([_node("/", subtree=frozenset({"rdma"}))], controller="pids") == ["/"]


def test_guest_cgroup_types() -> None:
    assert guest_type_refusal("domain") is None
    assert guest_type_refusal("domain threaded") is None
    reason = guest_type_refusal("threaded")
    assert reason is not None and "threaded" in reason


# --- rdma.max and rdma.current ---

def test_the_kernels_own_lines_parse_trailing_blank_included() -> None:
    text = "rxe0 hca_handle=max hca_object=max \nrxe1 hca_handle=0 hca_object=0 \n"
    assert parse_rdma_file(text) == {"rxe0": RdmaLimit("rxe0"), "rxe1": RdmaLimit("rxe1", 0, 0)}


def test_rdma_current_reads_the_same_way() -> None:
    assert parse_rdma_file("rxe0 hca_handle=1 hca_object=3 \n")["rxe0"] == RdmaLimit("rxe0", 1, 3)


def test_render_writes_both_keys() -> None:
    assert zero_limit("rxe0").render() == "rxe0 hca_handle=0 hca_object=0"
    assert RdmaLimit("mlx5_0", None, 16).render() == "mlx5_0 hca_handle=max hca_object=16"
    assert RdmaLimit("rxe0").render() == "rxe0 hca_handle=max hca_object=max"


@pytest.mark.parametrize("limit", [RdmaLimit("rxe0"), RdmaLimit("rxe0", 0, 0), RdmaLimit("mlx5_1", 4, None),
                                   RdmaLimit("a", 2**31 - 2, 7)])
def test_render_and_parse_round_trip(limit: RdmaLimit) -> None:
    assert parse_rdma_line(limit.render()) == limit


def test_s32_max_is_unlimited() -> None:
    assert parse_rdma_line("rxe0 hca_handle=2147483647 hca_object=5") == RdmaLimit("rxe0", None, 5)
    assert RdmaLimit("rxe0").unlimited
    assert not RdmaLimit("rxe0", 0, None).unlimited


def test_a_missing_key_is_unlimited() -> None:
    assert parse_rdma_line("rxe0 hca_object=0") == RdmaLimit("rxe0", None, 0)
    assert parse_rdma_line("rxe0") == RdmaLimit("rxe0")


@pytest.mark.parametrize("line", ["rxe0 hca_handle=-1 hca_object=0", "rxe0 hca_handle=x", "rxe0 hca_handle",
                                  "rxe0 cq=3", "rxe0 hca_object=1 hca_object=2", "   "])
def test_bad_lines_are_refused(line: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_rdma_line(line)


def test_a_device_twice_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="twice"):
        parse_rdma_file("rxe0 hca_handle=max\nrxe0 hca_handle=0\n")


def test_blank_lines_are_skipped() -> None:
    assert parse_rdma_file("\n\n") == {}


@pytest.mark.parametrize("name", ["", "rxe 0", "a=b", "x" * 64, "rxe0\n"])
def test_bad_device_names_are_refused_before_anything_is_written(name: str) -> None:
    with pytest.raises(InvalidArgument, match="device name"):
        zero_limit(name)


@pytest.mark.parametrize("value", [-1, 2**31 - 1, 2**40])
def test_out_of_range_limits_are_refused(value: int) -> None:
    with pytest.raises(InvalidArgument):
        RdmaLimit("rxe0", value, 0)


# --- holders of one limit ---

def test_the_last_holder_gets_the_first_holders_previous_line() -> None:
    ledger = ConfinementLedger()
    ledger.add("/cg/g", "rxe0", RdmaLimit("rxe0"))
    ledger.add("/cg/g", "rxe0", RdmaLimit("rxe0", 0, 0))  # what the second holder saw: our own limit
    assert ledger.holders("/cg/g", "rxe0") == 2
    assert ledger.previous("/cg/g", "rxe0") == RdmaLimit("rxe0")
    assert ledger.remove("/cg/g", "rxe0") is None
    assert ledger.remove("/cg/g", "rxe0") == RdmaLimit("rxe0")
    assert ledger.holders("/cg/g", "rxe0") == 0
    assert ledger.previous("/cg/g", "rxe0") is None


def test_devices_and_cgroups_are_held_apart() -> None:
    ledger = ConfinementLedger()
    ledger.add("/cg/g", "rxe0", RdmaLimit("rxe0", 5, 5))
    ledger.add("/cg/g", "rxe1", RdmaLimit("rxe1"))
    ledger.add("/cg/h", "rxe0", RdmaLimit("rxe0"))
    assert ledger.remove("/cg/g", "rxe0") == RdmaLimit("rxe0", 5, 5)
    assert ledger.holders("/cg/g", "rxe1") == 1
    assert ledger.holders("/cg/h", "rxe0") == 1


def test_releasing_what_is_not_held_is_refused() -> None:
    ledger = ConfinementLedger()
    with pytest.raises(InvalidArgument, match="no confinement"):
        ledger.remove("/cg/g", "rxe0")
    with pytest.raises(InvalidArgument, match="previous limit is for rxe1"):
        ledger.add("/cg/g", "rxe0", RdmaLimit("rxe1"))
