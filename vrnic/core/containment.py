"""Containment of a direct-path guest by the rdma cgroup: the pure half (no I/O).

On the direct data path the guest holds vrnicd's uverbs fd, so it can create objects of its own on that
ucontext through the ioctl path. The kernel charges every object to the cgroup of the task that *creates*
it (drivers/infiniband/core/rdma_core.c, uverbs_cmd.c; kernel/cgroup/rdma.c):

- `hca_handle`: one per ucontext, at GET_CONTEXT;
- `hca_object`: one per IDR object (PD, MR, MW, CQ, QP, SRQ, AH, XRCD, WQ, RWQ indirection table, flow,
  flow action, counters, DM), on both the write() and the ioctl path, before the driver sees the request;
- nothing for fd objects (completion channels, the async event fd).

A refused charge is EAGAIN. The charge is hierarchical (every ancestor up to the root must have room) and
the destroy uncharges the cgroup that was charged, whoever destroys. Objects vrnicd creates are therefore
charged to vrnicd's cgroup, and a guest cgroup limited to `hca_handle=0 hca_object=0` on the device can use
them but create none of its own.

This module reads `/proc/<pid>/cgroup` and `/proc/self/mountinfo` text, decides whether a guest's cgroup can
be limited without limiting vrnicd, plans which `cgroup.subtree_control` files must enable `rdma`, renders
and parses `rdma.max`/`rdma.current`, and counts holders of one limit (several vRNICs of one container).
`vrnic.backend.rdma_cgroup` does the reading and writing.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

from vrnic.errors import Conflict, InvalidArgument

RDMA_CONTROLLER = "rdma"
UNLIMITED = "max"
# The kernel stores limits as int and prints S32_MAX as "max"; writing S32_MAX also means "max".
_S32_MAX = 2**31 - 1
_DEVICE_NAME_MAX = 63  # IB_DEVICE_NAME_MAX is 64 with the terminating NUL
_DEVICE_RE = re.compile(r"[^\s=]+")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


# --- /proc/<pid>/cgroup ---------------------------------------------------------------------------------

def unified_cgroup_path(proc_cgroup: str, who: str = "process") -> str:
    """The cgroup v2 path from `/proc/<pid>/cgroup` text: the `0::<path>` line.

    Raises Conflict when there is none (a host with cgroup v1 only), when the cgroup was removed
    (" (deleted)"), or when it lies outside the reader's cgroup namespace ("/.."): none of those can be
    limited from here.
    """
    for line in proc_cgroup.splitlines():
        hierarchy, sep, rest = line.partition(":")
        if not sep or hierarchy != "0":
            continue
        controllers, sep, path = rest.partition(":")
        if not sep or controllers:
            continue
        if path.endswith(" (deleted)"):
            raise Conflict(f"the cgroup of the {who} was removed ({path[:-len(' (deleted)')]})")
        if not path.startswith("/"):
            raise InvalidArgument(f"malformed cgroup v2 path of the {who}: {path!r}")
        if path == "/.." or path.startswith("/../"):
            raise Conflict(f"the {who} is in a cgroup outside vrnicd's cgroup namespace ({path})")
        return posixpath.normpath(path) if path != "/" else "/"
    raise Conflict(f"the {who} has no cgroup v2 membership (no '0::' line in /proc/<pid>/cgroup): "
                   f"the rdma controller can only be used on the unified hierarchy")


def is_same_or_ancestor(ancestor: str, path: str) -> bool:
    """True when cgroup `ancestor` is `path` or one of its ancestors."""
    if ancestor == "/":
        return True
    return path == ancestor or path.startswith(ancestor + "/")


def containment_refusal(guest: str, own: str) -> str | None:
    """Why the guest's cgroup `guest` cannot be limited by vrnicd in cgroup `own`, or None if it can."""
    if guest == "/":
        return ("the guest is in the root cgroup, which has no rdma.max (the root cannot be limited); "
                "start it in a cgroup of its own (a container does)")
    if guest == own:
        return (f"the guest shares vrnicd's own cgroup {own}: a zero rdma limit there would stop vrnicd "
                f"from creating the objects the guest needs; run the guest in a cgroup of its own")
    if is_same_or_ancestor(guest, own):
        return (f"vrnicd's cgroup {own} lies inside the guest's cgroup {guest}: rdma limits are "
                f"hierarchical, so limiting the guest would limit vrnicd too")
    return None


def require_containable(guest: str, own: str) -> None:
    reason = containment_refusal(guest, own)
    if reason is not None:
        raise Conflict(f"cannot contain the guest: {reason}")


def ancestors(path: str) -> list[str]:
    """The proper ancestors of a cgroup path, root first: '/a/b/c' -> ['/', '/a', '/a/b']."""
    if path == "/":
        return []
    parts = path.strip("/").split("/")
    return ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


# --- /proc/self/mountinfo -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cgroup2Mount:
    root: str        # the cgroup this mount shows at its mount point (normally "/")
    mount_point: str

    def directory(self, cgroup: str) -> str:
        """The directory of cgroup `cgroup` under this mount; Conflict if the mount does not show it."""
        if not is_same_or_ancestor(self.root, cgroup):
            raise Conflict(f"cgroup {cgroup} is not visible through the cgroup2 mount at {self.mount_point} "
                           f"(which shows {self.root})")
        rest = cgroup[len(self.root):] if self.root != "/" else cgroup
        return posixpath.join(self.mount_point, rest.lstrip("/")).rstrip("/") or "/"


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def cgroup2_mounts(mountinfo: str) -> list[Cgroup2Mount]:
    """Every cgroup2 mount in `/proc/self/mountinfo` text, in mount order."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) <= sep + 1 or fields[sep + 1] != "cgroup2":
            continue
        found.append(Cgroup2Mount(root=_unescape(fields[3]), mount_point=_unescape(fields[4])))
    return found


def pick_cgroup2_mount(mountinfo: str, cgroup: str) -> Cgroup2Mount:
    """The cgroup2 mount that shows `cgroup`, /sys/fs/cgroup first; Conflict when there is none."""
    mounts = [m for m in cgroup2_mounts(mountinfo) if is_same_or_ancestor(m.root, cgroup)]
    if not mounts:
        raise Conflict(f"no cgroup2 filesystem that shows cgroup {cgroup} is mounted "
                       f"(mount -t cgroup2 none /sys/fs/cgroup)")
    mounts.sort(key=lambda m: (m.mount_point != "/sys/fs/cgroup", len(m.root)))
    return mounts[0]


# --- enabling the controller ----------------------------------------------------------------------------

@dataclass(frozen=True)
class CgroupNode:
    """What decides whether `rdma` can be enabled in a cgroup's cgroup.subtree_control."""

    path: str
    controllers: frozenset[str]       # cgroup.controllers: what its parent enabled for it
    subtree_control: frozenset[str]   # cgroup.subtree_control: what it enables for its children
    has_processes: bool = False       # cgroup.procs is not empty
    type: str = "domain"              # cgroup.type (the root has none; "domain" then)


def enable_plan(chain: Sequence[CgroupNode], controller: str = RDMA_CONTROLLER) -> list[str]:
    """The cgroups whose subtree_control need "+rdma", top-down, so that the cgroup below the last one of
    `chain` (the guest's) gets rdma.max. `chain` is every ancestor of the guest that vrnicd can see, top
    first: normally the root ("/") down to the guest's parent.

    cgroup v2's rules (kernel/cgroup/cgroup.c, cgroup_subtree_control_write and
    cgroup_vet_subtree_control_enable): a controller can be enabled for the children of C only if C itself
    has it (C's cgroup.controllers, i.e. C's parent enabled it; ENOENT otherwise), so it goes top-down; a
    non-root C with processes of its own cannot enable a domain controller for its children (the
    no-internal-processes rule; EBUSY); no domain controller in a threaded subtree or its root
    (EOPNOTSUPP). The root is exempt from the last two. Nothing is planned, and Conflict says why, when a
    step would break one of them.
    """
    if not chain:  # the guest's cgroup is the top of what vrnicd sees: whatever is above decided it
        return []
    top = chain[0]
    if controller not in top.controllers:
        if top.path == "/":
            raise Conflict(f"the {controller} controller is not available on the cgroup2 hierarchy (not in "
                           f"the root's cgroup.controllers: not built, or bound to a cgroup v1 hierarchy)")
        raise Conflict(f"the {controller} controller is not enabled for {top.path} by its parent, which "
                       f"lies outside the cgroup2 mount vrnicd sees")
    plan: list[str] = []
    # Top-down, every node ends up enabling the controller (or we refuse), so the next one has it.
    for node in chain:
        if controller in node.subtree_control:
            continue
        if node.path != "/":
            if node.type != "domain":
                raise Conflict(f"cannot enable {controller} for the children of {node.path}: it is a "
                               f"'{node.type}' cgroup, and domain controllers cannot be enabled in a "
                               f"threaded subtree")
            if node.has_processes:
                raise Conflict(f"cannot enable {controller} for the children of {node.path}: it has "
                               f"processes of its own, and cgroup v2 enables a domain controller only in a "
                               f"cgroup without processes (the no-internal-processes rule); move them to a "
                               f"leaf cgroup first")
        plan.append(node.path)
    return plan


def guest_type_refusal(cgroup_type: str) -> str | None:
    """A guest's own cgroup must be a domain (or the root of a threaded subtree) to have rdma.max."""
    if cgroup_type in ("domain", "domain threaded"):
        return None
    return (f"the guest's cgroup is '{cgroup_type}': domain controllers such as rdma do not apply to it "
            f"on its own")


# --- rdma.max and rdma.current --------------------------------------------------------------------------

@dataclass(frozen=True)
class RdmaLimit:
    """One line of rdma.max (None = "max", unlimited) or rdma.current (counts)."""

    device: str
    hca_handle: int | None = None
    hca_object: int | None = None

    def __post_init__(self) -> None:
        if not self.device or len(self.device) > _DEVICE_NAME_MAX or not _DEVICE_RE.fullmatch(self.device):
            raise InvalidArgument(f"bad RDMA device name: {self.device!r}")
        for name in ("hca_handle", "hca_object"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < _S32_MAX:
                raise InvalidArgument(f"{name} must be 0..{_S32_MAX - 1} or unlimited, not {value}")

    @property
    def unlimited(self) -> bool:
        return self.hca_handle is None and self.hca_object is None

    def render(self) -> str:
        """The line to write into rdma.max (both keys always, so the write replaces the whole limit)."""
        return f"{self.device} hca_handle={_value(self.hca_handle)} hca_object={_value(self.hca_object)}"


def zero_limit(device: str) -> RdmaLimit:
    """No ucontext and no object on `device`."""
    return RdmaLimit(device, 0, 0)


def _value(value: int | None) -> str:
    return UNLIMITED if value is None else str(value)


def _parse_value(device: str, key: str, text: str) -> int | None:
    if text == UNLIMITED:
        return None
    if not text.isdigit():
        raise InvalidArgument(f"bad rdma value for {device} {key}: {text!r}")
    value = int(text)
    return None if value >= _S32_MAX else value


def parse_rdma_line(line: str) -> RdmaLimit:
    """One line as the kernel prints it: 'rxe0 hca_handle=max hca_object=3 ' (a trailing blank is usual)."""
    fields = line.split()
    if not fields:
        raise InvalidArgument("empty rdma line")
    device = fields[0]
    values: dict[str, int | None] = {"hca_handle": None, "hca_object": None}
    seen: set[str] = set()
    for item in fields[1:]:
        key, sep, text = item.partition("=")
        if not sep or key not in values or key in seen:
            raise InvalidArgument(f"bad rdma entry for {device}: {item!r}")
        seen.add(key)
        values[key] = _parse_value(device, key, text)
    return RdmaLimit(device, values["hca_handle"], values["hca_object"])


def parse_rdma_file(text: str) -> dict[str, RdmaLimit]:
    """rdma.max or rdma.current: one line per RDMA device the controller knows."""
    limits: dict[str, RdmaLimit] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        limit = parse_rdma_line(line)
        if limit.device in limits:
            raise InvalidArgument(f"device {limit.device} appears twice")
        limits[limit.device] = limit
    return limits


# --- several holders of one limit -----------------------------------------------------------------------

@dataclass
class _Hold:
    previous: RdmaLimit
    count: int


class ConfinementLedger:
    """Who holds a limit on (cgroup directory, device): the first holder records the line it replaced, the
    last release gives it back. Two vRNICs of one container, or two guest processes of one cgroup, share
    one limit; releasing one of them must not lift it for the other. Not thread-safe: the edge locks."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], _Hold] = {}

    def holders(self, cgroup_dir: str, device: str) -> int:
        hold = self._held.get((cgroup_dir, device))
        return hold.count if hold else 0

    def previous(self, cgroup_dir: str, device: str) -> RdmaLimit | None:
        hold = self._held.get((cgroup_dir, device))
        return hold.previous if hold else None

    def add(self, cgroup_dir: str, device: str, previous: RdmaLimit) -> None:
        """One more holder; `previous` counts only for the first (later ones see the limit already set)."""
        if previous.device != device:
            raise InvalidArgument(f"previous limit is for {previous.device}, not {device}")
        hold = self._held.get((cgroup_dir, device))
        if hold is None:
            self._held[(cgroup_dir, device)] = _Hold(previous, 1)
        else:
            hold.count += 1

    def remove(self, cgroup_dir: str, device: str) -> RdmaLimit | None:
        """One holder fewer; the line to restore when it was the last one, else None."""
        key = (cgroup_dir, device)
        hold = self._held.get(key)
        if hold is None:
            raise InvalidArgument(f"no confinement of {cgroup_dir} on {device} is held")
        hold.count -= 1
        if hold.count:
            return None
        del self._held[key]
        return hold.previous
