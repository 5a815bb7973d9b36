"""Virtual GIDs: the identities guests use, independent of the physical device they run on."""

from __future__ import annotations

import functools
import ipaddress

from vrnic.errors import Conflict, InvalidArgument

# fd00::/8 is a unique-local range; guests never see a routable physical GID.
_PREFIX = 0xFD76_726E  # "fd" + "vrn"


@functools.lru_cache(maxsize=4096)
def gid_text(packed: bytes) -> str:
    """A GID's text from its 16 bytes (a UD work request's destination). Remembered: the data path asks per
    work request, and ipaddress is tens of microseconds under TCG (issue 14)."""
    return str(ipaddress.IPv6Address(packed))


@functools.lru_cache(maxsize=4096)
def ipv4_mapped(gid: str) -> str | None:
    """The IPv4 address an IPv4-mapped GID (::ffff:a.b.c.d, RoCE v2 over IPv4) carries, else None."""
    mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    return None if mapped is None else str(mapped)


def make_virtual_gid(vpc_id: int, serial: int) -> str:
    """The virtual GID of the serial-th vRNIC of VPC vpc_id: fd76:726e:<vpc>::<serial>."""
    if not 0 <= vpc_id < 1 << 32 or not 0 < serial < 1 << 64:
        raise InvalidArgument(f"vpc_id must be 0..2^32-1 and serial 1..2^64-1 (got {vpc_id}, {serial})")
    value = (_PREFIX << 96) | (vpc_id << 64) | serial
    return str(ipaddress.IPv6Address(value))


def parse_virtual_gid(gid: str) -> tuple[int, int]:
    """(vpc_id, serial) of a virtual GID; InvalidArgument if it is not one."""
    try:
        address = ipaddress.IPv6Address(gid)
    except ValueError as exc:
        raise InvalidArgument(f"not a GID: {gid!r}") from exc
    if address.scope_id is not None:
        raise InvalidArgument(f"not a GID: {gid!r} (a GID has no scope)")
    value = int(address)
    # Serial 0 is never issued (make_virtual_gid refuses it), so it names no vRNIC.
    if value >> 96 != _PREFIX or not value & 0xFFFF_FFFF_FFFF_FFFF:
        raise InvalidArgument(f"not a virtual GID: {gid}")
    return (value >> 64) & 0xFFFF_FFFF, value & 0xFFFF_FFFF_FFFF_FFFF


# -- virtual IPs: each vRNIC has one in its tenant's VPC CIDR (what rdma_cm-style resolve() looks up) ---------

DEFAULT_VPC_CIDR = "10.0.0.0/16"

@functools.lru_cache(maxsize=4096)
def vpc_network(cidr: str) -> ipaddress.IPv4Network:
    """A tenant's VPC range: IPv4, strict (no host bits), with room for at least two vRNICs. Remembered per
    cidr: every allocation asks, and parsing it was a twentieth of an allocation's CPU (issue 14)."""
    try:
        network = ipaddress.IPv4Network(cidr, strict=True)
    except ValueError as exc:
        raise InvalidArgument(f"not an IPv4 network: {cidr!r} ({exc})") from exc
    if network.prefixlen > 30:
        raise InvalidArgument(f"VPC {cidr} is too small: /30 at most")
    return network


def check_virtual_ip(cidr: str, ip: str) -> str:
    """ip in its canonical form if a vRNIC may have it in VPC cidr: inside it, not its network or broadcast."""
    network = vpc_network(cidr)
    try:
        address = ipaddress.IPv4Address(ip)
    except ValueError as exc:
        raise InvalidArgument(f"not an IPv4 address: {ip!r}") from exc
    if address not in network:
        raise InvalidArgument(f"virtual IP {ip} is outside the VPC's {cidr}")
    if address in (network.network_address, network.broadcast_address):
        raise InvalidArgument(f"virtual IP {ip} is the network or broadcast address of {cidr}")
    return str(address)


def next_virtual_ip(cidr: str, after: str | None) -> str | None:
    """The host address after `after` in cidr (the first one when None); None past the last."""
    network = vpc_network(cidr)
    first, last = int(network.network_address) + 1, int(network.broadcast_address) - 1
    candidate = first if after is None else int(ipaddress.IPv4Address(after)) + 1
    return str(ipaddress.IPv4Address(candidate)) if first <= candidate <= last else None


def first_free_virtual_ip(cidr: str, taken: set[str]) -> str:
    """The lowest host address of cidr that is not taken; Conflict when the VPC has none left."""
    network = vpc_network(cidr)
    for address in network.hosts():
        if str(address) not in taken:
            return str(address)
    raise Conflict(f"no free virtual IP left in the VPC {cidr}", current_state="full")
