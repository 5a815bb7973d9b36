"""Virtual GIDs (vrnic.core.vaddr)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vrnic.core.vaddr import (
    check_virtual_ip,
    first_free_virtual_ip,
    gid_text,
    ipv4_mapped,
    make_virtual_gid,
    next_virtual_ip,
    parse_virtual_gid,
    vpc_network,
)
from vrnic.errors import Conflict, InvalidArgument


def test_layout_is_fd76_726e_vpc_serial() -> None:
    assert make_virtual_gid(0, 1) == "fd76:726e::1"
    assert make_virtual_gid(1, 2) == "fd76:726e:0:1::2"
    assert make_virtual_gid(0xFFFF_FFFF, (1 << 64) - 1) == "fd76:726e:ffff:ffff:ffff:ffff:ffff:ffff"


@given(st.binary(min_size=16, max_size=16))
def test_gid_text_is_ipaddress_text_of_the_16_bytes(packed: bytes) -> None:
    assert gid_text(packed) == str(ipaddress.IPv6Address(packed))


def test_ipv4_mapped_gives_the_ipv4_address_of_a_roce_v2_gid_only() -> None:
    assert ipv4_mapped("::ffff:10.0.0.7") == "10.0.0.7"
    assert ipv4_mapped("::ffff:a00:8") == "10.0.0.8"
    assert ipv4_mapped("fe80::1") is None
    assert ipv4_mapped(make_virtual_gid(1, 2)) is None
    with pytest.raises(ValueError):
        ipv4_mapped("not a gid")


def test_virtual_gids_are_unique_local() -> None:
    address = ipaddress.IPv6Address(make_virtual_gid(7, 9))
    assert address.is_private
    assert address in ipaddress.IPv6Network("fd00::/8")


@settings(deadline=None)
@given(vpc=st.integers(0, (1 << 32) - 1), serial=st.integers(1, (1 << 64) - 1))
def test_round_trip(vpc: int, serial: int) -> None:
    assert parse_virtual_gid(make_virtual_gid(vpc, serial)) == (vpc, serial)


@settings(deadline=None)
@given(st.tuples(st.integers(0, (1 << 32) - 1), st.integers(1, (1 << 64) - 1)),
       st.tuples(st.integers(0, (1 << 32) - 1), st.integers(1, (1 << 64) - 1)))
def test_distinct_identities_give_distinct_gids(a: tuple[int, int], b: tuple[int, int]) -> None:
    assert (make_virtual_gid(*a) == make_virtual_gid(*b)) == (a == b)


def test_parse_accepts_any_spelling_of_the_address() -> None:
    assert parse_virtual_gid("FD76:726E:0000:0003:0000:0000:0000:0004") == (3, 4)


@pytest.mark.parametrize(("vpc", "serial"), [(-1, 1), (1 << 32, 1), (0, 0), (0, -1), (0, 1 << 64)])
def test_make_refuses_out_of_range(vpc: int, serial: int) -> None:
    with pytest.raises(InvalidArgument, match="vpc_id must be"):
        make_virtual_gid(vpc, serial)


@pytest.mark.parametrize("gid", [
    "fe80::1",  # link-local: a physical RoCE GID
    "::ffff:10.77.1.1",  # RoCE v2 IPv4-mapped
    "fd76:726f::1",  # one bit off the prefix
    "fd00::1",
    "::",
])
def test_parse_refuses_non_virtual_gids(gid: str) -> None:
    with pytest.raises(InvalidArgument, match="not a virtual GID"):
        parse_virtual_gid(gid)


@pytest.mark.parametrize("gid", ["", "not-a-gid", "10.77.1.1", "fd76:726e::1::2", "fd76:726e::g"])
def test_parse_refuses_non_gids(gid: str) -> None:
    with pytest.raises(InvalidArgument, match="not a GID"):
        parse_virtual_gid(gid)


@pytest.mark.parametrize("gid", ["fd76:726e::", "fd76:726e:0:5::"])
def test_parse_refuses_serial_zero_which_make_never_produces(gid: str) -> None:
    with pytest.raises(InvalidArgument, match="not a virtual GID"):
        parse_virtual_gid(gid)


def test_parse_refuses_a_scoped_address() -> None:
    with pytest.raises(InvalidArgument):
        parse_virtual_gid("fd76:726e::1%eth0")


# -- virtual IPs ------------------------------------------------------------------------------------

def test_the_first_virtual_ip_is_the_first_host_address_then_the_next() -> None:
    assert next_virtual_ip("10.0.0.0/16", None) == "10.0.0.1"
    assert next_virtual_ip("10.0.0.0/16", "10.0.0.255") == "10.0.1.0"  # a host address inside a /16
    assert next_virtual_ip("10.0.0.0/30", "10.0.0.2") is None  # .3 is the broadcast address
    assert next_virtual_ip("10.0.0.0/30", "10.0.0.9") is None  # after something outside: none


def test_first_free_skips_taken_and_runs_out() -> None:
    assert first_free_virtual_ip("192.168.5.0/29", {"192.168.5.1", "192.168.5.3"}) == "192.168.5.2"
    with pytest.raises(Conflict, match=r"no free virtual IP left in the VPC 192\.168\.5\.0/30"):
        first_free_virtual_ip("192.168.5.0/30", {"192.168.5.1", "192.168.5.2"})


@pytest.mark.parametrize(("ip", "why"), [
    ("10.1.0.1", "outside the VPC's 10.0.0.0/16"),
    ("10.0.0.0", "network or broadcast"),
    ("10.0.255.255", "network or broadcast"),
    ("10.0.0.300", "not an IPv4 address"),
    ("fd00::1", "not an IPv4 address"),
])
def test_a_requested_virtual_ip_is_checked(ip: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        check_virtual_ip("10.0.0.0/16", ip)


def test_a_requested_virtual_ip_comes_back_canonical() -> None:
    assert check_virtual_ip("10.0.0.0/16", "10.0.3.7") == "10.0.3.7"


@pytest.mark.parametrize(("cidr", "why"), [("10.0.0.1/16", "host bits set"), ("10.0.0.0/31", "too small"),
                                           ("fd00::/64", "not an IPv4 network"), ("nonsense", "not an IPv4")])
def test_vpc_ranges_are_checked(cidr: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        vpc_network(cidr)


@settings(deadline=None)
@given(taken=st.sets(st.integers(1, 14)))
def test_first_free_is_the_lowest_host_address_not_taken(taken: set[int]) -> None:
    addresses = {f"172.16.0.{i}" for i in taken}
    free = [i for i in range(1, 15) if i not in taken]
    if not free:
        with pytest.raises(Conflict):
            first_free_virtual_ip("172.16.0.0/28", addresses)
    else:
        assert first_free_virtual_ip("172.16.0.0/28", addresses) == f"172.16.0.{free[0]}"
