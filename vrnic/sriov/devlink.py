"""The devlink edge (pyroute2 generic netlink): a device's eswitch mode. Missing devlink support is not an
error for discovery: the mode is then unknown (None)."""

from __future__ import annotations

from typing import Any

from vrnic.sriov.vf_types import PfKind

ESWITCH_MODES = {0: "legacy", 1: "switchdev"}


def eswitch_mode(kind: PfKind, bus_id: str) -> str | None:
    try:
        from pyroute2 import DL, NetlinkError
        from pyroute2.netlink import NLM_F_REQUEST
        from pyroute2.netlink.devlink import DEVLINK_NAMES, devlinkcmd
    except ImportError:  # pragma: no cover - pyroute2 is a dependency
        return None
    try:
        with DL() as dl:
            msg = devlinkcmd()
            msg["cmd"] = DEVLINK_NAMES["DEVLINK_CMD_ESWITCH_GET"]
            msg["version"] = 1
            msg["attrs"] = [("DEVLINK_ATTR_BUS_NAME", str(kind)), ("DEVLINK_ATTR_DEV_NAME", bus_id)]
            replies: Any = dl.nlm_request(msg, msg_type=dl.prid, msg_flags=NLM_F_REQUEST)
    except (NetlinkError, OSError):  # no devlink instance for this device, or no eswitch
        return None
    for reply in replies:
        mode = reply.get_attr("DEVLINK_ATTR_ESWITCH_MODE")
        if mode is not None:
            return ESWITCH_MODES.get(int(mode), str(mode))
    return None
