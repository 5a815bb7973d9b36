"""Reading VF settings back through iproute2, independently of vrnic's own netlink parser."""

from __future__ import annotations

import json
import subprocess
from typing import Any

CLEAN = {"mac": "00:00:00:00:00:00", "vlan": 0, "qos": 0, "max": 0, "min": 0, "spoofchk": True, "trust": False,
         "state": "auto"}


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def vf_settings(pf: str) -> dict[int, dict[str, Any]]:
    """The PF's VFs as `ip -j -d link show` reports them: {index: {mac, vlan, qos, max, min, ...}}."""
    link = json.loads(sh("ip", "-j", "-d", "link", "show", pf))[0]
    vfs = {}
    for vf in link.get("vfinfo_list", []):
        vlan = (vf.get("vlan_list") or [{}])[0]
        vfs[vf["vf"]] = {"mac": vf["address"], "vlan": vlan.get("vlan", 0), "qos": vlan.get("qos", 0),
                         "max": vf["rate"]["max_tx"], "min": vf["rate"]["min_tx"], "spoofchk": vf["spoofchk"],
                         "trust": vf["trust"], "state": vf["link_state"]}
    return vfs
