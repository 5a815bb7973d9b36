"""Isolation, quotas, hostile input, crashes and shutdown: vrnicd holds the line on real rxe."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.proto import HEADER, MAGIC, MAX_BODY, VERSION, FrameDecoder, encode
from vrnic.core.specs import AttachInfo
from vrnic.frontend import (
    CQ,
    MR,
    PD,
    QP,
    Access,
    Context,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    RecvRequest,
    SendRequest,
    VrnicError,
    WcStatus,
    WrOpcode,
)

from .conftest import wait_for_baseline

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


def test_forged_and_foreign_handles_are_rejected(make_vrnic: Callable[..., AttachInfo],
                                                 device_pair: tuple[str, str]) -> None:
    with Context.attach(make_vrnic(tenant="alice"), 1 << 20) as alice, \
            Context.attach(make_vrnic(tenant="mallory", device=device_pair[1]), 1 << 20) as mallory:
        pd = PD(alice)
        cq = CQ(alice, 16)
        mr = MR(pd, 4096, ALL)
        # Alice's real handles mean nothing in Mallory's vRNIC, and neither do guesses.
        for op, args in [("dealloc_pd", {"pd": pd.handle}), ("destroy_cq", {"cq": cq.handle}),
                         ("dereg_mr", {"mr": mr.handle}), ("query_qp", {"qp": secrets.randbits(63)}),
                         ("alloc_pd", {"pd": 1})]:
            with pytest.raises((NotFound, InvalidArgument)):
                mallory.call(op, **args)
        with pytest.raises(InvalidArgument):
            mallory.call("dealloc_pd", pd="1")  # wrong type
        mr.close()
        cq.close()
        pd.close()


def test_other_tenants_qps_are_unreachable(make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str]) -> None:
    with Context.attach(make_vrnic(tenant="alice"), 1 << 20) as alice, \
            Context.attach(make_vrnic(tenant="mallory", device=device_pair[1]), 1 << 20) as mallory, \
            Context.attach(make_vrnic(tenant="alice", vpc=2, device=device_pair[1]), 1 << 20) as other_vpc:
        a_pd, m_pd, o_pd = PD(alice), PD(mallory), PD(other_vpc)
        a_cq, m_cq, o_cq = CQ(alice, 16), CQ(mallory, 16), CQ(other_vpc, 16)
        a_qp, m_qp, o_qp = QP(a_pd, a_cq, a_cq), QP(m_pd, m_cq, m_cq), QP(o_pd, o_cq, o_cq)
        with pytest.raises(NotFound):
            m_qp.connect(alice.gid, a_qp.qpn)  # another tenant
        with pytest.raises(NotFound):
            o_qp.connect(alice.gid, a_qp.qpn)  # same tenant, another VPC
        with pytest.raises(NotFound):
            a_qp.connect("fd76:726e:0:1::ffff", 1234)  # nobody
        with pytest.raises(InvalidArgument):
            a_qp.modify("rtr")  # RTR without a virtual peer: guests never give physical addressing
        for obj in (a_qp, m_qp, o_qp, a_cq, m_cq, o_cq, a_pd, m_pd, o_pd):
            obj.close()


def test_memory_outside_the_arena_and_foreign_keys_are_refused(make_vrnic: Callable[..., AttachInfo],
                                                               device_pair: tuple[str, str]) -> None:
    second = device_pair[1]
    info_a, info_b, info_m = make_vrnic(), make_vrnic(device=second), make_vrnic(tenant="mallory", device=second)
    with Context.attach(info_a, 1 << 20) as a, Context.attach(info_b, 1 << 20) as b, \
            Context.attach(info_m, 1 << 20) as m:
        pds = [PD(c) for c in (a, b, m)]
        for addr, length in [(1 << 20, 4096), ((1 << 20) - 100, 4096), (0, 1 << 30)]:
            with pytest.raises(InvalidArgument, match="outside"):
                a.call("reg_mr", pd=pds[0].handle, addr=addr, length=length, access=1)
        with pytest.raises(InvalidArgument):
            a.call("reg_mr", pd=pds[0].handle, addr=-4096, length=4096, access=1)
        cqs = [CQ(c, 16) for c in (a, b, m)]
        mrs = [MR(p, 4096, ALL) for p in pds]
        qps = [QP(p, cq, cq) for p, cq in zip(pds, cqs, strict=True)]
        qps[0].connect(b.gid, qps[1].qpn)
        qps[1].connect(a.gid, qps[0].qpn)
        qa, cqa = qps[0], cqs[0]
        # Mallory's rkey is not an MR of a's peer; a's peer MR range is enforced; a foreign lkey is not ours.
        qa.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (mrs[0].sge(0, 64),), remote_addr=mrs[2].addr,
                                 rkey=mrs[2].rkey))
        qa.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (mrs[0].sge(0, 64),), remote_addr=mrs[1].addr + 4090,
                                 rkey=mrs[1].rkey))
        qa.post_send(SendRequest(3, WrOpcode.SEND, (mrs[2].sge(0, 64),)))
        qa.post_send(SendRequest(4, WrOpcode.RDMA_WRITE, (mrs[0].sge(0, 64),), remote_addr=mrs[1].addr,
                                 rkey=mrs[1].rkey))
        statuses = {c.wr_id: c.status for c in cqa.wait(4)}
        assert statuses == {1: WcStatus.REM_ACCESS_ERR, 2: WcStatus.REM_ACCESS_ERR, 3: WcStatus.LOC_PROT_ERR,
                            4: WcStatus.SUCCESS}
        for obj in (*qps, *mrs, *cqs, *pds):
            obj.close()


@pytest.mark.parametrize("limit", ["max_pds", "max_cqs", "max_qps", "max_mrs", "max_pinned_bytes",
                                   "max_cqe", "max_wr"])
def test_each_quota_limit_is_hit_and_reported(make_vrnic: Callable[..., AttachInfo], limit: str, engine: str) -> None:
    quota = {"max_pds": 2, "max_cqs": 2, "max_qps": 2, "max_mrs": 2, "max_pinned_bytes": 64 * 1024,
             "max_cqe": 64, "max_wr": 32}
    with Context.attach(make_vrnic(engine=engine, **quota), 4 << 20) as ctx:
        held: list[object] = []
        pd = PD(ctx)
        held.append(pd)
        cq = CQ(ctx, 16)
        held.append(cq)
        make: dict[str, Callable[[], object]] = {
            "max_pds": lambda: PD(ctx), "max_cqs": lambda: CQ(ctx, 16), "max_qps": lambda: QP(pd, cq, cq, "rc", 8, 8),
            "max_mrs": lambda: MR(pd, 4096), "max_pinned_bytes": lambda: MR(pd, 40 * 1024),
            "max_cqe": lambda: CQ(ctx, 65), "max_wr": lambda: QP(pd, cq, cq, "rc", 33, 8)}
        with pytest.raises(QuotaExceeded) as err:
            for _ in range(4):
                held.append(make[limit]())
        assert err.value.limit == limit
        assert limit in str(err.value)
        used_before = ctx.query_device()["quota_used"]
        with pytest.raises(QuotaExceeded):  # a refused request changes nothing
            make[limit]()
        assert ctx.query_device()["quota_used"] == used_before
        for obj in reversed(held):
            obj.close()  # type: ignore[attr-defined]


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(10)
    return sock


def _reply(sock: socket.socket) -> dict[str, object] | None:
    decoder = FrameDecoder()
    while True:
        data = sock.recv(65536)
        if not data:
            return None
        messages = decoder.feed(data)
        if messages:
            return messages[0]


def test_malformed_truncated_and_oversized_messages_never_hurt_the_daemon(
        make_vrnic: Callable[..., AttachInfo]) -> None:
    info = make_vrnic()
    path = str(info.socket_path)
    cases = {
        "garbage": b"\x00\x01garbage-garbage",
        "bad version": struct.pack("!HBBI", MAGIC, 99, 0, 2) + b"{}",
        "oversized": HEADER.pack(MAGIC, VERSION, 0, MAX_BODY + 1) + b"x" * 100,
        "not json": HEADER.pack(MAGIC, VERSION, 0, 5) + b"{oops",
        "not an object": encode([1, 2, 3]),  # type: ignore[arg-type]
    }
    for name, data in cases.items():
        with _raw(path) as sock:
            sock.sendall(data)
            reply = _reply(sock)
            assert reply is not None and reply["ok"] is False, name
            assert _reply(sock) is None, f"{name}: the stream must be closed after a framing error"
    requests = [
        ({"id": 1, "op": "alloc_pd", "args": {}}, "the first request must be attach"),
        ({"id": 2, "op": "attach", "args": {"token": "nope"}}, "two file descriptors"),
        ({"id": 3, "op": "attach", "args": {"token": 5}}, "token"),
        ({"id": 4, "bogus": True}, "malformed"),
    ]
    for message, expected in requests:
        with _raw(path) as sock:
            sock.sendall(encode(message))
            reply = _reply(sock)
            assert reply is not None and reply["ok"] is False
            assert expected in str(reply["error"]), (message, reply)
    with _raw(path) as sock:  # truncated: a header promising more than ever arrives
        sock.sendall(HEADER.pack(MAGIC, VERSION, 0, 1000) + b"{")
    # The daemon still serves a well-behaved guest, which can also send junk ops and survive.
    with Context.attach(info, 1 << 20) as ctx:
        with pytest.raises(InvalidArgument, match="unknown operation"):
            ctx.call("format_disk")
        with pytest.raises(InvalidArgument):
            ctx.call("create_cq", cqe="many", ring=0)
        with pytest.raises(InvalidArgument):
            ctx.call("alloc_pd", surprise=1)
        with PD(ctx) as pd, MR(pd, 4096):
            pass


def test_a_guest_killed_mid_traffic_leaves_no_kernel_objects(make_vrnic: Callable[..., AttachInfo],
                                                             device_pair: tuple[str, str], engine: str) -> None:
    target_info = make_vrnic(device=device_pair[1], engine=engine)
    writer_info = make_vrnic(device=device_pair[0], engine=engine)
    baseline = resource_counts()  # with both vRNICs: a shared-ring one holds its next guest's device context
    with Context.attach(target_info, 1 << 20) as target:
        pd, cq = PD(target), CQ(target, 16)
        mr = MR(pd, 65536, ALL)
        qp = QP(pd, cq, cq)
        guest = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "guests" / "writer.py"), writer_info.model_dump_json(),
             target.gid, str(qp.qpn), str(mr.addr), str(mr.rkey)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert guest.stdin is not None and guest.stdout is not None
        writer_qpn = json.loads(guest.stdout.readline())["qpn"]
        qp.connect(writer_info.virtual_gid, writer_qpn)
        guest.stdin.write("go\n")
        guest.stdin.flush()
        assert guest.stdout.readline().strip() == "traffic"
        during = resource_counts()
        assert during[device_pair[0]]["qp"] > baseline[device_pair[0]]["qp"]
        assert mr.read(16) == b"x" * 16  # the writer's RDMA WRITEs really land here
        os.kill(guest.pid, signal.SIGKILL)
        guest.wait()
        # Everything of the killed guest's vRNIC is gone; the survivor's objects are untouched.
        deadline = time.monotonic() + 10
        while resource_counts()[device_pair[0]] != baseline[device_pair[0]] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resource_counts()[device_pair[0]] == baseline[device_pair[0]]
        spares = target.spare_qp_count  # its pool of new QPs (shared-ring engine)
        assert resource_counts()[device_pair[1]]["qp"] == baseline[device_pair[1]]["qp"] + 1 + spares
        for obj in (qp, mr, cq, pd):
            obj.close()
    assert wait_for_baseline(baseline) == baseline


def test_sigterm_releases_everything(device_pair: tuple[str, str], tmp_path: Path) -> None:
    baseline = resource_counts()
    sock = tmp_path / "vrnicd.sock"
    attach = tmp_path / "attach.json"
    daemon = subprocess.Popen([sys.executable, "-m", "vrnic.backend.vrnicd", "--socket", str(sock),
                               "--vrnic", f"a:t:{device_pair[0]}", "--vrnic", f"b:t:{device_pair[1]}",
                               "--attach-out", str(attach)])
    try:
        deadline = time.monotonic() + 30
        while not attach.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        infos = [AttachInfo(**json.loads(line)) for line in attach.read_text().splitlines()]
        ctx = Context.attach(infos[0], 1 << 20)
        pd = PD(ctx)
        cq = CQ(ctx, 16)
        MR(pd, 8192, ALL)
        qp = QP(pd, cq, cq)
        qp.post_recv(RecvRequest(1, ()))  # a zero-SGE WR is refused by completion, not by crashing
        assert cq.wait(1)[0].status == WcStatus.LOC_QP_OP_ERR
        assert resource_counts() != baseline
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
        assert wait_for_baseline(baseline) == baseline
        assert not sock.exists()
        with pytest.raises(VrnicError):
            CQ(ctx, 4)  # the daemon is gone: a typed error, not a hang (a PD would come from the local pool)
        ctx.closed = True
        ctx._release_local()
    finally:
        if daemon.poll() is None:
            daemon.kill()
