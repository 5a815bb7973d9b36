"""The peer that keeps writing while a VM migrates: a container guest in its own process (so a test can kill it).

    python -m vrnic.lab.migration_peer < commands

Talks JSON lines on stdin/stdout. The first line is the setup:
{"attach": <AttachInfo>, "qps": N}. It attaches, makes a PD, a CQ, a 1 MiB MR and
N RC QPs, and answers {"gid", "qpns", "addr", "rkey"}. The second line is the VM's
side: {"gid", "qpns", "addr", "rkey", "write_at", "slots", "send_every"}; it
connects QP i to the VM's QP i and answers {"connected": true}. Then, after "go",
it streams on QP 0 until "stop" (or until `slots` writes): sequence number s goes
as an 8-byte RDMA WRITE to write_at + 8 * s in the VM's MR, and every
send_every-th one also as an 8-byte SEND (the VM's receive stream counts them).
Each WR is waited for before the next, so the order of completions is the order
of the numbers. {"op": "progress"} meanwhile answers {"completed", "errors"} and
the stream goes on. On "stop" it answers with what completed and when:
{"writes": [...], "sends": [...], "times": [...], "errors": [...]}, where times
are time.monotonic() of every completion. Standard library and vrnic only.
"""

from __future__ import annotations

import json
import select
import sys
import time
from typing import Any

from vrnic.core.rings import Access, SendRequest, WcStatus, WrOpcode
from vrnic.core.specs import AttachInfo
from vrnic.frontend.guest_library import CQ, MR, PD, QP, Context

MR_BYTES = 1 << 20
COMPLETION_TIMEOUT_S = 60.0


def _line() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    data: dict[str, Any] = json.loads(line)
    return data


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _stop_asked() -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(ready)


def _progress(writes: list[int], errors: list[str]) -> dict[str, Any]:
    return {"completed": len(writes), "last_at": time.monotonic(), "errors": errors}


def main() -> int:
    setup = _line()
    ctx = Context.attach(AttachInfo.model_validate(setup["attach"]))
    pd = PD(ctx)
    cq = CQ(ctx, 256)
    mr = MR(pd, MR_BYTES, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
    qps = [QP(pd, cq, cq, max_send_wr=16, max_recv_wr=16) for _ in range(int(setup.get("qps", 1)))]
    _say({"gid": ctx.gid, "qpns": [q.qpn for q in qps], "addr": mr.addr, "rkey": mr.rkey})
    vm = _line()
    for qp, qpn in zip(qps, vm["qpns"], strict=False):
        qp.connect(vm["gid"], qpn)
    _say({"connected": True})
    if _line().get("op") != "go":
        return 2
    writes: list[int] = []
    sends: list[int] = []
    times: list[float] = []
    errors: list[str] = []
    qp = qps[0]
    send_every = int(vm.get("send_every", 4))
    seq = 0
    asked: dict[str, Any] | None = None
    while seq < int(vm["slots"]) - 1:
        if _stop_asked():
            asked = _line()
            if asked.get("op") != "progress":
                break
            _say(_progress(writes, errors))
            asked = None
            continue
        seq += 1
        mr.write(seq.to_bytes(8, "little"), 8 * (seq % 4096))
        sge = mr.sge(8 * (seq % 4096), 8)
        slot = vm["addr"] + vm["write_at"] + 8 * seq
        wrs = [("write", SendRequest(seq, WrOpcode.RDMA_WRITE, (sge,), remote_addr=slot, rkey=vm["rkey"]))]
        if seq % send_every == 0:
            wrs.append(("send", SendRequest(seq, WrOpcode.SEND, (sge,))))
        for kind, wr in wrs:
            qp.post_send(wr)
            done = cq.wait(1, timeout=COMPLETION_TIMEOUT_S)
            times.append(time.monotonic())
            if done[0].status != WcStatus.SUCCESS:
                errors.append(f"{kind} {seq}: {WcStatus(done[0].status).name}")
                break
            (writes if kind == "write" else sends).append(seq)
        if errors:
            break
    while asked is None or asked.get("op") == "progress":  # after an error or the last slot, until "stop"
        if asked is not None:
            _say(_progress(writes, errors))
        asked = _line()
    _say({"writes": writes, "sends": sends, "times": times, "errors": errors})
    _line()  # "close"
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
