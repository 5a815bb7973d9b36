"""The netlink edge of SR-IOV (pyroute2): read and set VF attributes on a PF, move netdevs between
network namespaces. The socket is injected, so the code above needs no kernel in unit tests.
NetlinkError errnos become vrnic.errors here and nowhere else.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from vrnic.errors import Conflict, DeviceError, NotFound, NotSupported, VrnicError
from vrnic.sriov.plan import VfOp
from vrnic.sriov.vf_types import LinkState, VfConfig

RTEXT_FILTER_VF = 1  # IFLA_EXT_MASK bit that makes the kernel include IFLA_VFINFO_LIST


class NetlinkSocket(Protocol):
    """The part of pyroute2's IPRoute this edge uses."""

    def link_lookup(self, **kwarg: Any) -> list[int]: ...

    def link(self, command: str, **kwarg: Any) -> Any: ...

    def close(self) -> None: ...


def translate(error: Exception, what: str) -> VrnicError:
    """NetlinkError / OSError -> the vrnic error hierarchy."""
    code = getattr(error, "code", None) or getattr(error, "errno", None) or 0
    text = os.strerror(code) if code else str(error)
    if code in (errno.ENODEV, errno.ENOENT):
        return NotFound(f"{what}: {text}")
    if code == errno.EOPNOTSUPP:
        return NotSupported(f"{what}: the device does not support it ({text})")
    if code == errno.EEXIST:
        return Conflict(f"{what}: {text}")
    return DeviceError(f"{what}: the kernel refused: {text}", code)


def _socket_errors() -> tuple[type[Exception], ...]:
    from pyroute2 import NetlinkError

    return (NetlinkError, OSError)


def parse_vf_list(vfinfo_list: Any) -> dict[int, VfConfig]:
    """IFLA_VFINFO_LIST (as pyroute2 decodes it) -> {vf index: VfConfig}."""
    result: dict[int, VfConfig] = {}
    if not vfinfo_list:
        return result
    for vf in vfinfo_list.get_attrs("IFLA_VF_INFO"):
        mac = vf.get_attr("IFLA_VF_MAC") or {}
        vlan = vf.get_attr("IFLA_VF_VLAN") or {}
        rate = vf.get_attr("IFLA_VF_RATE") or {}
        spoofchk = vf.get_attr("IFLA_VF_SPOOFCHK") or {}
        trust = vf.get_attr("IFLA_VF_TRUST") or {}
        link_state = vf.get_attr("IFLA_VF_LINK_STATE") or {}
        index = int(mac["vf"])
        # Drivers that do not support an attribute report (u32)-1 for it (spoofchk, trust): read it as off.
        result[index] = VfConfig(
            mac=str(mac.get("mac", "00:00:00:00:00:00")).lower(),
            vlan=int(vlan.get("vlan", 0)), qos=int(vlan.get("qos", 0)),
            max_tx_rate=int(rate.get("max_tx_rate", 0)), min_tx_rate=int(rate.get("min_tx_rate", 0)),
            spoofchk=int(spoofchk.get("spoofchk", 0)) == 1, trust=int(trust.get("trust", 0)) == 1,
            link_state=LinkState(int(link_state.get("link_state", 0))))
    return result


class VfNetlink:
    def __init__(self, socket: NetlinkSocket | None = None,
                 socket_factory: Callable[[str | None], NetlinkSocket] | None = None) -> None:
        self._socket = socket
        self._factory = socket_factory or _iproute

    @property
    def socket(self) -> NetlinkSocket:
        if self._socket is None:
            self._socket = self._factory(None)
        return self._socket

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def ifindex(self, ifname: str, socket: NetlinkSocket | None = None) -> int:
        try:
            found = (socket or self.socket).link_lookup(ifname=ifname)
        except _socket_errors() as e:
            raise translate(e, f"looking up {ifname}") from None
        if not found:
            raise NotFound(f"no network interface {ifname}")
        return int(found[0])

    def read_vfs(self, pf: str) -> dict[int, VfConfig]:
        index = self.ifindex(pf)
        try:
            message = self.socket.link("get", index=index, ext_mask=RTEXT_FILTER_VF)[0]
        except _socket_errors() as e:
            raise translate(e, f"reading the VFs of {pf}") from None
        return parse_vf_list(message.get_attr("IFLA_VFINFO_LIST"))

    def apply(self, pf: str, vf: int, ops: Sequence[VfOp]) -> None:
        """One netlink request per op, so an error names the attribute the kernel refused."""
        index = self.ifindex(pf)
        for op in ops:
            try:
                self.socket.link("set", index=index, vf=op.netlink_vf(vf))
            except _socket_errors() as e:
                raise translate(e, f"{pf}/vf{vf}: setting {op}") from None

    # Network namespaces ------------------------------------------------------------------------------

    def move_to_netns(self, ifname: str, netns: str) -> None:
        """Move a netdev from our namespace into the named one (/var/run/netns/<netns>)."""
        if "/" in netns or not netns:
            raise NotFound(f"no network namespace {netns!r}")
        if not os.path.exists(f"/var/run/netns/{netns}"):
            raise NotFound(f"no network namespace {netns!r} (/var/run/netns/{netns})")
        index = self.ifindex(ifname)
        try:
            self.socket.link("set", index=index, net_ns_fd=netns)
        except _socket_errors() as e:
            raise translate(e, f"moving {ifname} into netns {netns}") from None

    def return_from_netns(self, ifname: str, netns: str) -> None:
        """Move a netdev from the named namespace back into ours."""
        with self._in_netns(netns) as socket:
            index = self.ifindex(ifname, socket)
            own = os.open("/proc/self/ns/net", os.O_RDONLY)
            try:
                socket.link("set", index=index, net_ns_fd=own)
            except _socket_errors() as e:
                raise translate(e, f"returning {ifname} from netns {netns}") from None
            finally:
                os.close(own)

    def link_by_parent_in_netns(self, parent_device: str, netns: str) -> str | None:
        """The interface inside a namespace whose parent device is parent_device (a VF's PCI address)."""
        with self._in_netns(netns) as socket:
            for link in socket.link("dump"):
                if link.get_attr("IFLA_PARENT_DEV_NAME") == parent_device:
                    return str(link.get_attr("IFLA_IFNAME"))
        return None

    def links_in_netns(self, netns: str | None) -> set[str]:
        """Interface names in a namespace (None: ours)."""
        if netns is None:
            return {str(link.get_attr("IFLA_IFNAME")) for link in self.socket.link("dump")}
        with self._in_netns(netns) as socket:
            return {str(link.get_attr("IFLA_IFNAME")) for link in socket.link("dump")}

    @contextmanager
    def _in_netns(self, netns: str) -> Iterator[NetlinkSocket]:
        if not os.path.exists(f"/var/run/netns/{netns}"):
            raise NotFound(f"no network namespace {netns!r} (/var/run/netns/{netns})")
        try:
            socket = self._factory(netns)
        except _socket_errors() as e:
            raise translate(e, f"opening netns {netns}") from None
        try:
            yield socket
        finally:
            socket.close()


def _iproute(netns: str | None) -> NetlinkSocket:
    from pyroute2 import IPRoute

    socket: NetlinkSocket = IPRoute(netns=netns) if netns else IPRoute()
    return socket
