"""The pyverbs edge: errors become vrnic errors here, and nowhere else.

Also the two things pyverbs 44 does not give directly: a device inventory in
plain data, and the file descriptor of a completion channel (for select()).
"""

from __future__ import annotations

import errno as errnos
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyverbs.cq import CompChannel
from pyverbs.device import Context, get_device_list, guid_to_hex
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError

from vrnic.backend.sysfs import gid_table
from vrnic.core.model import DeviceInfo, GidEntry, PortInfo
from vrnic.errors import DeviceError, NotFound, NotSupported

PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
CAPS = ("max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_mr_size", "max_pd",
        "max_qp_rd_atom", "max_qp_init_rd_atom", "max_ah", "atomic_caps", "phys_port_cnt")


@contextmanager
def device_errors(what: str) -> Iterator[None]:
    """Turn pyverbs failures into DeviceError (with errno) or NotSupported."""
    try:
        yield
    except PyverbsRDMAError as exc:
        code = abs(exc.error_code or 0)
        if code in (errnos.EOPNOTSUPP, errnos.ENOSYS):
            raise NotSupported(f"{what}: not supported by the device") from exc
        raise DeviceError(f"{what}: {os.strerror(code) if code else exc}", code) from exc
    except PyverbsError as exc:
        raise DeviceError(f"{what}: {exc}") from exc


def device_names() -> list[str]:
    with device_errors("list RDMA devices"):
        return sorted(d.name.decode() for d in get_device_list())


def describe(name: str) -> DeviceInfo:
    if name not in device_names():
        raise NotFound(f"no RDMA device {name}")
    with device_errors(f"query {name}"), Context(name=name) as ctx:
        attr = ctx.query_device()
        caps = {c: int(getattr(attr, c)) for c in CAPS}
        ports = []
        for port in range(1, attr.phys_port_cnt + 1):
            pattr = ctx.query_port(port)
            gids = [GidEntry(index=i, gid=g, type=t) for i, g, t in gid_table(name, port)]
            ports.append(PortInfo(port=port, state=PORT_STATES.get(pattr.state, str(pattr.state)),
                                  mtu=MTU_BYTES.get(pattr.active_mtu, 0), gids=gids))
        return DeviceInfo(name=name, driver="verbs", node_guid=guid_to_hex(attr.node_guid), ports=ports,
                          caps=caps)


_fd_lock = threading.Lock()


def _event_fds() -> set[int]:
    found = set()
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == "anon_inode:[infinibandevent]":
                found.add(int(entry))
        except OSError:
            continue
    return found


def comp_channel_with_fd(ctx: Context) -> tuple[CompChannel, int | None]:
    """A completion channel and its fd, found as the one new [infinibandevent] fd.

    pyverbs does not expose ibv_comp_channel.fd; a global lock keeps two
    channels from being created at once so the new fd is unambiguous. None
    means the fd could not be identified and the caller must poll instead.
    """
    with _fd_lock:
        before = _event_fds()
        with device_errors("create completion channel"):
            channel = CompChannel(ctx)
        new = _event_fds() - before
    return channel, (new.pop() if len(new) == 1 else None)


def close_quietly(*resources: Any) -> None:
    """Close in the order given; keep going past failures so nothing else leaks."""
    for resource in resources:
        if resource is None:
            continue
        try:
            resource.close()
        except PyverbsError:
            continue
