"""Across two lab hosts (topology two-hosts): connect and 64-byte SEND latency through two vrnic agents against
native pyverbs between the same two hosts, measured in the same run.

Runs on host a inside `vrnic lab run --topology two-hosts -- python -m vrnic.lab.two_hosts -- python -m
bench.multihost --out FILE` (bench/run.py does this): the rig (PostgreSQL on a, `vrnic daemon` on both), one
vRNIC per host for one tenant, and a follower process on b (vrnic.lab.two_hosts.crosshost) in lock step.

- multihost.native.connect_qp_pair: create an RC QP, exchange (gid, qpn) over TCP, INIT/RTR/RTS, on both hosts.
- multihost.connect_qp_pair: the same on vRNICs: virtual GID and QPN; each agent resolves the peer and programs
  the physical path (the remote one through the owner agent).
- multihost.native.send_lat_64b / multihost.send_lat_64b: half the round trip of a 64-byte SEND ping-pong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import Record, write
from vrnic.errors import VrnicError
from vrnic.lab.two_hosts.crosshost import PORT, Leader, NativeSide, VrnicSide
from vrnic.lab.two_hosts.rig import Rig

CONNECT_ROUNDS = 20
PING_PONGS = 100
PING_ROUNDS = 3


def run(out: Path, log: bool = True) -> int:
    records: list[Record] = []
    failed = ""
    with Rig.start(log=log) as rig:
        token = rig.make_tenant("bench")
        vrnics = {host: rig.allocate(host, token) for host in ("a", "b")}
        local = os.environ["VRNIC_LAB_LOCAL_ADDR"]
        follower = rig.control.call("spawn", argv=[
            sys.executable, "-m", "vrnic.lab.two_hosts.crosshost", "--leader", f"{local}:{PORT}",
            "--attach", json.dumps(vrnics["b"]["attach"])])
        leader = Leader(local)
        native, busy = NativeSide(), NativeSide(busy=True)
        try:
            connect = statistics.median(leader.connect_ms(native, "native", CONNECT_ROUNDS))
            latency = statistics.median(leader.ping_pong_us(native, "native", PING_PONGS, PING_ROUNDS))
            busy_latency = statistics.median(leader.ping_pong_us(busy, "native-busy", PING_PONGS, PING_ROUNDS))
            records += [Record("multihost.native.connect_qp_pair", "ms", connect),
                        Record("multihost.native.send_lat_64b", "us", latency),
                        Record("multihost.native.send_lat_64b_busy_poll", "us", busy_latency)]
            print(f"native across hosts: connect {connect:.2f} ms, SEND 64 B {latency:.0f} us "
                  f"({busy_latency:.0f} us busy-polling)", flush=True)
            side = VrnicSide(vrnics["a"]["attach"])
            try:
                v_connect = statistics.median(leader.connect_ms(side, "vrnic", CONNECT_ROUNDS))
                v_latency = statistics.median(leader.ping_pong_us(side, "vrnic", PING_PONGS, PING_ROUNDS))
                records += [Record("multihost.connect_qp_pair", "ms", v_connect, connect),
                            Record("multihost.send_lat_64b", "us", v_latency, latency)]
                print(f"vrnic across hosts: connect {v_connect:.2f} ms ({v_connect / connect:.2f}x native), "
                      f"SEND 64 B {v_latency:.0f} us ({v_latency / latency:.2f}x native)", flush=True)
            except (VrnicError, OSError) as exc:
                failed = f"the vrnic side failed: {exc}; {_diagnose(rig, side, vrnics)}"
            finally:
                side.close()
            with contextlib.suppress(OSError):
                leader.done()
        finally:
            native.close()
            busy.close()
            result = rig.control.call("wait", id=follower["id"], timeout=30)
            if result.get("running"):
                rig.control.call("signal", id=follower["id"], signal=9)
            elif result["rc"] != 0:
                failed = failed or f"the follower on b failed: {result['stderr'][-1500:]}"
    write(records, out)
    if failed:
        print(f"bench.multihost: {failed}", file=sys.stderr)
        return 1
    return 0


def _diagnose(rig: Rig, side: VrnicSide, vrnics: dict[str, dict[str, Any]]) -> str:
    """What the failure left behind: a's QP as vrnicd sees it and both vRNICs' counters."""
    found: dict[str, Any] = {}
    with contextlib.suppress(VrnicError, OSError):
        found["a_qp"] = side.qp.query() if side.qp is not None and not side.qp.closed else None
    with rig.client("a") as api:
        for host, vrnic in vrnics.items():
            found[f"counters_{host}"] = api.get(f"/vrnics/{vrnic['id']}/counters").json()
    return json.dumps(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "multihost.json")
    args = parser.parse_args()
    started = time.monotonic()
    try:
        rc = run(args.out)
    except (VrnicError, OSError) as exc:
        print(f"bench.multihost failed: {exc}", file=sys.stderr)
        return 1
    print(f"bench.multihost: wrote {args.out} after {time.monotonic() - started:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
