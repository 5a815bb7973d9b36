"""The pure halves of the netlink and rdma edges: decoding, errno translation, the requests sent."""

from __future__ import annotations

import errno
from typing import Any

import pytest
from pyroute2 import NetlinkError

from vrnic.errors import Conflict, DeviceError, NotFound, NotSupported
from vrnic.sriov.netlink import VfNetlink, parse_vf_list, translate
from vrnic.sriov.plan import plan_ops
from vrnic.sriov.rdma_netns import parse_netns_mode
from vrnic.sriov.vf_types import LinkState, VfConfig


class Attrs:
    """Just enough of a decoded pyroute2 nla: get_attr / get_attrs."""

    def __init__(self, **attrs: Any) -> None:
        self.attrs = attrs

    def get_attr(self, name: str) -> Any:
        return self.attrs.get(name)

    def get_attrs(self, name: str) -> list[Any]:
        value = self.attrs.get(name)
        return value if isinstance(value, list) else []


def vf_info(index: int, mac: str, vlan: int, qos: int, rate: tuple[int, int], spoof: int, trust: int,
            state: int) -> Attrs:
    return Attrs(IFLA_VF_MAC={"vf": index, "mac": mac}, IFLA_VF_VLAN={"vf": index, "vlan": vlan, "qos": qos},
                 IFLA_VF_RATE={"vf": index, "max_tx_rate": rate[0], "min_tx_rate": rate[1]},
                 IFLA_VF_SPOOFCHK={"vf": index, "spoofchk": spoof}, IFLA_VF_TRUST={"vf": index, "trust": trust},
                 IFLA_VF_LINK_STATE={"vf": index, "link_state": state})


def test_parse_vf_list() -> None:
    decoded = Attrs(IFLA_VF_INFO=[vf_info(0, "00:00:00:00:00:00", 0, 0, (0, 0), 0, 0, 0),
                                  vf_info(1, "02:AA:00:00:00:01", 100, 3, (1000, 100), 1, 0, 1),
                                  vf_info(2, "02:aa:00:00:00:02", 0, 0, (0, 0), 0xFFFFFFFF, 0xFFFFFFFF, 2)])
    vfs = parse_vf_list(decoded)
    assert vfs[0] == VfConfig(spoofchk=False)
    assert vfs[1] == VfConfig(mac="02:aa:00:00:00:01", vlan=100, qos=3, max_tx_rate=1000, min_tx_rate=100,
                              spoofchk=True, trust=False, link_state=LinkState.ENABLE)
    assert (vfs[2].spoofchk, vfs[2].trust, vfs[2].link_state) == (False, False, LinkState.DISABLE)
    assert parse_vf_list(None) == {}


@pytest.mark.parametrize(("code", "kind"), [
    (errno.ENODEV, NotFound), (errno.EOPNOTSUPP, NotSupported), (errno.EEXIST, Conflict),
    (errno.EINVAL, DeviceError), (errno.EPERM, DeviceError)])
def test_translate(code: int, kind: type[Exception]) -> None:
    error = translate(NetlinkError(code), "setting vf 1")
    assert isinstance(error, kind) and str(error).startswith("setting vf 1")
    if isinstance(error, DeviceError):
        assert error.errno == code


class RecordingSocket:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_on = fail_on

    def link_lookup(self, **kwarg: Any) -> list[int]:
        return [7] if kwarg.get("ifname") == "eth0" else []

    def link(self, command: str, **kwarg: Any) -> Any:
        self.calls.append((command, kwarg))
        if self.fail_on and self.fail_on in kwarg.get("vf", {}):
            raise NetlinkError(errno.EINVAL)
        return []

    def close(self) -> None:
        pass


def test_apply_sends_one_request_per_op_and_names_the_refused_one() -> None:
    socket = RecordingSocket()
    config = VfConfig(mac="02:00:00:00:00:01", vlan=10, max_tx_rate=100)
    VfNetlink(socket).apply("eth0", 3, plan_ops(config))
    assert socket.calls[0] == ("set", {"index": 7, "vf": {"vf": 3, "mac": "02:00:00:00:00:01"}})
    assert [c[1]["vf"] for c in socket.calls][1:3] == [{"vf": 3, "vlan": {"vlan": 10, "qos": 0}},
                                                        {"vf": 3, "rate": {"max_tx_rate": 100, "min_tx_rate": 0}}]
    with pytest.raises(DeviceError, match="eth0/vf3: setting rate max_tx_rate=100 min_tx_rate=0: the kernel"):
        VfNetlink(RecordingSocket(fail_on="rate")).apply("eth0", 3, plan_ops(config))
    with pytest.raises(NotFound, match="no network interface eth9"):
        VfNetlink(socket).apply("eth9", 0, plan_ops(config))


def test_parse_netns_mode() -> None:
    assert parse_netns_mode("netns shared copy-on-fork on\n") == "shared"
    assert parse_netns_mode("netns exclusive copy-on-fork on") == "exclusive"
    with pytest.raises(DeviceError):
        parse_netns_mode("garbage")
