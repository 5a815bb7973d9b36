"""The direct engine against native pyverbs on the same devices, in the same run.

Same workloads as bench.paravirt and bench.native_verbs. Under TCG one run of a
workload varies by 15-25%, and the lab warms up as it goes, so native and direct
rounds alternate (three each) and each ratio compares medians measured side by
side. vrnicd runs as its own process; its CPU time over a 10k-post run, divided
by the posts, shows what the daemon does per post (the direct engine's goal: nothing).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.harness import Record
from bench.paravirt import ALL, ARENA, vrnicd
from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Context, SendRequest, WrOpcode
from vrnic.lab.latency import native_ping_pong_us, ping_pong_us

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


def _native_round(pair: tuple[str, str] = ("rxe0", "rxe1")) -> dict[str, float]:
    """bench.native_verbs' data-path workloads, once more: the baseline, interleaved with the direct rounds."""
    import pyverbs.enums as e

    from vrnic.lab.native import RcEndpoint

    out = {}
    with RcEndpoint(pair[0], 65536) as a, RcEndpoint(pair[1], 65536) as b:
        a.connect(b.info())
        b.connect(a.info())
        out["send_lat_64b"] = native_ping_pong_us(a, b)
        for size, total, name in ((65536, 400, "rdma_write_64k"), (4096, 2000, "rdma_write_4k_msgs_per_s")):
            posted = done = 0
            started = time.perf_counter()
            while done < total:
                while posted < total and posted - done < 16:
                    a.post_rdma(e.IBV_WR_RDMA_WRITE, b.info(), size)
                    posted += 1
                done += len(a.poll(1, timeout=30))
            seconds = time.perf_counter() - started
            out[name] = total * size / seconds / 1e6 if size == 65536 else total / seconds
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def data_path(infos: list[AttachInfo], prefix: str, daemon: int, rounds: int) -> tuple[list[Record], dict[str, float]]:
    """Direct (or ring) and native rounds, alternating, so drift in the lab hits both alike; medians.
    Returns the records and the interleaved native medians they were compared with."""
    size = 64 * 1024
    direct: dict[str, list[float]] = {}
    native: dict[str, list[float]] = {}
    records: list[Record] = []
    with Context.attach(infos[0], ARENA) as ca, Context.attach(infos[1], ARENA) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 256), CQ(cb, 256)
        mra, mrb = MR(pa, size, ALL), MR(pb, size, ALL)
        qa, qb = QP(pa, cqa, cqa, "rc", 64, 64), QP(pb, cqb, cqb, "rc", 64, 64)
        qa.connect(cb.gid, qb.qpn)
        qb.connect(ca.gid, qa.qpn)
        for _ in range(rounds):
            for name, value in _native_round().items():
                native.setdefault(name, []).append(value)
            if prefix == "direct":
                direct.setdefault("send_lat_64b", []).append(ping_pong_us(qa, qb, cqa, cqb, mra, mrb))
                seconds = _windowed_writes(qa, cqa, mra, mrb, size, 400)
                direct.setdefault("rdma_write_64k", []).append(400 * size / seconds / 1e6)
            seconds = _windowed_writes(qa, cqa, mra, mrb, 4096, 2000)
            direct.setdefault("rdma_write_4k_msgs_per_s", []).append(2000 / seconds)
        base = {name: _median(values) for name, values in native.items()}
        targets = {"send_lat_64b": ("us", LATENCY_TARGET, "lower"), "rdma_write_64k": ("MB/s", THROUGHPUT_TARGET,
                   "higher"), "rdma_write_4k_msgs_per_s": ("msgs/s", RATE_TARGET, "higher")}
        for name, values in direct.items():
            unit, target, better = targets[name]
            records.append(Record(f"{prefix}.{name}", unit, _median(values), base[name],
                                  target if prefix == "direct" else None, better))  # type: ignore[arg-type]
        posts = CPU_POSTS if prefix == "direct" else CPU_POSTS // 5  # the ring engine is slow: a shorter run
        before = cpu_seconds(daemon)
        _windowed_writes(qa, cqa, mra, mrb, 4096, posts)
        records.append(Record(f"{prefix}.daemon_cpu_per_post", "us", (cpu_seconds(daemon) - before) / posts * 1e6))
        for obj in (qa, qb, mra, mrb, cqa, cqb, pa, pb):
            obj.close()
    return records, base


def run(native_records: list[Record], rounds: int = 3) -> list[Record]:
    """native_records: the suite's own native.* records (kept as they are; the ratios here use the
    native rounds interleaved with this suite's, recorded as direct.native_interleaved.*)."""
    records = []
    for engine, rounds_here in (("direct", rounds), ("ring", 1)):
        pid: list[int] = []
        with vrnicd(2, engine=engine, pid_out=pid) as infos:
            got, base = data_path(infos, engine, pid[0], rounds_here)
            records += got
            if engine == "direct":
                records += [Record(f"direct.native_interleaved.{name}", unit, base[name], better=better)
                            for name, unit, better in (("send_lat_64b", "us", "lower"),
                                                       ("rdma_write_64k", "MB/s", "higher"),
                                                       ("rdma_write_4k_msgs_per_s", "msgs/s", "higher"))]
    return records
