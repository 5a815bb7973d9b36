"""A guest program that does RDMA with a peer on command: the VM side of `make demo-vm`, the VM tests
and the VM benchmarks.

    python3 -m vrnic.frontend.peer_program --vm [--port org.vrnic.0] --control org.vrnic.ctl

It attaches its vRNIC, makes a PD, a CQ, an MR and an RC QP, reports them on the
control stream (one JSON object per line), and then runs one command per line
until `close` (see COMMANDS). Inside a VM the control stream is a second
virtio-serial port; elsewhere it is stdin/stdout. Standard library only.

A command may carry "seq"; its reply carries it back. Across a live migration the host end of the
control port changes (the destination QEMU's socket): while no host end is connected, reads return EOF
(the program waits for one) and a reply blocks, then reaches whoever connects next, so a controller
matches replies by seq.

recv_stream_start runs a thread that owns the QP's receive side and the CQ until recv_stream_stop:
meanwhile the commands that post or poll (STREAM_REFUSED) are refused. The guest library's channel is
locked, so the thread's doorbells and the main thread's control verbs do not interleave.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vrnic.core.rings import Access, RecvRequest, SendRequest, WcStatus, WrOpcode
from vrnic.errors import VrnicError
from vrnic.frontend.channel import DEFAULT_PORT, find_port
from vrnic.frontend.guest_library import CQ, DEFAULT_VM_ARENA, MR, PD, QP, Context

MR_BYTES = 256 << 10
RECV_SLOTS = 16
RECV_SLOT = 4096  # the first RECV_SLOTS * RECV_SLOT bytes of the MR take receives; sends come from the rest
SEND_AT = RECV_SLOTS * RECV_SLOT
INSTANCE = os.urandom(8).hex()  # chosen once per run: the same after a migration, new after a restart
STREAM_WR = 1 << 62  # the receive stream's wr_ids: STREAM_WR + slot
STREAM_POLL_S = 0.0002
EOF_WAIT_S = 0.05  # no host end on the control port: look again this often
STREAM_REFUSED = ("post_recv", "wait_recv", "send", "write", "read", "ping", "write_stream", "flood",
                  "refusals", "recv_stream_start")


def seq_at(data: bytes) -> int:
    """A sequence-numbered message or slot: its first 8 bytes, little-endian."""
    return int.from_bytes(data[:8], "little")


class RecvStream:
    """Keeps `slots` receives posted in the MR's receive area and records each arrival's sequence number.

    While it runs it is the only user of the QP's receive queue and of the CQ (which the QP shares for
    sends: nothing may be sent meanwhile)."""

    def __init__(self, peer: Peer, slots: int) -> None:
        if not 1 <= slots <= RECV_SLOTS:
            raise VrnicError(f"1 to {RECV_SLOTS} receive slots, not {slots}")
        self.peer = peer
        self.slots = slots
        self.seqs: list[int] = []
        self.errors: list[str] = []
        self.failure: str | None = None
        self.arrived = threading.Condition()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="recv-stream", daemon=True)

    def _post(self, slots: list[int]) -> None:
        mr = self.peer.mr
        self.peer.qp.post_recv([RecvRequest(STREAM_WR + slot, (mr.sge(slot * RECV_SLOT, RECV_SLOT),))
                                for slot in slots])

    def _run(self) -> None:
        try:
            self._post(list(range(self.slots)))
            while not self._stop.is_set():
                done = self.peer.cq.poll(16)
                if not done:
                    time.sleep(STREAM_POLL_S)
                    continue
                again = []
                with self.arrived:
                    for completion in done:
                        slot = completion.wr_id - STREAM_WR
                        if completion.status != WcStatus.SUCCESS or not 0 <= slot < self.slots:
                            # not reposted: a QP in error would flush the repost at once, forever
                            self.errors.append(f"wr {completion.wr_id}: {WcStatus(completion.status).name}")
                            continue
                        self.seqs.append(seq_at(self.peer.mr.read(8, slot * RECV_SLOT)))
                        again.append(slot)
                    self.arrived.notify_all()
                if again:
                    self._post(again)
        except Exception as exc:  # reported by recv_stream_stop
            with self.arrived:
                self.failure = f"{type(exc).__name__}: {exc}"
                self.arrived.notify_all()

    def stop(self, expect: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.seqs) < expect and self.failure is None and time.monotonic() < deadline:
                self.arrived.wait(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self.thread.join(timeout=10)
        errors = self.errors + ([self.failure] if self.failure else [])
        return {"seqs": list(self.seqs), "errors": errors}


class Peer:
    def __init__(self, ctx: Context, mr_bytes: int = MR_BYTES, extra_qps: int = 0, extra_mrs: int = 0,
                 extra_mr_bytes: int = 2 << 20) -> None:
        self.ctx = ctx
        self.pd = PD(ctx)
        self.cq = CQ(ctx, 256)
        self.mr = MR(self.pd, mr_bytes, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
        self.qp = QP(self.pd, self.cq, self.cq, max_send_wr=64, max_recv_wr=RECV_SLOTS)
        # A bigger vRNIC to move (the migration bench): more connected QPs on a CQ of their own, more memory.
        self.extra_cq = CQ(ctx, 16) if extra_qps else None
        self.extra_qps = [QP(self.pd, self.extra_cq, self.extra_cq, max_send_wr=4, max_recv_wr=4)
                          for _ in range(extra_qps)] if self.extra_cq is not None else []
        self.extra_mrs = [MR(self.pd, extra_mr_bytes, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
                          for _ in range(extra_mrs)]
        self.remote: dict[str, Any] = {}
        self._wr = 0
        self.stream: RecvStream | None = None

    def info(self) -> dict[str, Any]:
        return {"gid": self.ctx.gid, "qpn": self.qp.qpn, "addr": self.mr.addr, "rkey": self.mr.rkey,
                "length": self.mr.length, "extra_qpns": [q.qpn for q in self.extra_qps],
                "registered_bytes": self.mr.length + sum(m.length for m in self.extra_mrs)}

    def _next(self) -> int:
        self._wr += 1
        return self._wr

    def _complete(self, count: int = 1) -> list[Any]:
        done = self.cq.wait(count, timeout=30)
        bad = [c for c in done if c.status != WcStatus.SUCCESS]
        if bad:
            raise VrnicError(f"completion failed: {WcStatus(bad[0].status).name}")
        return done

    # ----- commands ------------------------------------------------------------------------------
    def connect(self, gid: str, qpn: int, addr: int, rkey: int) -> dict[str, Any]:
        self.remote = {"addr": addr, "rkey": rkey}
        self.qp.connect(gid, qpn)
        return {}

    def connect_extra(self, gid: str, qpns: list[int]) -> dict[str, Any]:
        """Connect the extra QPs, the i-th to the peer's qpns[i]."""
        for qp, qpn in zip(self.extra_qps, qpns, strict=True):
            qp.connect(gid, qpn)
        return {}

    def post_recv(self, count: int = 1) -> dict[str, Any]:
        self.qp.post_recv([RecvRequest(self._next(), (self.mr.sge(i * RECV_SLOT, RECV_SLOT),))
                           for i in range(count)], sync=True)
        return {}

    def wait_recv(self, count: int = 1) -> dict[str, Any]:
        done = self._complete(count)
        return {"received": [self.mr.read(c.byte_len, (i % RECV_SLOTS) * RECV_SLOT).hex()
                             for i, c in enumerate(done)]}

    def send(self, data: str) -> dict[str, Any]:
        payload = bytes.fromhex(data)
        self.mr.write(payload, SEND_AT)
        self.qp.post_send(SendRequest(self._next(), WrOpcode.SEND, (self.mr.sge(SEND_AT, len(payload)),)))
        self._complete()
        return {}

    def write(self, data: str, remote_offset: int = 0) -> dict[str, Any]:
        payload = bytes.fromhex(data)
        self.mr.write(payload, SEND_AT)
        self.qp.post_send(SendRequest(self._next(), WrOpcode.RDMA_WRITE, (self.mr.sge(SEND_AT, len(payload)),),
                                      remote_addr=self.remote["addr"] + remote_offset, rkey=self.remote["rkey"]))
        self._complete()
        return {}

    def read(self, length: int, remote_offset: int = 0) -> dict[str, Any]:
        self.qp.post_send(SendRequest(self._next(), WrOpcode.RDMA_READ, (self.mr.sge(SEND_AT, length),),
                                      remote_addr=self.remote["addr"] + remote_offset, rkey=self.remote["rkey"]))
        self._complete()
        return {"data": self.mr.read(length, SEND_AT).hex()}

    def peek(self, offset: int, length: int) -> dict[str, Any]:
        return {"data": self.mr.read(length, offset).hex()}

    def whoami(self) -> dict[str, Any]:
        """Who is answering: the same pid, instance and boot_id after a migration prove nothing restarted."""
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return {"pid": os.getpid(), "instance": INSTANCE, "boot_id": boot_id, "uptime_s": uptime}

    def check_slots(self, offset: int, count: int, size: int) -> dict[str, Any]:
        """The sequence numbers at the start of count slots of size bytes from offset (the peer's RDMA WRITEs)."""
        return {"seqs": [seq_at(self.mr.read(8, offset + i * size)) for i in range(count)]}

    def recv_stream_start(self, slots: int = RECV_SLOTS) -> dict[str, Any]:
        self.stream = RecvStream(self, slots)
        self.stream.thread.start()
        return {}

    def recv_stream_stop(self, expect: int, timeout: float = 30.0) -> dict[str, Any]:
        if self.stream is None:
            raise VrnicError("no receive stream is running")
        stream, self.stream = self.stream, None
        return stream.stop(expect, timeout)

    def refusals(self, foreign_gid: str, foreign_qpn: int) -> dict[str, Any]:
        """What vrnicd answers to memory outside this VM's RAM and to identities that are not ours."""
        attempts: dict[str, Callable[[], object]] = {
            "mr_beyond_ram": lambda: self.ctx.call("reg_mr", pd=self.pd.handle, addr=1 << 44, length=4096,
                                                   access=int(Access.LOCAL_WRITE)),
            "mr_in_rom_hole": lambda: self.ctx.call("reg_mr", pd=self.pd.handle, addr=0xC0000, length=4096,
                                                    access=int(Access.LOCAL_WRITE)),
            "foreign_pd": lambda: self.ctx.call("dealloc_pd", pd=self.pd.handle + 1000),
            "foreign_qp": lambda: self.ctx.call("destroy_qp", qp=self.qp.handle + 1000),
            "foreign_peer": lambda: self.ctx.call("modify_qp", qp=self.qp.handle, state="rtr",
                                                  remote_gid=foreign_gid, remote_qpn=foreign_qpn),
        }
        codes = {}
        for name, attempt in attempts.items():
            try:
                attempt()
                codes[name] = "accepted"
            except VrnicError as exc:
                codes[name] = exc.code
        return {"codes": codes}

    def ping(self, iterations: int, size: int = 64) -> dict[str, Any]:
        """SEND size bytes and wait for the peer's SEND back, iterations times: round-trip latency."""
        sge = self.mr.sge(SEND_AT, size)
        start = time.perf_counter()
        for _ in range(iterations):
            # one doorbell for both: in a VM each is a message on the channel
            self.qp.post_recv(RecvRequest(self._next(), (self.mr.sge(0, RECV_SLOT),)), doorbell=False)
            self.qp.post_send(SendRequest(self._next(), WrOpcode.SEND, (sge,)))
            self._complete(2)
        seconds = time.perf_counter() - start
        return {"round_trip_us": seconds / iterations * 1e6}

    def write_stream(self, size: int, iterations: int, depth: int = 16) -> dict[str, Any]:
        """RDMA WRITE size bytes iterations times, up to depth in flight: throughput."""
        if SEND_AT + size > MR_BYTES:
            raise VrnicError(f"at most {MR_BYTES - SEND_AT} bytes per write")
        sge = self.mr.sge(SEND_AT, size)
        posted = completed = 0
        start = time.perf_counter()
        while completed < iterations:
            batch = min(depth - (posted - completed), iterations - posted)
            if batch:
                self.qp.post_send([SendRequest(self._next(), WrOpcode.RDMA_WRITE, (sge,),
                                               remote_addr=self.remote["addr"], rkey=self.remote["rkey"])
                                   for _ in range(batch)])
                posted += batch
            completed += len(self._complete(1))
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "mb_per_s": size * iterations / seconds / 1e6}

    def flood(self, size: int = 4096) -> dict[str, Any]:
        """Start RDMA WRITEs that never stop (until the VM is destroyed): reply first, then write."""
        self._flooding = size
        return {}

    def run_flood(self) -> None:
        sge = self.mr.sge(SEND_AT, self._flooding)
        while True:
            self.qp.post_send(SendRequest(self._next(), WrOpcode.RDMA_WRITE, (sge,),
                                          remote_addr=self.remote["addr"], rkey=self.remote["rkey"]))
            self._complete()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.stop(0, 0)
            self.stream = None
        self.ctx.close()


COMMANDS = ("connect", "post_recv", "wait_recv", "send", "write", "read", "peek", "refusals", "ping", "write_stream",
            "flood", "whoami", "check_slots", "recv_stream_start", "recv_stream_stop", "connect_extra", "close")


def read_lines(fd: int, reconnect: bool) -> Iterator[str]:
    """Lines from fd. reconnect: EOF means the host end of a virtio-serial port is away (a migration, the
    controller reconnecting), not the end: wait for it to come back."""
    buffer = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            if not reconnect:
                return
            time.sleep(EOF_WAIT_S)
            continue
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line.decode()


def serve(peer: Peer, lines: Iterable[str], out: Callable[[dict[str, Any]], None]) -> None:
    for line in lines:
        seq: dict[str, Any] = {}
        try:
            command = json.loads(line)
            if "seq" in command:
                seq = {"seq": command.pop("seq")}
            op = command.pop("op")
            if op not in COMMANDS:
                raise VrnicError(f"unknown command {op!r}")
            if peer.stream is not None and op in STREAM_REFUSED:
                raise VrnicError(f"{op} while the receive stream owns the QP and CQ (recv_stream_stop first)")
            if op == "close":
                peer.close()
                out({"op": op, "ok": True, **seq})
                return
            result = getattr(peer, op)(**command)
            out({"op": op, "ok": True, **result, **seq})
            if op == "flood":
                peer.run_flood()
        except Exception as exc:  # reported to the controller, which decides
            out({"ok": False, "error": f"{type(exc).__name__}: {exc}", **seq})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vm", action="store_true", help="attach over this VM's virtio-serial port")
    parser.add_argument("--port", default=DEFAULT_PORT, help="the vRNIC's port (--vm)")
    parser.add_argument("--control", help="a virtio-serial port name for the commands (default: stdin/stdout)")
    parser.add_argument("--mr-bytes", type=int, default=MR_BYTES, help="the MR's size (a multiple of 4096)")
    parser.add_argument("--arena-bytes", type=int, default=DEFAULT_VM_ARENA, help="the frontend's arena in the VM")
    parser.add_argument("--extra-qps", type=int, default=0, help="more RC QPs, for connect_extra")
    parser.add_argument("--extra-mrs", type=int, default=0, help="more MRs of --extra-mr-bytes each")
    parser.add_argument("--extra-mr-bytes", type=int, default=2 << 20)
    args = parser.parse_args(argv)
    if args.control:
        in_fd = out_fd = os.open(find_port(args.control), os.O_RDWR)
    else:
        in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    lines = read_lines(in_fd, reconnect=bool(args.control))

    def out(message: dict[str, Any]) -> None:
        view = memoryview((json.dumps(message) + "\n").encode())
        while view:
            view = view[os.write(out_fd, view):]

    # SIGTERM (the VM's power button, or a plain kill) ends the program the way an error would: it detaches.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        started = time.perf_counter()
        if not args.vm:
            raise VrnicError("only --vm is supported: a container guest uses Context.attach(info)")
        ctx = Context.attach_vm(args.port, arena_bytes=args.arena_bytes)
        attached = time.perf_counter()
        peer = Peer(ctx, args.mr_bytes, args.extra_qps, args.extra_mrs, args.extra_mr_bytes)
        arena = ctx.arena
        out({"op": "ready", "ok": True, **peer.info(), "attach_ms": (attached - started) * 1000,
             "setup_ms": (time.perf_counter() - attached) * 1000,
             "hugepages": bool(getattr(arena, "hugepages", False))})
    except Exception as exc:
        out({"op": "ready", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    try:
        serve(peer, lines, out)
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
