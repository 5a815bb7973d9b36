"""The pyverbs edge: errors become vrnic errors here, and nowhere else.

Also the two things pyverbs 44 does not give directly: a device inventory in
plain data, and the file descriptor of a completion channel (for select()).
"""

from __future__ import annotations

import errno as errnos
import ipaddress
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyverbs.cq import CompChannel
from pyverbs.device import Context, get_device_list, guid_to_hex
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError

from vrnic.core.specs import DeviceInfo, GidEntry, PortInfo
from vrnic.errors import DeviceError, NotFound, NotSupported

PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
GID_TYPES = {0: "IB", 1: "RoCE v1", 2: "RoCE v2"}  # enum ibv_gid_type
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
CAPS = ("max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_mr_size", "max_pd",
        "max_qp_rd_atom", "max_qp_init_rd_atom", "max_ah", "atomic_caps", "phys_port_cnt")


def _display_gid(text: str) -> str:
    address = ipaddress.IPv6Address(text)
    return f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped else str(address)


def roce_v2_ipv4_gid(info: DeviceInfo, port: int = 1) -> tuple[int, str]:
    """(index, GID) of the port's RoCE v2 IPv4-mapped GID: the one routable between hosts."""
    for entry in next((p.gids for p in info.ports if p.port == port), []):
        if entry.type == "RoCE v2" and ipaddress.IPv6Address(entry.gid).ipv4_mapped is not None:
            return entry.index, entry.gid
    raise NotFound(f"{info.name} port {port} has no RoCE v2 IPv4 GID (is an address set on its netdev?)")


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
    with open_context(name) as ctx, device_errors(f"query {name}"):
        attr = ctx.query_device()
        caps = {c: int(getattr(attr, c)) for c in CAPS}
        ports = []
        # One ioctl for the valid entries; sysfs would mean reading every slot (1024 on rxe).
        table = ctx.query_gid_table(attr.phys_port_cnt * 1024)
        for port in range(1, attr.phys_port_cnt + 1):
            pattr = ctx.query_port(port)
            gids = [GidEntry(index=g.gid_index, gid=_display_gid(g.gid_str()), type=GID_TYPES.get(g.gid_type, "?"))
                    for g in table if g.port_num == port]
            ports.append(PortInfo(port=port, state=PORT_STATES.get(pattr.state, str(pattr.state)),
                                  mtu=MTU_BYTES.get(pattr.active_mtu, 0), gids=gids))
        return DeviceInfo(name=name, driver="verbs", node_guid=guid_to_hex(attr.node_guid), ports=ports,
                          caps=caps)


_fd_lock = threading.Lock()


def _open_fds() -> set[int]:
    """This process's open fds, without the one used to list them (its number is reused next)."""
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return {int(name) for name in os.listdir(listing)} - {listing}
    finally:
        os.close(listing)


def _is_event_fd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[infinibandevent]"
    except OSError:
        return False


def comp_channel_with_fd(ctx: Context) -> tuple[CompChannel, int | None]:
    """A completion channel and its fd, found as the one new [infinibandevent] fd.

    pyverbs does not expose ibv_comp_channel.fd; a global lock keeps two
    channels from being created at once so the new fd is unambiguous. None
    means the fd could not be identified and the caller must poll instead.
    """
    with _fd_lock:
        # Diff fd numbers and readlink only the new ones: a readlink per open fd is slow under TCG.
        before = _open_fds()
        with device_errors("create completion channel"):
            channel = CompChannel(ctx)
        new = [fd for fd in _open_fds() - before if _is_event_fd(fd)]
    return channel, (new[0] if len(new) == 1 else None)


def open_context(name: str) -> Context:
    """Open a device context; under the channel lock, because its async fd is an [infinibandevent] too."""
    with _fd_lock, device_errors(f"open {name}"):
        return Context(name=name)


def close_quietly(*resources: Any) -> None:
    """Close in the order given; keep going past failures so nothing else leaks."""
    for resource in resources:
        if resource is None:
            continue
        try:
            resource.close()
        except PyverbsError:
            continue
