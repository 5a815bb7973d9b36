"""Cross-host RC connect and 64-byte SEND ping-pong, natively (pyverbs) and through vrnic agents, in lock step
with a peer process on the other host over a TCP side channel (as perftest and smoke.py exchange QP info).

Host a runs `Leader` (the bench, bench/multihost.py); host b runs `python -m vrnic.lab.two_hosts.crosshost
--leader ADDR:PORT` (started through b's control server), which follows the leader's commands:

- connect rounds: per round, a creates a QP and sends its (gid, qpn); b creates one, connects it, answers with
  its own; a connects. The time a measures (create + exchange + INIT/RTR/RTS on both sides) is the record.
- ping-pong: a SENDs 64 bytes, b answers with 64 bytes as soon as it receives; half the round trip.
- the vrnic side does the same with guest-library objects on vRNICs (virtual GID, virtual QPN): each agent
  resolves the peer and programs the physical path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from vrnic.errors import DeviceError, VrnicError

PORT = 18620
MSG = 64
SPINS, SLEEP_S = 20, 50e-6  # the non-busy native wait: like the guest library's CQ.wait


class Line:
    """JSON lines over a TCP connection."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.stream = sock, sock.makefile("rw")

    def send(self, message: dict[str, Any]) -> None:
        self.stream.write(json.dumps(message) + "\n")
        self.stream.flush()

    def recv(self) -> dict[str, Any]:
        line = self.stream.readline()
        if not line:
            raise DeviceError("the peer closed the side channel")
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise DeviceError(f"peer: {message['error']}")
        return message

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


class Side(Protocol):
    """One host's end: a device context with a PD, a CQ and a 4 KiB buffer; QPs made per round."""

    def new_qp(self) -> dict[str, Any]: ...  # gid and qpn a peer connects to
    def connect(self, peer: dict[str, Any]) -> None: ...
    def close_qp(self) -> None: ...
    def post_recv(self) -> None: ...
    def post_send(self) -> None: ...
    def wait_recv(self) -> None: ...  # until one RECV completed (SEND completions are counted aside)
    def close(self) -> None: ...


class NativeSide:
    """pyverbs on this host's rxe0. busy=False waits as the guest library's CQ.wait does: a few polls, then
    short sleeps. Under TCG that matters: a guest that spins keeps its vCPU thread on a host core that the
    other guest's QEMU needs to deliver the packets, so busy polling on both hosts can be slower."""

    def __init__(self, device: str = "rxe0", busy: bool = False) -> None:
        from vrnic.lab.native import RcEndpoint

        self.ep = RcEndpoint(device, 4096)
        self.busy = busy
        self._fresh = True  # RcEndpoint came with a QP: use it for the first round

    def new_qp(self) -> dict[str, Any]:
        import pyverbs.enums as e
        from pyverbs.qp import QP, QPCap, QPInitAttr

        if not self._fresh:
            cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
            self.ep.qp = QP(self.ep.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.ep.cq, rcq=self.ep.cq, cap=cap))
        self._fresh = False
        return {"gid": self.ep.gid, "qpn": self.ep.qp.qp_num}

    def connect(self, peer: dict[str, Any]) -> None:
        from vrnic.lab.native import connect_rc

        connect_rc(self.ep.qp, peer["gid"], int(peer["qpn"]), self.ep.gid_index)

    def close_qp(self) -> None:
        self.ep.qp.close()

    def post_recv(self) -> None:
        self.ep.post_recv(MSG)

    def post_send(self) -> None:
        self.ep.post_send(MSG)

    def wait_recv(self) -> None:
        import pyverbs.enums as e

        deadline = time.monotonic() + 30
        empty = 0
        while True:
            npolled, wcs = self.ep.cq.poll(num_entries=4)
            for wc in wcs[:npolled]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise DeviceError(f"native completion failed with status {wc.status}")
                if wc.opcode == e.IBV_WC_RECV:
                    return
            if npolled:
                continue
            if time.monotonic() > deadline:
                raise DeviceError("no native RECV within 30 s")
            empty += 1
            if not self.busy and empty > SPINS:
                time.sleep(SLEEP_S)

    def close(self) -> None:
        self.ep.close()


class VrnicSide:
    """The same through a vRNIC of this host's agent (the guest library over its channel)."""

    def __init__(self, attach: dict[str, Any], wait_s: float = 30.0) -> None:
        from vrnic.core.specs import AttachInfo
        from vrnic.frontend import CQ, MR, PD, Access, Context

        self.ctx = Context.attach(AttachInfo(**attach), 1 << 20)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 256)
        self.mr = MR(self.pd, 4096, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.qp: Any = None
        self.wr = 0
        self.wait_s = wait_s

    def new_qp(self) -> dict[str, Any]:
        from vrnic.frontend import QP

        self.qp = QP(self.pd, self.cq, self.cq)
        self.qp.modify("init")  # as rdma_cm hands out QPs; connect() goes on to RTR and RTS
        return {"gid": self.ctx.gid, "qpn": self.qp.qpn}

    def connect(self, peer: dict[str, Any]) -> None:
        self.qp.connect(peer["gid"], int(peer["qpn"]))

    def close_qp(self) -> None:
        self.qp.close()

    def post_recv(self) -> None:
        from vrnic.frontend import RecvRequest

        self.wr += 1
        self.qp.post_recv(RecvRequest(self.wr, (self.mr.sge(0, MSG),)))

    def post_send(self) -> None:
        from vrnic.frontend import SendRequest, WrOpcode

        self.wr += 1
        self.qp.post_send(SendRequest(self.wr, WrOpcode.SEND, (self.mr.sge(0, MSG),)))

    def wait_recv(self) -> None:
        from vrnic.frontend import WcOpcode

        while True:
            for completion in self.cq.wait(1, timeout=self.wait_s):
                if completion.status != 0:
                    raise DeviceError(f"vrnic completion failed with status {completion.status}")
                if completion.opcode == WcOpcode.RECV:
                    return

    def close(self) -> None:
        if self.qp is not None:
            self.qp.close()
        for obj in (self.mr, self.cq, self.pd, self.ctx):
            obj.close()


# --- the two roles -------------------------------------------------------------------------------

class Leader:
    """Host a: accepts b's follower, then drives rounds and measures."""

    def __init__(self, addr: str, port: int = PORT, accept_s: float = 120.0) -> None:
        server = socket.create_server((addr, port))
        server.settimeout(accept_s)
        try:
            conn, _ = server.accept()
        finally:
            server.close()
        conn.settimeout(120)
        self.line = Line(conn)
        self.progress = ""  # where the current exchange is (a stalled run says where it stalled)

    def connect_ms(self, side: Side, kind: str, rounds: int) -> list[float]:
        """Per round: create + exchange + connect on both hosts, in ms (QPs closed between rounds)."""
        self.line.send({"op": "connect", "side": kind, "rounds": rounds})
        samples = []
        for number in range(rounds):
            self.progress = f"{kind} connect round {number}"
            started = time.perf_counter()
            mine = side.new_qp()
            self.line.send(mine)
            peer = self.line.recv()  # b created its QP and connected it to ours
            side.connect(peer)
            samples.append((time.perf_counter() - started) * 1e3)
            self.line.send({"connected": True})  # b keeps its QP until ours is connected (vrnic resolves it)
            self.line.recv()  # b closed its QP: the next round starts clean
            side.close_qp()
        return samples

    def ping_pong_us(self, side: Side, kind: str, iterations: int, rounds: int = 3) -> list[float]:
        """One connected QP pair; per round, iterations 64-byte ping-pongs: half the round trip, in µs."""
        self.line.send({"op": "ping_pong", "side": kind, "iterations": iterations, "rounds": rounds})
        self.progress = f"{kind} ping-pong connect"
        self.line.send(side.new_qp())
        side.connect(self.line.recv())  # b connected and posted its first receive
        samples = []
        for number in range(rounds):
            started = time.perf_counter()
            for iteration in range(iterations):
                self.progress = f"{kind} ping-pong round {number} iteration {iteration}"
                side.post_recv()
                side.post_send()
                side.wait_recv()
            samples.append((time.perf_counter() - started) / iterations / 2 * 1e6)
        self.line.recv()  # b is through
        side.close_qp()
        return samples

    def done(self) -> None:
        self.line.send({"op": "done"})
        self.line.close()


def follow(leader: str, sides: dict[str, Callable[[], Side]]) -> None:
    """Host b: connect to the leader and do what it says until done."""
    host, port = leader.rsplit(":", 1)
    deadline = time.monotonic() + 120
    while True:
        try:
            line = Line(socket.create_connection((host, int(port)), timeout=120))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    opened: dict[str, Side] = {}
    try:
        while True:
            command = line.recv()
            if command["op"] == "done":
                return
            kind = command["side"]
            side = opened.get(kind) or opened.setdefault(kind, sides[kind]())
            if command["op"] == "connect":
                for _ in range(int(command["rounds"])):
                    peer = line.recv()
                    mine = side.new_qp()
                    side.connect(peer)
                    line.send(mine)
                    line.recv()  # a connected to this QP
                    side.close_qp()
                    line.send({"closed": True})
            elif command["op"] == "ping_pong":
                peer = line.recv()
                mine = side.new_qp()
                side.connect(peer)
                side.post_recv()
                line.send(mine)
                for _ in range(int(command["iterations"]) * int(command["rounds"])):
                    side.wait_recv()
                    side.post_recv()
                    side.post_send()
                line.send({"through": True})
                side.close_qp()
    except (VrnicError, OSError) as exc:
        with contextlib.suppress(OSError):
            line.send({"error": f"{type(exc).__name__}: {exc}"})  # the leader raises it with the reason
        raise
    finally:
        for side in opened.values():
            side.close()
        line.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leader", required=True, help="ADDR:PORT of host a's Leader")
    parser.add_argument("--attach", help="AttachInfo JSON of this host's vRNIC (for the vrnic side)")
    parser.add_argument("--wait-s", type=float, default=30.0, help="how long the vrnic side waits for a RECV")
    args = parser.parse_args(argv)
    attach = json.loads(args.attach) if args.attach else None
    sides: dict[str, Callable[[], Side]] = {"native": NativeSide, "native-busy": lambda: NativeSide(busy=True)}
    if attach is not None:
        sides["vrnic"] = lambda: VrnicSide(attach, args.wait_s)
    try:
        follow(args.leader, sides)
    except (VrnicError, OSError) as exc:
        print(f"crosshost follower failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
