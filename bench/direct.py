"""The direct engine against native pyverbs on the same devices, in the same run.

Same workloads as bench.paravirt and bench.native_verbs. vrnicd runs as its own
process; its CPU time over a 10k-post run, divided by the posts, shows what the
daemon does per post (the direct engine's goal: nothing).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.harness import Record
from bench.paravirt import ALL, ARENA, vrnicd
from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Context, RecvRequest, SendRequest, WrOpcode

LATENCY_TARGET = 1.10
THROUGHPUT_TARGET = 0.97
RATE_TARGET = 0.90
CPU_POSTS = 10_000


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (clock ticks: a 10 ms grain, hence the long run)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _windowed_writes(qa: QP, cqa: CQ, mra: MR, mrb: MR, size: int, total: int, window: int = 16) -> float:
    """Seconds to complete total RDMA WRITEs of size bytes, one post (and doorbell) per WR, as native does."""
    posted = done = 0
    started = time.perf_counter()
    while done < total:
        while posted < total and posted - done < window:
            qa.post_send(SendRequest(posted, WrOpcode.RDMA_WRITE, (mra.sge(0, size),), remote_addr=mrb.addr,
                                     rkey=mrb.rkey))
            posted += 1
        done += len(cqa.wait(1, timeout=60))
    return time.perf_counter() - started


def _latency_and_throughput(qa: QP, qb: QP, cqa: CQ, cqb: CQ, mra: MR, mrb: MR,
                            native: dict[str, float]) -> list[Record]:
    size = 64 * 1024
    records = []
    iterations = 200
    started = time.perf_counter()
    for i in range(iterations):
        qb.post_recv(RecvRequest(i, (mrb.sge(0, 64),)))
        qa.post_send(SendRequest(i, WrOpcode.SEND, (mra.sge(0, 64),)))
        cqa.wait(1)
        cqb.wait(1)
        qa.post_recv(RecvRequest(i, (mra.sge(0, 64),)))
        qb.post_send(SendRequest(i, WrOpcode.SEND, (mrb.sge(0, 64),)))
        cqb.wait(1)
        cqa.wait(1)
    latency = (time.perf_counter() - started) / iterations / 2 * 1e6
    records.append(Record("direct.send_lat_64b", "us", latency, native["native.send_lat_64b"], LATENCY_TARGET))
    seconds = _windowed_writes(qa, cqa, mra, mrb, size, 400)
    records.append(Record("direct.rdma_write_64k", "MB/s", 400 * size / seconds / 1e6, native["native.rdma_write_64k"],
                          THROUGHPUT_TARGET, "higher"))
    return records


def data_path(infos: list[AttachInfo], native: dict[str, float], prefix: str, daemon: int) -> list[Record]:
    size = 64 * 1024
    records: list[Record] = []
    with Context.attach(infos[0], ARENA) as ca, Context.attach(infos[1], ARENA) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 256), CQ(cb, 256)
        mra, mrb = MR(pa, size, ALL), MR(pb, size, ALL)
        qa, qb = QP(pa, cqa, cqa, "rc", 64, 64), QP(pb, cqb, cqb, "rc", 64, 64)
        qa.connect(cb.gid, qb.qpn)
        qb.connect(ca.gid, qa.qpn)
        if prefix == "direct":
            records += _latency_and_throughput(qa, qb, cqa, cqb, mra, mrb, native)
        seconds = _windowed_writes(qa, cqa, mra, mrb, 4096, 2000)
        records.append(Record(f"{prefix}.rdma_write_4k_msgs_per_s", "msgs/s", 2000 / seconds,
                              native["native.rdma_write_4k_msgs_per_s"],
                              RATE_TARGET if prefix == "direct" else None, "higher"))
        posts = CPU_POSTS if prefix == "direct" else CPU_POSTS // 5  # the ring engine is slow: a shorter run
        before = cpu_seconds(daemon)
        _windowed_writes(qa, cqa, mra, mrb, 4096, posts)
        per_post = (cpu_seconds(daemon) - before) / posts * 1e6
        records.append(Record(f"{prefix}.daemon_cpu_per_post", "us", per_post))
        for obj in (qa, qb, mra, mrb, cqa, cqb, pa, pb):
            obj.close()
    return records


def run(native_records: list[Record]) -> list[Record]:
    native = {r.name: r.value for r in native_records}
    records = []
    for engine, prefix in (("direct", "direct"), ("ring", "ring")):
        pid: list[int] = []
        with vrnicd(2, engine=engine, pid_out=pid) as infos:
            records += data_path(infos, native, prefix, pid[0])
    return records
