"""Virtual GIDs (vrnic.core.vaddr)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vrnic.core.vaddr import make_virtual_gid, parse_virtual_gid
from vrnic.errors import InvalidArgument


def test_layout_is_fd76_726e_vpc_serial() -> None:
    assert make_virtual_gid(0, 1) == "fd76:726e::1"
    assert make_virtual_gid(1, 2) == "fd76:726e:0:1::2"
    assert make_virtual_gid(0xFFFF_FFFF, (1 << 64) - 1) == "fd76:726e:ffff:ffff:ffff:ffff:ffff:ffff"


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
