"""Virtual GIDs: the identities guests use, independent of the physical device they run on."""

from __future__ import annotations

import ipaddress

from vrnic.errors import InvalidArgument

# fd00::/8 is a unique-local range; guests never see a routable physical GID.
_PREFIX = 0xFD76_726E  # "fd" + "vrn"


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
