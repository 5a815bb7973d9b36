"""The lab command of the two-hosts rig: both guests run it; a runs CMD, b serves a until a says done.

    vrnic lab run --topology two-hosts -- python -m vrnic.lab.two_hosts [--smoke] -- CMD...

--smoke first runs the native RDMA WRITE smoke across the link (vrnic.lab.smoke --two-hosts) on both.
CMD on a gets VRNIC_LAB_CONTROL=<b's address>:<port>; its exit code is a's, and b exits with the same code.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from vrnic.errors import LabError, VrnicError
from vrnic.lab.two_hosts.control import CONTROL_PORT, ControlClient, serve


def _smoke() -> int:
    from vrnic.lab.smoke import two_hosts_write

    started = time.monotonic()
    try:
        print(f"{two_hosts_write()} [smoke {time.monotonic() - started:.1f} s]", flush=True)
    except (VrnicError, OSError) as exc:
        print(f"smoke failed: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def _tell_b_done(peer: str, rc: int) -> None:
    try:
        client = ControlClient.connect(peer, CONTROL_PORT, wait_s=60)
        client.call("done", rc=rc)
        client.close()
    except (LabError, OSError) as exc:
        print(f"a: could not tell host b we are done: {exc}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the native RDMA WRITE smoke first")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    role, local, peer = (os.environ.get(k, "") for k in ("VRNIC_LAB_ROLE", "VRNIC_LAB_LOCAL_ADDR",
                                                          "VRNIC_LAB_PEER_ADDR"))
    if os.environ.get("VRNIC_LAB_TOPOLOGY") != "two-hosts" or role not in ("a", "b"):
        print("run inside `vrnic lab run --topology two-hosts`", file=sys.stderr)
        return 2
    rc = _smoke() if args.smoke else 0
    if role == "b":
        return rc or serve(local)
    if rc == 0 and command:
        started = time.monotonic()
        rc = subprocess.run(command, env={**os.environ, "VRNIC_LAB_CONTROL": f"{peer}:{CONTROL_PORT}"},
                            check=False).returncode
        print(f"a: {' '.join(command)} exited {rc} after {time.monotonic() - started:.1f} s", flush=True)
    _tell_b_done(peer, rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
