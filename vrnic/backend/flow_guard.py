"""vrnicd's side of the RoCEv2 packet guard: one allowed flow per RC QP it connected, gone with the QP.

With the guard on, RoCE egress from every device address vrnicd serves is filtered (kernel/roce_guard/):
a packet leaves only if vrnicd connected its QP to that destination. That is what stops a direct-engine
guest, which holds its ucontext's fd, from re-pointing a QP at someone it was not connected to.
"""

from __future__ import annotations

import ipaddress
import logging
import threading

from vrnic.backend.packet_guard import PacketGuard
from vrnic.core.roce_guard import GuardFlow
from vrnic.errors import InvalidArgument, VrnicError

log = logging.getLogger(__name__)


def ipv4_of(gid: str) -> str:
    """The IPv4 address inside a RoCE v2 IPv4-mapped GID."""
    mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    if mapped is None:
        raise InvalidArgument(f"the packet guard filters IPv4 RoCE; {gid} is not an IPv4-mapped GID")
    return str(mapped)


class FlowGuard:
    def __init__(self, guard: PacketGuard | None = None) -> None:
        self.guard = guard or PacketGuard()
        self._ips: set[str] = set()
        self._lock = threading.Lock()  # allow() reads then writes the set: one writer at a time

    def guard_address(self, gid: str) -> None:
        """Start filtering RoCE egress from this device address (flows allowed so far stay)."""
        ip = ipv4_of(gid)
        with self._lock:
            if ip not in self._ips:
                self.guard.install(sorted(self._ips | {ip}))
                self._ips.add(ip)

    def flow(self, vrnic_id: str, local_gid: str, qpn: int, peer_gid: str, peer_qpn: int) -> GuardFlow:
        return GuardFlow(vrnic_id, ipv4_of(local_gid), qpn, ipv4_of(peer_gid), peer_qpn)

    def allow(self, flow: GuardFlow) -> None:
        with self._lock:
            self.guard.allow(flow)

    def drop(self, *flows: GuardFlow | None) -> None:
        """Forget flows; a failure is logged (the QP is gone, a stale flow admits nothing new)."""
        present = [f for f in flows if f is not None]
        if not present:
            return
        with self._lock:
            try:
                self.guard.drop(present)
            except VrnicError as exc:
                log.warning("packet guard: could not drop %s: %s", present, exc)

    def revoke(self, vrnic_id: str) -> None:
        """Every flow of a vRNIC, when its session ends: a guest keeping its fd gets no packet out."""
        with self._lock:
            try:
                self.guard.revoke(vrnic_id)
            except VrnicError as exc:
                log.error("packet guard: could not revoke the flows of vRNIC %s: %s", vrnic_id, exc)

    def close(self) -> None:
        with self._lock:
            if self._ips:
                self.guard.remove()
                self._ips.clear()
