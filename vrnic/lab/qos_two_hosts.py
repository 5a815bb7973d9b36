"""QoS across the lab's two hosts: streaming programs on vRNICs of either host, driven line by line from host a.

    python -m vrnic.lab.qos_two_hosts       # reads JSON commands on stdin, answers one JSON line each

The program is a container guest on one vRNIC of its host's agent with one RC QP and a 64 KiB MR. Commands:
attach {attach} -> gid; qp -> qpn, addr, rkey; connect {gid, qpn, addr, rkey} (by the peer's virtual GID and
QPN: the agents resolve the physical path across hosts; addr and rkey are the peer's MR, the target of the
WRITEs); stream {seconds} -> mbps (64 KiB RDMA WRITEs, IN_FLIGHT at once, goodput in MB/s); query -> the QP as
vrnicd reports it (query_qp: the physical QP's state and RC timeout); quit.

Host a's side (bench.qos_two_hosts, tests/two_hosts/test_qos.py): Pair connects a streamer on one host to a
peer on the other; wire_rates() reads each streamer's class byte counter through the REST API while all stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vrnic.core.specs import AttachInfo
from vrnic.errors import LabError, VrnicError
from vrnic.lab.two_hosts.guest import serve_lines

WRITE = 64 * 1024
IN_FLIGHT = 4  # 256 KiB: more than the 64 packets rxe keeps in flight per QP, so its qdisc queue never runs dry


class StreamProgram:
    def __init__(self) -> None:
        self.qp: Any = None
        self.peer: tuple[int, int] | None = None

    def do_attach(self, attach: dict[str, Any]) -> dict[str, Any]:
        from vrnic.frontend import CQ, MR, PD, Access, Context

        self.ctx = Context.attach(AttachInfo(**attach), 1 << 20)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64)
        self.mr = MR(self.pd, WRITE, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        return {"gid": self.ctx.gid}

    def do_qp(self) -> dict[str, Any]:
        """A new RC QP (the previous one, say in the error state after a failed stream, is closed)."""
        from vrnic.frontend import CQ, QP

        if self.qp is not None:
            self.qp.close()
            self.peer = None
            self.cq = CQ(self.ctx, 64)  # none of the old QP's flushed completions
        self.qp = QP(self.pd, self.cq, self.cq)
        return {"qpn": self.qp.qpn, "addr": self.mr.addr, "rkey": self.mr.rkey}

    def do_connect(self, gid: str, qpn: int, addr: int, rkey: int) -> dict[str, Any]:
        self.qp.connect(gid, qpn)
        self.peer = (addr, rkey)
        return {}

    def do_query(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.qp.query()
        return answer

    def do_stream(self, seconds: float) -> dict[str, Any]:
        from vrnic.frontend import SendRequest, WrOpcode

        if self.peer is None:
            raise LabError("not connected")
        addr, rkey = self.peer
        sge = self.mr.sge(0, WRITE)
        posted = done = 0
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            while posted - done < IN_FLIGHT:
                self.qp.post_send(SendRequest(posted, WrOpcode.RDMA_WRITE, (sge,), remote_addr=addr, rkey=rkey))
                posted += 1
            for completion in self.cq.wait(1, timeout=30):
                if completion.status != 0:
                    raise LabError(f"an RDMA WRITE completed with status {completion.status}")
                done += 1
        while done < posted:
            done += len(self.cq.wait(1, timeout=30))
        return {"mbps": done * WRITE / (time.monotonic() - start) / 1e6, "writes": done}

    def serve(self, stdin: Any, stdout: Any) -> int:
        return serve_lines(self, stdin, stdout, (VrnicError, OSError))


def program_argv() -> list[str]:
    return [sys.executable, "-m", "vrnic.lab.qos_two_hosts"]


class Program:
    """The stream program on host a (a child with pipes) or on host b (through b's control server)."""

    def __init__(self, control: Any = None) -> None:
        self.control = control
        self.process: subprocess.Popen[str] | None = None
        self.id: int | None = None
        if control is None:
            self.process = subprocess.Popen(program_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True, start_new_session=True)
        else:
            self.id = int(control.call("spawn", argv=program_argv(), stdin=True)["id"])

    def send(self, op: str, **args: Any) -> None:
        text = json.dumps({"op": op, **args}) + "\n"
        if self.control is not None:
            self.control.call("write", id=self.id, text=text)
            return
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(text)
        self.process.stdin.flush()

    def reply(self, timeout: float = 120.0) -> dict[str, Any]:
        if self.control is not None:
            got = self.control.call("readline", id=self.id, timeout=timeout)
            line = got["line"]
            if line is None:
                raise LabError(f"the stream program on b ended or timed out: {got.get('stderr', '')[-1500:]}")
        else:
            assert self.process is not None and self.process.stdout is not None
            line = self.process.stdout.readline()
            if not line:
                raise LabError(f"the stream program on a ended (exit {self.process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise LabError(f"stream program: {answer}")
        return answer

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def close(self) -> None:
        if self.control is not None and self.id is not None:
            self.control.call("signal", id=self.id, signal=int(signal.SIGKILL))
            self.control.call("wait", id=self.id, timeout=10)
            self.id = None
        elif self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class Pair:
    """A streamer on one host writing to a peer on the other, each on its own vRNIC, connected by virtual GID
    and QPN (the agents resolve the physical GID and QPN across hosts)."""

    vrnic: dict[str, Any]  # the streamer's VrnicOut
    peer_vrnic: dict[str, Any]
    streamer: Program
    peer: Program

    @classmethod
    def connect(cls, vrnic: dict[str, Any], peer_vrnic: dict[str, Any], streamer: Program,
                peer: Program) -> Pair:
        streamer.send("attach", attach=vrnic["attach"])
        peer.send("attach", attach=peer_vrnic["attach"])
        streamer.reply()
        peer.reply()
        pair = cls(vrnic, peer_vrnic, streamer, peer)
        pair.reconnect()
        return pair

    def reconnect(self) -> None:
        """A new QP on each end, connected by virtual GID and QPN."""
        ends = self.streamer.call("qp"), self.peer.call("qp")
        self.peer.call("connect", gid=self.vrnic["virtual_gid"], qpn=ends[0]["qpn"], addr=ends[0]["addr"],
                       rkey=ends[0]["rkey"])
        self.streamer.call("connect", gid=self.peer_vrnic["virtual_gid"], qpn=ends[1]["qpn"],
                           addr=ends[1]["addr"], rkey=ends[1]["rkey"])

    def close(self) -> None:
        self.streamer.close()
        self.peer.close()


def tx_bytes(api: httpx.Client, vrnic_id: str) -> int:
    """The vRNIC's class byte counter as its agent reports it (GET /vrnics/{id}/counters)."""
    got = api.get(f"/vrnics/{vrnic_id}/counters")
    if got.status_code != 200:
        raise LabError(f"counters of {vrnic_id}: {got.status_code} {got.text}")
    body = got.json()
    if not body["shaped"]:
        raise LabError(f"vRNIC {vrnic_id} has no QoS class to count its bytes: {body}")
    return int(body["tx_bytes"])


_CLASS = re.compile(r"class htb ([0-9a-f]+:[0-9a-f]+) (parent|root)[^\n]*\n\s*Sent (\d+) bytes")


def class_bytes(netdev: str = "eth0") -> tuple[dict[str, int], float]:
    """Bytes sent by each leaf HTB class on this host's netdev (`tc -s class show`), and when they were read.

    Read with iproute2 in this process rather than through the agent's API while streams run: under
    emulation an API request takes the agent (which also runs vrnicd's data path) long enough to disturb the
    rates it would measure, and its timing is too coarse for a window of seconds."""
    before = time.monotonic()
    out = subprocess.run(["tc", "-s", "class", "show", "dev", netdev], capture_output=True, text=True,
                         check=True).stdout
    after = time.monotonic()
    return {m[1]: int(m[3]) for m in _CLASS.finditer(out) if m[2] == "parent"}, (before + after) / 2


def rxe_counters() -> dict[str, int]:
    """This host's rxe counters (sysfs hw_counters), summed over its devices: completer_retry_err counts the
    retransmissions its requesters started (on a timeout or a NAK), rcvd_seq_err the sequence-error NAKs."""
    counted: dict[str, int] = {}
    for path in Path("/sys/class/infiniband").glob("*/ports/1/hw_counters/*"):
        with contextlib.suppress(OSError, ValueError):
            counted[path.name] = counted.get(path.name, 0) + int(path.read_text())
    return counted


def capped_rate_floor(cap_mbps: float, window_s: float, retransmissions: int, rc_timeout_s: float,
                      tolerance: float = 0.10) -> float:
    """The lowest rate (Mbit/s) a stream held at cap_mbps may show over a window in which its requester
    retransmitted `retransmissions` times: each may have stalled it for up to one RC timeout (QEMU's dgram
    link drops packets on a loaded machine, and rxe retransmits them by design), less the tolerance."""
    stalled_s = min(window_s, retransmissions * rc_timeout_s)
    return cap_mbps * (1 - tolerance) * (window_s - stalled_s) / window_s


def find_classes(api: httpx.Client, pairs: Mapping[str, Pair], seconds: float = 0.6) -> dict[str, str]:
    """Each streamer's HTB class on this host (name -> class id): each streams alone in turn, and its class is
    the one whose byte count grew meanwhile; at rest, the count the API reports for the vRNIC must be that
    class's. (Matching counts alone fails on a loaded machine, where streams of different lengths can all
    end after the same number of WRITEs.)"""
    found: dict[str, str] = {}
    for name, pair in pairs.items():
        before, _ = class_bytes()
        pair.streamer.call("stream", seconds=seconds)
        after, _ = class_bytes()
        grown = [c for c, n in after.items() if n > before.get(c, 0)]
        if len(grown) != 1:
            raise LabError(f"while {name} streamed alone, classes {grown} grew (of {after})")
        sent = tx_bytes(api, pair.vrnic["id"])
        if sent != after[grown[0]]:
            raise LabError(f"{name} sent {sent} bytes by the API, its class {grown[0]} {after[grown[0]]}")
        found[name] = grown[0]
    return found


def stream_together(pairs: Mapping[str, Pair], seconds: float, classes: Mapping[str, str] | None = None,
                    skip: float = 0.5) -> tuple[dict[str, float], dict[str, float]]:
    """Stream on every pair at once: goodput (MB/s, as each streamer counts it) and, for the names in classes,
    the rate on the wire (Mbit/s) from the class's byte counter over a window in which every stream runs
    (from skip s after the start to 0.5 s before the end)."""
    for pair in pairs.values():
        pair.streamer.send("stream", seconds=seconds)
    wire: dict[str, float] = {}
    if classes:
        time.sleep(skip)
        first, t0 = class_bytes()
        time.sleep(max(0.5, seconds - skip - 0.5))
        last, t1 = class_bytes()
        wire = {name: (last[c] - first[c]) * 8 / (t1 - t0) / 1e6 for name, c in classes.items()}
    goodput: dict[str, float] = {}
    failed: list[str] = []
    for name, pair in pairs.items():  # every answer is read, so that none is left for the next command
        try:
            goodput[name] = float(pair.streamer.reply(timeout=seconds + 120)["mbps"])
        except LabError as exc:
            failed.append(f"{name}: {exc}")
    if failed:
        raise LabError("; ".join(failed))
    return goodput, wire


def set_qos(api: httpx.Client, vrnic_id: str, **policy: Any) -> None:
    """PATCH the live vRNIC's QoS (its QPs stay connected)."""
    changed = api.patch(f"/vrnics/{vrnic_id}", json={"qos": policy})
    if changed.status_code != 200:
        raise LabError(f"PATCH qos of {vrnic_id} to {policy}: {changed.status_code} {changed.text}")


def tc_show(netdev: str = "eth0") -> str:
    """HTB classes (with counters) and filters on this host's uplink, as iproute2 reads them back."""
    out = []
    for argv in (["tc", "-s", "class", "show", "dev", netdev], ["tc", "filter", "show", "dev", netdev]):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        out.append(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}")
    return "\n".join(out)


def main() -> int:
    return StreamProgram().serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
