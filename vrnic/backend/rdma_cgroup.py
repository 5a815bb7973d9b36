"""Contain a direct-path guest: a zero rdma cgroup limit on its cgroup, and its RLIMIT_MEMLOCK.

The guest of the direct data path holds vrnicd's uverbs fd and could create objects on that ucontext
itself (INVOKE_WRITE through the ioctl path), outside vrnicd's quotas. The kernel charges each object to
the rdma cgroup of the task that creates it, so vrnicd, which creates everything the guest uses from its
own cgroup, sets the guest's cgroup to `<device> hca_handle=0 hca_object=0`: the guest keeps using
vrnicd's objects and can create none (EAGAIN). See vrnic.core.containment for what is charged to whom.

What `confine` writes, in this order:

1. `+rdma` into `cgroup.subtree_control` of each ancestor of the guest's cgroup that does not enable it
   yet, top-down from the root (a controller must be enabled in the parent before the child can enable
   it). It refuses, writing nothing, when an ancestor other than the root holds processes itself (cgroup
   v2 enables domain controllers only in cgroups without processes) or is threaded. Enabling `rdma` is
   harmless to everyone else (every new rdma.max starts at "max") and is left in place by `release`:
   others may rely on it by then, and turning it off fails while any child enables it.
2. the guest cgroup's `rdma.max` line for the device, after reading the line it replaces.

`release()` writes the replaced line back when the last holder of that cgroup and device lets go (two
vRNICs of one container share the limit). A cgroup that is gone by then needs nothing.

The guest must run in a cgroup of its own (a container does): `confine` refuses the root cgroup, vrnicd's
own cgroup and any cgroup that contains vrnicd's, because the limit would bind vrnicd too. Every process in
the guest's cgroup is bound by the limit on that device.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from vrnic.core.containment import (
    RDMA_CONTROLLER,
    CgroupNode,
    ConfinementLedger,
    RdmaLimit,
    ancestors,
    enable_plan,
    guest_type_refusal,
    is_same_or_ancestor,
    parse_rdma_file,
    pick_cgroup2_mount,
    require_containable,
    unified_cgroup_path,
    zero_limit,
)
from vrnic.errors import Conflict, DeviceError, InvalidArgument, VrnicError

log = logging.getLogger(__name__)

PROC = Path("/proc")

_ledger = ConfinementLedger()
_lock = threading.Lock()
# A refusal by the cgroup rules, not a failure of the machine.
_RULE_ERRNOS = {errno.EBUSY: "the cgroup has processes of its own", errno.ENOENT: "not available there",
                errno.EOPNOTSUPP: "threaded subtree"}


def _errname(err: int) -> str:
    return f"{errno.errorcode.get(err, '?')}, errno {err}"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise DeviceError(f"{path}: {e.strerror} ({_errname(e.errno or 0)})", e.errno or 0) from e


def _write(path: Path, text: str) -> None:
    """One write(2), as cgroupfs wants a whole line per write."""
    data = text.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        raise DeviceError(f"{path}: writing {text!r}: {e.strerror} ({_errname(e.errno or 0)})",
                          e.errno or 0) from e


def _proc_cgroup(proc: Path, pid: int | str, who: str) -> str:
    path = proc / str(pid) / "cgroup"
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError) as e:
        raise Conflict(f"the {who} (pid {pid}) is gone ({path}: {_errname(e.errno or errno.ESRCH)})") from e
    except OSError as e:
        raise DeviceError(f"{path}: {e.strerror} ({_errname(e.errno or 0)})", e.errno or 0) from e
    return unified_cgroup_path(text, who)


def _words(path: Path) -> frozenset[str]:
    return frozenset(_read(path).split())


def _node(directory: Path, cgroup: str) -> CgroupNode:
    root = cgroup == "/"
    return CgroupNode(
        path=cgroup,
        controllers=_words(directory / "cgroup.controllers"),
        subtree_control=_words(directory / "cgroup.subtree_control"),
        has_processes=False if root else bool(_read(directory / "cgroup.procs").strip()),
        type="domain" if root else _read(directory / "cgroup.type").strip(),
    )


def _device_line(path: Path, device: str) -> RdmaLimit:
    try:
        lines = parse_rdma_file(_read(path))
    except InvalidArgument as e:
        raise DeviceError(f"{path}: {e}", errno.EINVAL) from e
    if device not in lines:
        raise DeviceError(f"{path}: RDMA device {device} is not registered with the rdma controller "
                          f"(known: {', '.join(sorted(lines)) or 'none'})", errno.ENODEV)
    return lines[device]


@dataclass
class Confinement:
    """A zero rdma limit on a guest's cgroup for one device; `release()` lifts it (idempotent)."""

    pid: int
    device: str
    cgroup: str                  # the guest's cgroup v2 path, e.g. /system.slice/docker-1f2e.scope
    directory: Path              # that cgroup's directory under the cgroup2 mount
    previous: RdmaLimit          # the line the limit replaced (as the first holder found it)
    usage_at_confine: RdmaLimit  # rdma.current then: what the cgroup already held (a limit revokes nothing)
    enabled_in: tuple[str, ...] = ()  # cgroups whose subtree_control this call had to enable rdma in
    _released: bool = field(default=False, repr=False)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        with _lock:
            if self._released:
                return
            self._released = True
            restore = _ledger.remove(str(self.directory), self.device)
            if restore is None:  # another vRNIC of this cgroup still holds the limit
                return
            try:
                _write(self.directory / "rdma.max", restore.render())
            except DeviceError as e:
                if e.errno in (errno.ENOENT, errno.ENODEV):  # the cgroup, or the device, is gone
                    return
                raise

    def __enter__(self) -> Confinement:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def confine(pid: int, device: str, *, proc: Path = PROC) -> Confinement:
    """Limit the cgroup of guest process `pid` to no ucontext and no object on RDMA device `device`.

    Conflict (with the reason) when the guest cannot be contained: no cgroup v2, the root cgroup, vrnicd's
    own cgroup or one containing it, a threaded cgroup, or ancestors where the controller cannot be enabled.
    DeviceError (with path and errno) when the kernel refuses a read or write.
    """
    limit = zero_limit(device)  # validates the name before anything is written
    guest = _proc_cgroup(proc, pid, "guest process")
    own = _proc_cgroup(proc, "self", "vrnicd process")
    require_containable(guest, own)
    mount = pick_cgroup2_mount(_read(proc / "self" / "mountinfo"), guest)
    directory = Path(mount.directory(guest))

    with _lock:
        refusal = guest_type_refusal(_read(directory / "cgroup.type").strip())
        if refusal is not None:
            raise Conflict(f"cannot contain the guest: {refusal}")
        chain = [c for c in ancestors(guest) if is_same_or_ancestor(mount.root, c)]
        plan = enable_plan([_node(Path(mount.directory(c)), c) for c in chain])
        for cgroup in plan:
            path = Path(mount.directory(cgroup)) / "cgroup.subtree_control"
            try:
                _write(path, f"+{RDMA_CONTROLLER}")
            except DeviceError as e:
                if e.errno in _RULE_ERRNOS:
                    raise Conflict(f"cannot enable the rdma controller for the guest: {e} "
                                   f"({_RULE_ERRNOS[e.errno]})") from e
                raise

        rdma_max = directory / "rdma.max"
        key = str(directory)
        current = _device_line(rdma_max, device)
        usage = _device_line(directory / "rdma.current", device)
        previous = _ledger.previous(key, device) or current
        if current != limit:  # the first holder, or someone lifted the limit under us: (re)assert it
            _write(rdma_max, limit.render())
            written = _device_line(rdma_max, device)
            if written != limit:
                if _ledger.holders(key, device) == 0:
                    _write(rdma_max, previous.render())
                raise DeviceError(f"{rdma_max}: wrote {limit.render()!r} but it reads {written.render()!r}",
                                  errno.EIO)
        _ledger.add(key, device, previous)

    confinement = Confinement(pid=pid, device=device, cgroup=guest, directory=directory, previous=previous,
                              usage_at_confine=usage, enabled_in=tuple(plan))
    try:
        moved = _proc_cgroup(proc, pid, "guest process") != guest
    except VrnicError:
        confinement.release()
        raise
    if moved:
        confinement.release()
        raise Conflict(f"the guest (pid {pid}) left cgroup {guest} while it was being confined")
    return confinement


def limit_memlock(pid: int, limit_bytes: int) -> tuple[int, int]:
    """Set RLIMIT_MEMLOCK (soft and hard) of process `pid`; returns the previous (soft, hard).

    REG_MR pins memory against the creating process's mm and checks that task's RLIMIT_MEMLOCK
    (ib_umem_get: EPERM when the limit is 0, ENOMEM when the pinned pages would exceed it), unless the task
    has CAP_IPC_LOCK. vrnicd pins guest memory through its own mapping, so a guest needs no memlock; 0
    keeps it from pinning any memory of its own through a passed uverbs fd. Setting the hard limit too
    keeps the guest from raising its soft limit again.
    """
    if limit_bytes < 0 and limit_bytes != resource.RLIM_INFINITY:
        raise InvalidArgument(f"memlock limit must be >= 0 bytes, not {limit_bytes}")
    try:
        return resource.prlimit(pid, resource.RLIMIT_MEMLOCK, (limit_bytes, limit_bytes))
    except ProcessLookupError as e:
        raise Conflict(f"the guest process (pid {pid}) is gone ({_errname(errno.ESRCH)})") from e
    except OSError as e:
        raise DeviceError(f"prlimit({pid}, RLIMIT_MEMLOCK, {limit_bytes}): {e.strerror} "
                          f"({_errname(e.errno or 0)})", e.errno or 0) from e


def restore_memlock(pid: int, previous: tuple[int, int]) -> None:
    """Put back a RLIMIT_MEMLOCK that limit_memlock lowered; quietly if the process is gone."""
    try:
        resource.prlimit(pid, resource.RLIMIT_MEMLOCK, previous)
    except ProcessLookupError:
        return
    except OSError as exc:
        log.warning("cannot restore RLIMIT_MEMLOCK of pid %d: %s", pid, exc)
