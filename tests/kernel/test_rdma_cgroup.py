"""The direct path's containment on the real kernel: the rdma cgroup and RLIMIT_MEMLOCK.

The process running the tests plays vrnicd: it sits in a cgroup of its own (`daemon`), opens the uverbs
device, creates objects with raw write() commands, and passes the fd (SCM_RIGHTS) to guest processes in
sibling cgroups: `guest` (confined with vrnic.backend.rdma_cgroup.confine) and `free` (not confined, the
control). A guest that holds the fd cannot write() it (EACCES: not the opener's credentials) but can
create objects through the ioctl path (INVOKE_WRITE), which is what the cgroup must stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.rdma_cgroup import confine, limit_memlock
from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.containment import RdmaLimit, parse_rdma_file
from vrnic.errors import Conflict

from .cgroup_root import cgroup2_root_with_rdma
from .conftest import wait_for_baseline

pytestmark = pytest.mark.kernel

DEVICE = "rxe0"
RDMA_VERBS_IOCTL = 0xC0181B01
RDMA_DRIVER_RXE = 14
ATTR_CORE_IN, ATTR_CORE_OUT, ATTR_WRITE_CMD = 0, 1, 2
ATTR_MANDATORY = 1
GET_CONTEXT, ALLOC_PD, REG_MR, CREATE_COMP_CHANNEL, CREATE_CQ = 0, 3, 9, 17, 18
IB_ACCESS_LOCAL_WRITE = 1
CAP_IPC_LOCK = 14
PAGE = mmap.PAGESIZE


# --- raw uverbs -----------------------------------------------------------------------------------------

def legacy_write(fd: int, cmd: int, body: bytes, resp_len: int) -> bytes:
    """A legacy write() command: header <IHH, then the body with the response pointer first."""
    resp = ctypes.create_string_buffer(resp_len)
    payload = struct.pack("<Q", ctypes.addressof(resp)) + body
    os.write(fd, struct.pack("<IHH", cmd, (8 + len(payload)) // 4, resp_len // 4) + payload)
    return resp.raw


def invoke_write(fd: int, cmd: int, core_in: bytes, resp_len: int) -> bytes:
    """The same command through the ioctl path: RDMA_VERBS_IOCTL, DEVICE object, INVOKE_WRITE method.

    CORE_IN is the command struct without the legacy header (its `response` field unused); at most 8
    bytes travel inline in the attribute's data, more by pointer. CORE_OUT points at the response.
    """
    keep = ctypes.create_string_buffer(core_in, len(core_in))
    data_in = int.from_bytes(core_in.ljust(8, b"\0"), "little") if len(core_in) <= 8 else ctypes.addressof(keep)
    resp = ctypes.create_string_buffer(max(resp_len, 1))
    attrs = [(ATTR_WRITE_CMD, 8, ATTR_MANDATORY, cmd), (ATTR_CORE_IN, len(core_in), ATTR_MANDATORY, data_in),
             (ATTR_CORE_OUT, resp_len, ATTR_MANDATORY, ctypes.addressof(resp))]
    buf = bytearray(struct.pack("<HHHHQII", 24 + 16 * len(attrs), 0, 0, len(attrs), 0, RDMA_DRIVER_RXE, 0))
    for attr_id, length, flags, data in attrs:
        buf += struct.pack("<HHHHQ", attr_id, length, flags, 0, data)
    fcntl.ioctl(fd, RDMA_VERBS_IOCTL, buf)
    return resp.raw[:resp_len]


def u32(raw: bytes, index: int = 0) -> int:
    return int(struct.unpack_from("<I", raw, 4 * index)[0])


def alloc_pd_ioctl(fd: int) -> int:
    return u32(invoke_write(fd, ALLOC_PD, struct.pack("<Q", 0), 4))


def reg_mr_ioctl(fd: int, pd: int, length: int, address: int | None = None) -> tuple[int, int]:
    if address is None:
        area = mmap.mmap(-1, length)
        area.write(b"\x5a" * length)  # fault the pages in
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        _keep.append(area)
    raw = invoke_write(fd, REG_MR, struct.pack("<QQQQII", 0, address, length, address, pd,
                                               IB_ACCESS_LOCAL_WRITE), 12)
    return u32(raw, 0), u32(raw, 1)


_keep: list[mmap.mmap] = []  # a child's MR memory stays mapped until the child exits


def create_cq_ioctl(fd: int) -> int:
    return u32(invoke_write(fd, CREATE_CQ, struct.pack("<QQIIiI", 0, 0, 15, 0, -1, 0), 8))


def create_comp_channel_ioctl(fd: int) -> int:
    return u32(invoke_write(fd, CREATE_COMP_CHANNEL, struct.pack("<Q", 0), 4))


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """{'ok': result} or {'errno': n, 'name': 'EAGAIN'}: what a child reports for one call."""
    try:
        return {"ok": fn()}
    except OSError as e:
        return {"errno": e.errno, "name": errno.errorcode.get(e.errno or 0, "?")}


def drop_cap_ipc_lock() -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~(1 << CAP_IPC_LOCK)
    data[0].permitted &= ~(1 << CAP_IPC_LOCK)
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def has_cap(bit: int) -> bool:
    status = Path("/proc/self/status").read_text()
    eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))
    return bool(int(eff, 16) >> bit & 1)


# --- guest processes ------------------------------------------------------------------------------------

@dataclass
class Guest:
    """A forked process that moved itself into `cgroup` and waits for the fd and the go."""

    pid: int
    sock: socket.socket
    reaped: bool = False

    def kill(self) -> None:
        if not self.reaped:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
            self.reaped = True

    def run(self, fd: int | None, **args: Any) -> dict[str, Any]:
        """Pass the fd (SCM_RIGHTS, as vrnicd does) and the arguments; wait for the guest's report."""
        socket.send_fds(self.sock, [json.dumps(args).encode()], [] if fd is None else [fd])
        chunks = []
        while chunk := self.sock.recv(65536):
            chunks.append(chunk)
        self.sock.close()
        _, status = os.waitpid(self.pid, 0)
        self.reaped = True
        result: dict[str, Any] = json.loads(b"".join(chunks) or b"{}")
        assert "crash" not in result, result["crash"]
        assert os.waitstatus_to_exitcode(status) == 0, result
        return result


Action = Callable[[int | None, dict[str, Any]], dict[str, Any]]


def spawn(cgroup: Path | None, action: Action) -> Guest:
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the guest: never returns into pytest
        code = 1
        try:
            parent.close()
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text("0")
            child.sendall(b"r")
            message, fds, _, _ = socket.recv_fds(child, 65536, 1)
            result = action(fds[0] if fds else None, json.loads(message))
            child.sendall(json.dumps(result).encode())
            code = 0
        except BaseException as e:  # noqa: B036 - report anything, then leave
            with contextlib.suppress(OSError):
                child.sendall(json.dumps({"crash": repr(e)}).encode())
        finally:
            os._exit(code)
    child.close()
    guest = Guest(pid, parent)
    _guests.append(guest)
    assert parent.recv(1) == b"r", "the guest died before it was ready"
    return guest


_guests: list[Guest] = []


# --- the cgroups ----------------------------------------------------------------------------------------

@dataclass
class Lab:
    root: Path      # the cgroup2 mount
    top: Path
    daemon: Path    # where this process (the "vrnicd") runs
    guest: Path     # the confined guest's cgroup
    free: Path      # an unconfined guest's cgroup (the control)
    uverbs: Path

    def current(self, cgroup: Path) -> RdmaLimit:
        return parse_rdma_file((cgroup / "rdma.current").read_text())[DEVICE]

    def wait_current(self, cgroup: Path, expected: RdmaLimit, timeout: float = 5.0) -> RdmaLimit:
        deadline = time.monotonic() + timeout
        while (now := self.current(cgroup)) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return now

    def limit(self, cgroup: Path) -> RdmaLimit:
        return parse_rdma_file((cgroup / "rdma.max").read_text())[DEVICE]

    def open_context(self) -> tuple[int, int]:
        """Open the device and GET_CONTEXT with write(), as vrnicd does: (cmd fd, async fd)."""
        fd = os.open(self.uverbs, os.O_RDWR | os.O_CLOEXEC)
        raw = legacy_write(fd, GET_CONTEXT, b"", 8)
        return fd, u32(raw, 0)


def _uverbs_of(device: str) -> Path | None:
    for entry in Path("/sys/class/infiniband_verbs").glob("uverbs*"):
        if (entry / "ibdev").read_text().strip() == device:
            return Path("/dev/infiniband") / entry.name
    return None


@pytest.fixture
def lab() -> Iterator[Lab]:
    if DEVICE not in rdma_devices():
        pytest.skip(f"needs the rxe device {DEVICE} (the lab's single or pair topology)")
    uverbs = _uverbs_of(DEVICE)
    if uverbs is None or not uverbs.exists():
        pytest.skip(f"no uverbs character device for {DEVICE}")
    hierarchy = cgroup2_root_with_rdma()
    root, own, root_enabled_rdma = hierarchy.root, hierarchy.own, hierarchy.was_enabled

    baseline = resource_counts()
    top = root / f"vrnic-test-{os.getpid()}"
    dirs = [top / "daemon", top / "guest", top / "free"]
    top.mkdir()
    for d in dirs:
        d.mkdir()
    (top / "daemon" / "cgroup.procs").write_text("0")
    try:
        yield Lab(root, top, *dirs, uverbs=uverbs)
    finally:
        while _guests:  # a failed test may leave a guest waiting
            _guests.pop().kill()
        (root / own.lstrip("/") / "cgroup.procs").write_text("0")
        for d in [*dirs, top]:
            for _ in range(100):  # exited guests may linger a moment
                try:
                    d.rmdir()
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.05)
            else:
                raise AssertionError(f"{d} stays busy: {(d / 'cgroup.procs').read_text()!r}")
        if not root_enabled_rdma and "rdma" in (root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("-rdma")
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"


# --- the tests ------------------------------------------------------------------------------------------

def test_a_confined_process_cannot_open_a_verbs_context(lab: Lab) -> None:
    def open_device(_: int | None, args: dict[str, Any]) -> dict[str, Any]:
        from pyverbs.device import Context

        try:
            Context(name=DEVICE).close()
            return {"ok": True}
        except Exception as e:  # PyverbsRDMAError carries the errno
            return {"error": type(e).__name__, "errno": getattr(e, "error_code", None), "message": str(e)}

    guest, free = spawn(lab.guest, open_device), spawn(lab.free, open_device)
    with confine(guest.pid, DEVICE) as c:
        assert lab.limit(lab.guest) == RdmaLimit(DEVICE, 0, 0)
        print(f"\nconfined {c.cgroup} (enabled rdma in {c.enabled_in}); "
              f"rdma.max {(lab.guest / 'rdma.max').read_text().strip()!r}")
        refused, allowed = guest.run(None), free.run(None)
    print(f"confined pyverbs Context({DEVICE!r}): {refused}")
    print(f"unconfined pyverbs Context({DEVICE!r}): {allowed}")
    assert refused["errno"] == errno.EAGAIN, refused
    assert allowed == {"ok": True}
    assert lab.limit(lab.guest) == RdmaLimit(DEVICE)


def test_a_guest_holding_vrnicds_fd_can_create_nothing_of_its_own(lab: Lab) -> None:
    def attack(fd: int | None, args: dict[str, Any]) -> dict[str, Any]:
        assert fd is not None
        pd = args["pd"]  # vrnicd's PD: the guest may use it, and tries to register its own memory on it
        return {
            "write_alloc_pd": attempt(lambda: u32(legacy_write(fd, ALLOC_PD, b"", 4))),
            "alloc_pd": attempt(lambda: alloc_pd_ioctl(fd)),
            "reg_mr": attempt(lambda: reg_mr_ioctl(fd, pd, PAGE)),
            "create_cq": attempt(lambda: create_cq_ioctl(fd)),
            "create_comp_channel": attempt(lambda: create_comp_channel_ioctl(fd)),
        }

    def alloc(fd: int | None, args: dict[str, Any]) -> dict[str, Any]:
        assert fd is not None
        return {"alloc_pd": attempt(lambda: alloc_pd_ioctl(fd))}

    guest = spawn(lab.guest, attack)  # the container is there first; vrnicd confines it at attach
    c = confine(guest.pid, DEVICE)
    assert c.enabled_in[-1:] == (f"/{lab.top.name}",)
    assert c.previous == RdmaLimit(DEVICE) and c.usage_at_confine == RdmaLimit(DEVICE, 0, 0)

    fd, async_fd = lab.open_context()  # vrnicd: the ucontext and a PD, with write()
    try:
        pd = u32(legacy_write(fd, ALLOC_PD, b"", 4))
        daemon_after_pd = lab.current(lab.daemon)
        assert daemon_after_pd == RdmaLimit(DEVICE, 1, 1)  # charged to the creator
        assert lab.current(lab.guest) == RdmaLimit(DEVICE, 0, 0)

        seen = guest.run(fd, pd=pd)
        print(f"\nvrnicd (cgroup daemon) made ctx + PD {pd}: daemon rdma.current {daemon_after_pd.render()!r}")
        print(f"confined guest with the passed fd: {seen}")
        assert seen["write_alloc_pd"]["errno"] == errno.EACCES  # write() is the opener's only
        for verb in ("alloc_pd", "reg_mr", "create_cq"):
            assert seen[verb]["errno"] == errno.EAGAIN, (verb, seen)
        assert "ok" in seen["create_comp_channel"], seen  # an fd object: not charged, not refused
        assert lab.current(lab.guest) == RdmaLimit(DEVICE, 0, 0)

        control = spawn(lab.free, alloc).run(fd)  # the same call, unconfined
        print(f"unconfined guest with the passed fd: {control}; free rdma.current "
              f"{lab.current(lab.free).render()!r}, daemon {lab.current(lab.daemon).render()!r}")
        assert "ok" in control["alloc_pd"], control
        assert lab.current(lab.free) == RdmaLimit(DEVICE, 0, 1)  # charged to the guest that made it
        assert lab.current(lab.daemon) == RdmaLimit(DEVICE, 1, 1)

        c.release()
        assert lab.limit(lab.guest) == RdmaLimit(DEVICE)
        after = spawn(lab.guest, alloc).run(fd)
        print(f"guest cgroup after release(): {after}")
        assert "ok" in after["alloc_pd"], after
        assert lab.current(lab.guest) == RdmaLimit(DEVICE, 0, 1)
    finally:
        c.release()
        os.close(async_fd)
        os.close(fd)
    for cgroup in (lab.daemon, lab.guest, lab.free):  # the ucontext is gone: everything uncharged
        assert lab.wait_current(cgroup, RdmaLimit(DEVICE, 0, 0)) == RdmaLimit(DEVICE, 0, 0), cgroup


def test_confine_refuses_what_it_cannot_contain_on_the_real_kernel(lab: Lab) -> None:
    with pytest.raises(Conflict, match="shares vrnicd's own cgroup"):
        confine(os.getpid(), DEVICE)
    in_root = spawn(lab.root, lambda fd, args: {})
    try:
        with pytest.raises(Conflict, match="root cgroup"):
            confine(in_root.pid, DEVICE)
    finally:
        in_root.run(None)


def test_memlock_keeps_a_guest_from_pinning_its_own_memory(lab: Lab) -> None:
    def reg(keep_cap: bool, sizes: tuple[int, ...]) -> Action:
        def action(fd: int | None, args: dict[str, Any]) -> dict[str, Any]:
            assert fd is not None
            if not keep_cap:
                drop_cap_ipc_lock()
            import resource

            out: dict[str, Any] = {"memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK),
                                   "cap_ipc_lock": has_cap(CAP_IPC_LOCK)}
            for size in sizes:
                out[f"reg_mr_{size}"] = attempt(lambda size=size: reg_mr_ioctl(fd, args["pd"], size))
            return out
        return action

    cases = [(0, False, (PAGE,)), (PAGE, False, (2 * PAGE, PAGE)), (0, True, (PAGE,))]
    fd, async_fd = lab.open_context()
    try:
        pd = u32(legacy_write(fd, ALLOC_PD, b"", 4))
        results = []
        for limit_bytes, keep_cap, sizes in cases:
            guest = spawn(lab.free, reg(keep_cap, sizes))
            limit_memlock(guest.pid, limit_bytes)  # vrnicd, on the guest it just saw attach
            results.append(guest.run(fd, pd=pd))
    finally:
        os.close(async_fd)
        os.close(fd)
    for (limit_bytes, keep_cap, _), seen in zip(cases, results, strict=True):
        print(f"\nmemlock {limit_bytes}, CAP_IPC_LOCK {'kept' if keep_cap else 'dropped'}: {seen}")
        assert seen["memlock"] == [limit_bytes, limit_bytes]
        assert seen["cap_ipc_lock"] is keep_cap
    no_lock, one_page, with_cap = results
    assert no_lock[f"reg_mr_{PAGE}"]["errno"] == errno.EPERM      # can_do_mlock(): limit 0, no capability
    assert one_page[f"reg_mr_{2 * PAGE}"]["errno"] == errno.ENOMEM  # over the limit
    assert "ok" in one_page[f"reg_mr_{PAGE}"]                      # within it
    assert "ok" in with_cap[f"reg_mr_{PAGE}"]                       # CAP_IPC_LOCK bypasses the limit
