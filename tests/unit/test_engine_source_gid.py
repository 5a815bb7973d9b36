"""The sender's GID the engine reads from a UD receive's GRH (vrnic.backend.engine.source_gid)."""

from __future__ import annotations

import ipaddress

from vrnic.backend.engine import source_gid


def test_roce_v2_over_ipv4_gives_the_ipv4_mapped_gid_from_the_ip_header() -> None:
    grh = bytes(20) + bytes(12) + ipaddress.IPv4Address("10.0.0.7").packed + bytes(4)  # IPv4 header in bytes 20-39
    assert source_gid(grh) == "::ffff:10.0.0.7"
    assert source_gid(memoryview(bytearray(grh))) == "::ffff:10.0.0.7"  # as the engine reads it from a ring


def test_an_ipv6_grh_gives_its_source_gid() -> None:
    grh = bytes([0x60]) + bytes(7) + ipaddress.IPv6Address("fd76:726e:0:1::2").packed + bytes(16)
    assert source_gid(grh) == "fd76:726e:0:1::2"
    assert source_gid(memoryview(bytearray(grh))) == "fd76:726e:0:1::2"
