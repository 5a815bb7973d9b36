"""Which device port a paravirtual vRNIC can use: ACTIVE, with a RoCE v2 IPv4 GID (routable between hosts)."""

from __future__ import annotations

import pytest

from vrnic.core.specs import DeviceInfo, GidEntry, PortInfo, active_roce_v2_gid, roce_v2_ipv4_gid
from vrnic.errors import DeviceError, NotFound

GIDS = [GidEntry(index=0, gid="fe80::1", type="RoCE v2"), GidEntry(index=1, gid="::ffff:10.0.0.1", type="RoCE v1"),
        GidEntry(index=2, gid="::ffff:10.0.0.1", type="RoCE v2")]


def device(state: str, gids: list[GidEntry]) -> DeviceInfo:
    return DeviceInfo(name="rxe9", driver="verbs", node_guid="0", ports=[PortInfo(port=1, state=state, mtu=1024,
                                                                                    gids=gids)])


def test_the_routable_gid_is_the_ipv4_mapped_roce_v2_one() -> None:
    assert roce_v2_ipv4_gid(device("ACTIVE", GIDS)) == (2, "::ffff:10.0.0.1")
    assert active_roce_v2_gid(device("ACTIVE", GIDS)) == (2, "::ffff:10.0.0.1")


def test_a_port_that_is_down_or_has_no_address_is_not_usable() -> None:
    with pytest.raises(DeviceError, match="rxe9 port 1 is not ACTIVE"):
        active_roce_v2_gid(device("DOWN", GIDS))
    with pytest.raises(NotFound, match="no RoCE v2 IPv4 GID"):
        active_roce_v2_gid(device("ACTIVE", GIDS[:2]))
    with pytest.raises(DeviceError):
        active_roce_v2_gid(device("ACTIVE", GIDS), port=2)
