"""Mediated verbs through vrnicd against native pyverbs on the same device, in the same run.

vrnicd runs as its own process, as in production; the two guests share this
process, as the native baseline's two endpoints do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness import Record, median_ms
from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, RecvRequest, SendRequest, WrOpcode

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
ARENA = 8 << 20
CONTROL_TARGET = 1.10
THROUGHPUT_TARGET = 0.95
LATENCY_TARGET = 1.2


@contextmanager
def vrnicd(count: int, busy_poll: bool = False, engine: str = "ring",
           pid_out: list[int] | None = None) -> Iterator[list[AttachInfo]]:
    """vrnicd in a process of its own with count vRNICs on rxe0/rxe1; pid_out receives its pid.

    The bench's guests share the bench's cgroup with vrnicd, so direct-engine guests run uncontained
    (best-effort): containment costs nothing per post, and is proven by the kernel tests instead.
    """
    with tempfile.TemporaryDirectory(dir="/run") as tmp:
        attach = Path(tmp) / "attach.json"
        vrnics = [f"--vrnic=v{i}:bench:rxe{i % 2}:1:{engine}" for i in range(count)]
        daemon = subprocess.Popen([sys.executable, "-m", "vrnic.backend.vrnicd", "--socket", f"{tmp}/s.sock",
                                   "--direct-containment", "best-effort",
                                   "--attach-out", str(attach), "--quota", "max_pds=4096", "--quota", "max_cqs=4096",
                                   "--quota", "max_qps=4096", "--quota", "max_mrs=4096",
                                   "--quota", f"max_pinned_bytes={1 << 40}", *vrnics])
        if pid_out is not None:
            pid_out.append(daemon.pid)
        try:
            deadline = time.monotonic() + 60
            while not attach.exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("vrnicd did not start")
                time.sleep(0.05)
            yield [AttachInfo(**json.loads(line)) for line in attach.read_text().splitlines()]
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


def _ratio_record(name: str, unit: str, value: float, native: dict[str, float], target: float,
                  better: str = "lower") -> Record:
    return Record(f"paravirt.{name}", unit, value, native[f"native.{name}"], target, better)  # type: ignore[arg-type]


def control_verbs(infos: list[AttachInfo], native: dict[str, float], repeat: int = 50) -> list[Record]:
    records = []

    def timed(name: str, op) -> None:  # type: ignore[no-untyped-def]
        records.append(_ratio_record(name, "ms", median_ms(op, repeat), native, CONTROL_TARGET))

    def attach():  # type: ignore[no-untyped-def]
        ctx = Context.attach(infos[0], ARENA)
        return ctx.close

    timed("open_device", attach)
    with Context.attach(infos[0], ARENA) as ctx, PD(ctx) as pd, CQ(ctx, 64) as cq:
        timed("alloc_pd", lambda: PD(ctx).close)
        timed("create_cq", lambda: CQ(ctx, 64).close)
        timed("create_qp", lambda: QP(pd, cq, cq, "rc", 64, 64).close)
        timed("reg_mr_4k", lambda: MR(pd, 4096, ALL).close)
        timed("reg_mr_1m", lambda: MR(pd, 1 << 20, ALL).close)
    return records


def connect_and_data(infos: list[AttachInfo], native: dict[str, float], repeat: int = 20) -> list[Record]:
    size = 64 * 1024
    with Context.attach(infos[0], ARENA) as ca, Context.attach(infos[1], ARENA) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 256), CQ(cb, 256)
        mra, mrb = MR(pa, size, ALL), MR(pb, size, ALL)
        samples = []
        for _ in range(repeat):
            qa, qb = QP(pa, cqa, cqa), QP(pb, cqb, cqb)
            started = time.perf_counter()
            qa.connect(cb.gid, qb.qpn)
            qb.connect(ca.gid, qa.qpn)
            samples.append((time.perf_counter() - started) * 1e3)
            qa.close()
            qb.close()
        records = [_ratio_record("connect_qp_pair", "ms", sorted(samples)[len(samples) // 2], native,
                                 CONTROL_TARGET)]
        qa, qb = QP(pa, cqa, cqa, "rc", 64, 64), QP(pb, cqb, cqb, "rc", 64, 64)
        qa.connect(cb.gid, qb.qpn)
        qb.connect(ca.gid, qa.qpn)
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
        records.append(_ratio_record("send_lat_64b", "us", latency, native, LATENCY_TARGET))
        total, window, posted, done = 400, 16, 0, 0
        started = time.perf_counter()
        while done < total:
            batch = min(window - (posted - done), total - posted)
            if batch:
                qa.post_send([SendRequest(posted + i, WrOpcode.RDMA_WRITE, (mra.sge(0, size),),
                                          remote_addr=mrb.addr, rkey=mrb.rkey) for i in range(batch)])
                posted += batch
            done += len(cqa.wait(1, timeout=60))
        throughput = total * size / (time.perf_counter() - started) / 1e6
        records.append(_ratio_record("rdma_write_64k", "MB/s", throughput, native, THROUGHPUT_TARGET, "higher"))
        for obj in (qa, qb, mra, mrb, cqa, cqb, pa, pb):
            obj.close()
    return records


def run(native_records: list[Record]) -> list[Record]:
    native = {r.name: r.value for r in native_records}
    with vrnicd(2) as infos:
        return control_verbs(infos, native) + connect_and_data(infos, native)
