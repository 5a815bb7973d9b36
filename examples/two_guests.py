"""Two guest processes on two vRNICs of one tenant, talking through vrnicd.

Run it inside the lab (it needs rxe0 and rxe1):

    vrnic lab run -- python examples/two_guests.py

It starts vrnicd with two vRNICs (tenant "demo", on rxe0 and rxe1), then two
guest processes that know each other only by virtual GID and virtual QPN:
they exchange those over a pipe, connect, play SEND/RECV ping-pong, then
guest a RDMA-WRITEs into b's buffer and RDMA-READs it back. Each guest is an
ordinary unprivileged-style program: it allocates its buffers from its own
shared arena and never sees a physical GID, QPN or key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, RecvRequest, SendRequest, WrOpcode

ROUNDS = 10


def guest(role: str, info: AttachInfo) -> None:
    """One guest: prints its identity, reads the peer's, then runs its half of the exchange."""
    access = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
    with Context.attach(info, arena_bytes=1 << 20) as ctx, PD(ctx) as pd, CQ(ctx, 64) as cq, \
            MR(pd, 8192, access) as mr, QP(pd, cq, cq) as qp:
        print(json.dumps({"gid": ctx.gid, "qpn": qp.qpn, "addr": mr.addr, "rkey": mr.rkey}), flush=True)
        peer = json.loads(sys.stdin.readline())
        qp.connect(peer["gid"], peer["qpn"])
        print("connected", flush=True)
        sys.stdin.readline()  # both sides are connected: traffic may start
        started = time.perf_counter()
        for i in range(ROUNDS):
            if role == "b":
                qp.post_recv(RecvRequest(i, (mr.sge(0, 64),)))
                cq.wait(1)
                mr.write(mr.read(4).replace(b"ping", b"pong"))
                qp.post_send(SendRequest(i, WrOpcode.SEND, (mr.sge(0, 64),)))
                cq.wait(1)
            else:
                qp.post_recv(RecvRequest(i, (mr.sge(64, 64),)))
                mr.write(b"ping")
                qp.post_send(SendRequest(i, WrOpcode.SEND, (mr.sge(0, 64),)))
                done = cq.wait(2)
                assert all(c.status == 0 for c in done) and mr.read(4, 64) == b"pong", done
        if role == "a":
            rtt = (time.perf_counter() - started) / ROUNDS * 1e6
            print(f"a: {ROUNDS} SEND/RECV ping-pongs with {peer['gid']} qpn {peer['qpn']}, {rtt:.0f} us per round trip",
                  flush=True)
            message = b"written by a, straight into b's memory"
            mr.write(message, 1024)
            qp.post_send(SendRequest(100, WrOpcode.RDMA_WRITE, (mr.sge(1024, len(message)),),
                                     remote_addr=peer["addr"] + 4096, rkey=peer["rkey"]))
            qp.post_send(SendRequest(101, WrOpcode.RDMA_READ, (mr.sge(2048, len(message)),),
                                     remote_addr=peer["addr"] + 4096, rkey=peer["rkey"]))
            assert all(c.status == 0 for c in cq.wait(2))
            assert mr.read(len(message), 2048) == message
            print(f"a: RDMA WRITE of {len(message)} bytes into b, RDMA READ back: identical", flush=True)
            print("done", flush=True)
            sys.stdin.readline()
        else:
            sys.stdin.readline()  # a says when its WRITE has landed
            print(f"b: found in my own buffer: {mr.read(38, 4096).decode()!r}", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory(dir="/run") as tmp:
        attach = Path(tmp) / "attach.json"
        daemon = subprocess.Popen([sys.executable, "-m", "vrnic.backend.vrnicd", "--socket", f"{tmp}/vrnicd.sock",
                                   "--vrnic", "a:demo:rxe0", "--vrnic", "b:demo:rxe1", "--attach-out", str(attach)])
        try:
            while not attach.exists():
                if daemon.poll() is not None:
                    return 1
                time.sleep(0.05)
            infos = [line for line in attach.read_text().splitlines()]
            print(f"vrnicd: two vRNICs for tenant demo: a on rxe0, b on rxe1 (pid {daemon.pid})")
            guests = [subprocess.Popen([sys.executable, __file__, "--guest", role, info], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, bufsize=1)
                      for role, info in zip("ab", infos, strict=True)]
            a, b = guests
            ids = [json.loads(g.stdout.readline()) for g in guests]  # type: ignore[union-attr]
            for role, ident in zip("ab", ids, strict=True):
                print(f"guest {role}: virtual GID {ident['gid']}, virtual QPN {ident['qpn']}")
            for g, peer in ((a, ids[1]), (b, ids[0])):
                g.stdin.write(json.dumps(peer) + "\n")  # type: ignore[union-attr]
                g.stdin.flush()  # type: ignore[union-attr]
            for g in guests:
                assert g.stdout.readline().strip() == "connected"  # type: ignore[union-attr]
            for g in guests:
                g.stdin.write("go\n")  # type: ignore[union-attr]
                g.stdin.flush()  # type: ignore[union-attr]
            for line in a.stdout:  # type: ignore[union-attr]
                if line.strip() == "done":
                    break
                print(line.rstrip())
            b.stdin.write("look\n")  # type: ignore[union-attr]
            b.stdin.flush()  # type: ignore[union-attr]
            print(b.stdout.readline().rstrip())  # type: ignore[union-attr]
            a.stdin.write("bye\n")  # type: ignore[union-attr]
            a.stdin.flush()  # type: ignore[union-attr]
            return max(g.wait(timeout=60) for g in guests)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--guest":
        guest(sys.argv[2], AttachInfo(**json.loads(sys.argv[3])))
        sys.exit(0)
    sys.exit(main())
