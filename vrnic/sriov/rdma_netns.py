"""RDMA devices and network namespaces, through iproute2's `rdma` tool (pyroute2 has no RDMA netlink).

An RDMA device can only move into a container's namespace when the RDMA subsystem is in exclusive netns
mode (`rdma system set netns exclusive`, which the kernel only allows while no other network namespace
exists) and its driver supports it (rxe does not: EOPNOTSUPP).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

from vrnic.errors import DeviceError, NotFound, NotSupported


def _rdma(*args: str, json_output: bool = True) -> Any:
    if shutil.which("rdma") is None:
        raise NotSupported("iproute2's rdma tool is not installed")
    argv = ["rdma", *(["-j"] if json_output else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        if "not supported" in message.lower():
            raise NotSupported(f"rdma {' '.join(args)}: {message}")
        if "no such" in message.lower() or "not found" in message.lower():
            raise NotFound(f"rdma {' '.join(args)}: {message}")
        raise DeviceError(f"rdma {' '.join(args)}: {message}")
    if not json_output:
        return result.stdout
    return json.loads(result.stdout) if result.stdout.strip() else None


def parse_netns_mode(text: str) -> str:
    """`rdma system show` prints 'netns shared copy-on-fork on' (iproute2 6.1 has no JSON for it)."""
    match = re.search(r"\bnetns\s+(\w+)", text)
    if not match:
        raise DeviceError(f"cannot read the RDMA netns mode from {text!r}")
    return match.group(1)


def netns_mode() -> str:
    """'shared' or 'exclusive'."""
    return parse_netns_mode(_rdma("system", "show", json_output=False))


def set_netns_mode(mode: str) -> None:
    _rdma("system", "set", "netns", mode, json_output=False)


def move_device(device: str, netns: str) -> None:
    """Move an RDMA device into a named netns; NotSupported with the reason when that cannot work."""
    mode = netns_mode()
    if mode != "exclusive":
        raise NotSupported(f"cannot move RDMA device {device} into netns {netns}: the RDMA subsystem is in "
                           f"{mode} netns mode (needs `rdma system set netns exclusive`)")
    _rdma("dev", "set", device, "netns", netns, json_output=False)


HOST_NETNS_NAME = "vrnic-host"


def return_device(device: str, netns: str) -> None:
    """Move an RDMA device from a named netns back to the host's (init) namespace.

    `rdma dev set` needs a target name, so the host namespace gets one (`ip netns attach vrnic-host 1`).
    The kernel also returns every RDMA device to init_net when its namespace is destroyed.
    """
    if shutil.which("ip") is None:
        raise NotSupported("iproute2's ip tool is not installed")
    attach = subprocess.run(["ip", "netns", "attach", HOST_NETNS_NAME, "1"], capture_output=True, text=True,
                            check=False)
    if attach.returncode != 0 and "exists" not in attach.stderr.lower():
        raise DeviceError(f"naming the host netns: {attach.stderr.strip()}")
    result = subprocess.run(["ip", "netns", "exec", netns, "rdma", "dev", "set", device, "netns", HOST_NETNS_NAME],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DeviceError(f"returning RDMA device {device} from netns {netns}: {result.stderr.strip()}")
