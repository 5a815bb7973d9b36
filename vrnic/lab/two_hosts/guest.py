"""A guest program the two-hosts tests and demo drive line by line, on either host.

    python -m vrnic.lab.two_hosts.guest       # reads JSON commands on stdin, answers one JSON line each

It is an ordinary container guest: the guest library on a vRNIC of its host's agent. Commands:
attach {attach} -> gid, ip; qp -> qpn (PD, CQs and an 8 KiB MR once; a new RC QP in INIT with receives
posted); connect_gid {gid, qpn}; resolve {ip} -> gid; listen {port}; accept {timeout} -> the request,
answered with this MR's address and rkey as private data; cm_connect {ip, port, data, timeout} -> the peer's
QP and its MR; send {hex}; write {hex, offset} (RDMA WRITE into the peer's MR, then a SEND "written" after
it: RC orders them); recv {count, timeout} -> what arrived; read {offset, length}; quit.
Any VrnicError comes back as {"error": class name, "message"}: refusals are answers, not crashes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import struct
import subprocess
import sys
from typing import Any

from vrnic.core.specs import AttachInfo
from vrnic.errors import LabError, VrnicError

MR_BYTES = 8192
SLOT = 256  # each receive lands in its own slot of the MR's first 2 KiB
WRITE_AT = 2048  # RDMA WRITEs from the peer land in the next 2 KiB
GRH = 40  # a UD receive starts with the global route header
UD_QKEY = 0x11111111  # the frontend's UD QPs take this qkey
STAGE = 4096  # what this guest sends or writes is staged in the last 4 KiB
RECVS = 8
MR_INFO = struct.Struct("<QI")  # address and rkey, the private data an accept carries


class GuestProgram:
    def __init__(self) -> None:
        self.ctx: Any = None
        self.qp: Any = None
        self.listener: Any = None
        self.peer_mr: tuple[int, int] | None = None
        self.wr = 0
        self.received = 0

    def do_attach(self, attach: dict[str, Any]) -> dict[str, Any]:
        from vrnic.frontend import CQ, MR, PD, Access, Context

        self.ctx = Context.attach(AttachInfo(**attach), 1 << 20)
        self.pd = PD(self.ctx)
        self.scq, self.rcq = CQ(self.ctx, 64), CQ(self.ctx, 64)  # apart: a send's wait never eats a receive
        self.mr = MR(self.pd, MR_BYTES, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        return {"gid": self.ctx.gid, "ip": getattr(self.ctx, "ip", None)}

    def do_qp(self) -> dict[str, Any]:
        from vrnic.frontend import QP, RecvRequest

        if self.qp is not None:
            self.qp.close()
        self.qp = QP(self.pd, self.scq, self.rcq)
        self.qp.modify("init")  # as rdma_cm's QPs start: receives can be posted before the connection
        self.qp.post_recv([RecvRequest(1000 + i, (self.mr.sge(i * SLOT, SLOT),)) for i in range(RECVS)])
        self.received = 0
        return {"qpn": self.qp.qpn}

    def do_ud_qp(self) -> dict[str, Any]:
        """A UD QP (qkey UD_QKEY) in RTS with every receive slot posted: datagrams by virtual GID and QPN."""
        from vrnic.frontend import QP, RecvRequest

        if self.qp is not None:
            self.qp.close()
        self.qp = QP(self.pd, self.scq, self.rcq, qp_type="ud")
        for state in ("init", "rtr", "rts"):
            self.qp.modify(state)
        self.qp.post_recv([RecvRequest(1000 + i, (self.mr.sge(i * SLOT, SLOT),)) for i in range(RECVS)], sync=True)
        return {"qpn": self.qp.qpn}

    def do_ud_send(self, gid: str, qpn: int, hex: str) -> dict[str, Any]:
        from vrnic.frontend import SendRequest, WrOpcode

        data = bytes.fromhex(hex)
        self.mr.write(data, STAGE)
        self.wr += 1
        self.qp.post_send(SendRequest(self.wr, WrOpcode.SEND, (self.mr.sge(STAGE, len(data)),),
                                      ud_gid=ipaddress.IPv6Address(gid).packed, ud_qpn=qpn, ud_qkey=UD_QKEY))
        return {"statuses": [int(c.status) for c in self.scq.wait(1, timeout=30)]}

    def do_ud_recv(self, count: int = 1, timeout: float = 30.0) -> dict[str, Any]:
        """The next count datagrams: the source QPN the receiver saw, and the payload after the 40-byte GRH."""
        got: list[dict[str, Any]] = []
        while len(got) < count:
            for completion in self.rcq.wait(1, timeout=timeout):
                if completion.status != 0:
                    raise LabError(f"a receive completed with status {completion.status}")
                slot = completion.wr_id - 1000
                payload = self.mr.read(completion.byte_len - GRH, slot * SLOT + GRH)
                got.append({"src_qp": completion.src_qp, "hex": payload.hex()})
        return {"datagrams": got}

    def do_connect_gid(self, gid: str, qpn: int) -> dict[str, Any]:
        self.qp.connect(gid, qpn)
        return {}

    def do_resolve(self, ip: str) -> dict[str, Any]:
        from vrnic.frontend import cm

        return {"gid": cm.resolve(self.ctx, ip)}

    def do_listen(self, port: int) -> dict[str, Any]:
        from vrnic.frontend import cm

        self.listener = cm.Listener(self.ctx, port)
        return {}

    def do_accept(self, timeout: float = 60.0) -> dict[str, Any]:
        request = self.listener.get_request(timeout)
        if request is None:
            return {"error": "Timeout", "message": f"no connection request within {timeout} s"}
        done = self.listener.accept(request, self.qp, MR_INFO.pack(self.mr.addr, self.mr.rkey))
        return {"remote_gid": done.remote_gid, "remote_qpn": done.remote_qpn,
                "private_data": request.private_data.decode(errors="replace")}

    def do_cm_connect(self, ip: str, port: int, data: str = "", timeout: float = 30.0) -> dict[str, Any]:
        from vrnic.frontend import cm

        done = cm.connect(self.ctx, self.qp, ip, port, data.encode(), timeout)
        self.peer_mr = MR_INFO.unpack(done.private_data[:MR_INFO.size])
        return {"remote_gid": done.remote_gid, "remote_qpn": done.remote_qpn}

    def do_mr(self) -> dict[str, Any]:
        return {"addr": self.mr.addr, "rkey": self.mr.rkey}

    def do_peer_mr(self, addr: int, rkey: int) -> dict[str, Any]:
        self.peer_mr = (addr, rkey)
        return {}

    def _post(self, opcode: Any, offset: int, length: int, remote_addr: int = 0, rkey: int = 0) -> None:
        from vrnic.frontend import SendRequest

        self.wr += 1
        self.qp.post_send(SendRequest(self.wr, opcode, (self.mr.sge(offset, length),), remote_addr=remote_addr,
                                      rkey=rkey))
        for completion in self.scq.wait(1, timeout=30):
            if completion.status != 0:
                raise LabError(f"{opcode.name} completed with status {completion.status}")

    def do_send(self, hex: str) -> dict[str, Any]:
        from vrnic.frontend import WrOpcode

        data = bytes.fromhex(hex)
        self.mr.write(data, STAGE)
        self._post(WrOpcode.SEND, STAGE, len(data))
        return {}

    def do_write(self, hex: str, offset: int = 0) -> dict[str, Any]:
        from vrnic.frontend import WrOpcode

        if self.peer_mr is None:
            raise LabError("no peer MR: cm_connect or peer_mr first")
        data = bytes.fromhex(hex)
        self.mr.write(data, STAGE)
        addr, rkey = self.peer_mr
        self._post(WrOpcode.RDMA_WRITE, STAGE, len(data), remote_addr=addr + WRITE_AT + offset, rkey=rkey)
        return self.do_send(b"written".hex())

    def do_recv(self, count: int = 1, timeout: float = 30.0) -> dict[str, Any]:
        """The next count receives, each as hex of its byte_len from its slot."""
        got: list[str] = []
        while len(got) < count:
            for completion in self.rcq.wait(1, timeout=timeout):
                if completion.status != 0:
                    raise LabError(f"a receive completed with status {completion.status}")
                slot = completion.wr_id - 1000
                got.append(self.mr.read(completion.byte_len, slot * SLOT).hex())
        self.received += count
        return {"messages": got}

    def do_read(self, offset: int, length: int) -> dict[str, Any]:
        return {"hex": self.mr.read(length, WRITE_AT + offset).hex()}

    def serve(self, stdin: Any, stdout: Any) -> int:
        return serve_lines(self, stdin, stdout)


def serve_lines(program: object, stdin: Any, stdout: Any,
                errors: tuple[type[BaseException], ...] = (VrnicError,)) -> int:
    """Answer JSON commands line by line: {"op": name, ...} calls program.do_<name>(...); "quit" ends. An
    error of the given kinds becomes an {"error", "message"} answer, so the driving side can raise it."""
    for line in stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            answer = getattr(program, f"do_{op}")(**command)
        except errors as exc:
            answer = {"error": type(exc).__name__, "message": str(exc)}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()
    return 0


def guest_argv() -> list[str]:
    return [sys.executable, "-m", "vrnic.lab.two_hosts.guest"]


class LocalGuest:
    """The program on this host (a), as a child process with pipes."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(guest_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        start_new_session=True)

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout: float = 120.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the guest's own waits are bounded; so is this
        if not line:
            raise LabError(f"the guest on a ended (exit {self.process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class RemoteGuest:
    """The program on host b, through b's control server."""

    def __init__(self, control: Any) -> None:
        self.control = control
        self.id: int | None = int(control.call("spawn", argv=guest_argv(), stdin=True)["id"])

    def send(self, op: str, **args: Any) -> None:
        self.control.call("write", id=self.id, text=json.dumps({"op": op, **args}) + "\n")

    def reply(self, timeout: float = 120.0) -> dict[str, Any]:
        answer = self.control.call("readline", id=self.id, timeout=timeout)
        if answer["line"] is None:
            raise LabError(f"the guest on b ended or timed out: {answer.get('stderr', '')}")
        result: dict[str, Any] = json.loads(answer["line"])
        return result

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def close(self) -> None:
        if self.id is not None:
            self.control.call("signal", id=self.id, signal=int(signal.SIGKILL))
            self.control.call("wait", id=self.id, timeout=10)
            self.id = None


def main() -> int:
    return GuestProgram().serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
