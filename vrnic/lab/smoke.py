"""The lab smoke workload: a real RDMA WRITE between two RC QPs, verified byte for byte.

    python -m vrnic.lab.smoke                 # rxe0 -> rxe1 in one guest (topology pair)
    python -m vrnic.lab.smoke --two-hosts     # guest b writes into guest a (topology two-hosts)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import pyverbs.enums as e

from vrnic.errors import DeviceError, VrnicError
from vrnic.lab.native import EndpointInfo, RcEndpoint

EXCHANGE_PORT = 18515


@dataclass(frozen=True)
class SmokeResult:
    source: str
    target: str
    length: int
    seconds: float
    digest: str

    def describe(self) -> str:
        return (f"RDMA WRITE of {self.length} bytes {self.source} -> {self.target} verified "
                f"(sha256 {self.digest[:16]}, {self.seconds * 1e6:.0f} us)")


def pattern(length: int, seed: int = 7) -> bytes:
    return bytes((seed + i * 31) % 251 for i in range(length))


def local_write(source: str = "rxe0", target: str = "rxe1", length: int = 4096) -> SmokeResult:
    with RcEndpoint(source, length) as a, RcEndpoint(target, length) as b:
        a.connect(b.info())
        b.connect(a.info())
        payload = pattern(length)
        a.mr.write(payload, length, 0)
        b.mr.write(bytes(length), length, 0)
        started = time.perf_counter()
        a.post_rdma(e.IBV_WR_RDMA_WRITE, b.info(), length)
        a.poll()
        seconds = time.perf_counter() - started
        landed = b.mr.read(length, 0)
        if landed != payload:
            raise DeviceError(f"RDMA WRITE completed but {target}'s buffer does not hold the payload")
        return SmokeResult(f"{source} qp {a.qp.qp_num}", f"{target} qp {b.qp.qp_num}", length, seconds,
                           hashlib.sha256(landed).hexdigest())


def _exchange(role: str, mine: EndpointInfo, local_addr: str, peer_addr: str) -> tuple[socket.socket, dict[str, Any]]:
    """A tiny TCP side channel for QP info, as perftest does; a serves, b dials with retries."""
    if role == "a":
        server = socket.create_server((local_addr, EXCHANGE_PORT))
        server.settimeout(120)
        conn, _ = server.accept()
        server.close()
    else:
        deadline = time.monotonic() + 120
        while True:
            try:
                conn = socket.create_connection((peer_addr, EXCHANGE_PORT), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    stream = conn.makefile("rw")
    stream.write(json.dumps(mine.to_dict()) + "\n")
    stream.flush()
    return conn, json.loads(stream.readline())


def two_hosts_write(length: int = 65536) -> str:
    role = os.environ["VRNIC_LAB_ROLE"]
    with RcEndpoint("rxe0", length) as ep:
        conn, peer = _exchange(role, ep.info(), os.environ["VRNIC_LAB_LOCAL_ADDR"],
                               os.environ["VRNIC_LAB_PEER_ADDR"])
        remote = EndpointInfo(**peer)
        ep.connect(remote)
        stream = conn.makefile("rw")
        payload = pattern(length, seed=11)
        if role == "b":
            ep.mr.write(payload, length, 0)
            started = time.perf_counter()
            ep.post_rdma(e.IBV_WR_RDMA_WRITE, remote, length)
            ep.poll(timeout=30)
            seconds = time.perf_counter() - started
            stream.write("written\n")
            stream.flush()
            verdict = stream.readline().strip()
            if verdict != "ok":
                raise DeviceError(f"peer a reports: {verdict}")
            return f"b: RDMA WRITE of {length} bytes into guest a verified by a ({seconds * 1e3:.1f} ms)"
        if stream.readline().strip() != "written":
            raise DeviceError("peer b went away before writing")
        landed = ep.mr.read(length, 0)
        stream.write(("ok" if landed == payload else "mismatch") + "\n")
        stream.flush()
        if landed != payload:
            raise DeviceError("guest b's RDMA WRITE did not land intact in guest a's buffer")
        return f"a: received {length} bytes by RDMA WRITE from {peer['gid']} qp {peer['qpn']}, bytes verified"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--two-hosts", action="store_true")
    parser.add_argument("--source", default="rxe0")
    parser.add_argument("--target", default="rxe1")
    args = parser.parse_args(argv)
    try:
        print(two_hosts_write() if args.two_hosts else local_write(args.source, args.target).describe())
    except (VrnicError, OSError) as exc:
        print(f"smoke failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
