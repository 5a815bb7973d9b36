"""Native pyverbs on rxe in the lab: the baseline later benchmarks compare against."""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pyverbs.enums as e
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPCap, QPInitAttr

from bench.harness import Record, median_ms
from vrnic.lab.latency import native_ping_pong_us
from vrnic.lab.native import ACCESS, RcEndpoint, connect_rc


@contextmanager
def control_ops(device: str = "rxe0") -> Iterator[dict[str, Callable[[], Callable[[], None]]]]:
    """Each control verb as an operation for samples_ms (it returns its cleanup, which runs untimed), on one
    open device with a PD and a CQ."""
    with Context(name=device) as ctx, PD(ctx) as pd, CQ(ctx, 64) as cq:
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq,
                          cap=QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1))
        # Register existing, already touched memory, as vrnicd does with a guest's arena: MR(pd, n)
        # alone would allocate fresh pages and charge their page faults to the baseline.
        buffer = mmap.mmap(-1, 1 << 20)
        buffer.write(b"\1" * (1 << 20))
        anchor = ctypes.c_char.from_buffer(buffer)
        address = ctypes.addressof(anchor)
        try:
            yield {"open_device": lambda: Context(name=device).close,
                   "alloc_pd": lambda: PD(ctx).close,
                   "create_cq": lambda: CQ(ctx, 64).close,
                   "create_qp": lambda: QP(pd, init).close,
                   "reg_mr_4k": lambda: MR(pd, 4096, ACCESS, address=address).close,
                   "reg_mr_1m": lambda: MR(pd, 1 << 20, ACCESS, address=address).close}
        finally:
            del anchor
            buffer.close()


def control_verbs(device: str = "rxe0", repeat: int = 50) -> list[Record]:
    with control_ops(device) as ops:
        return [Record(f"native.{name}", "ms", median_ms(op, repeat)) for name, op in ops.items()]


def connect_pair_ms(pair: tuple[str, str] = ("rxe0", "rxe1")) -> float:
    """One RC pair connected (INIT, RTR, RTS on both sides), its endpoints made and closed untimed."""
    a, b = RcEndpoint(pair[0]), RcEndpoint(pair[1])
    started = time.perf_counter()
    a.connect(b.info())
    b.connect(a.info())
    elapsed = time.perf_counter() - started
    a.close()
    b.close()
    return elapsed * 1e3


def connect_and_data(pair: tuple[str, str] = ("rxe0", "rxe1"), repeat: int = 20) -> list[Record]:
    connects = sorted(connect_pair_ms(pair) for _ in range(repeat))
    records = [Record("native.connect_qp_pair", "ms", connects[len(connects) // 2])]

    size = 64 * 1024
    with RcEndpoint(pair[0], size) as a, RcEndpoint(pair[1], size) as b:
        a.connect(b.info())
        b.connect(a.info())
        # Small SEND/RECV ping-pong: half a round trip is the one-way latency.
        records.append(Record("native.send_lat_64b", "us", native_ping_pong_us(a, b)))
        # RDMA WRITE 64 KiB throughput with a window of outstanding writes.
        total, window, posted, done = 400, 16, 0, 0
        started = time.perf_counter()
        while done < total:
            while posted < total and posted - done < window:
                a.post_rdma(e.IBV_WR_RDMA_WRITE, b.info(), size)
                posted += 1
            done += len(a.poll(1, timeout=30))
        seconds = time.perf_counter() - started
        records.append(Record("native.rdma_write_64k", "MB/s", total * size / seconds / 1e6, better="higher"))
        # Small RDMA WRITEs: the message rate, where per-post overhead shows.
        total, posted, done = 2000, 0, 0
        started = time.perf_counter()
        while done < total:
            while posted < total and posted - done < window:
                a.post_rdma(e.IBV_WR_RDMA_WRITE, b.info(), 4096)
                posted += 1
            done += len(a.poll(1, timeout=30))
        records.append(Record("native.rdma_write_4k_msgs_per_s", "msgs/s", total / (time.perf_counter() - started),
                              better="higher"))
    return records


def setup_pairs_ms(count: int = 64, pair: tuple[str, str] = ("rxe0", "rxe1")) -> float:
    """count RC QPs on each device and each pair connected (INIT, RTR, RTS on both sides), with one PD and one CQ
    per side already there (made and closed untimed): what paravirt.setup_64_qp_pairs does through vrnicd in
    batches."""
    sides = [RcEndpoint(name) for name in pair]
    started = time.perf_counter()
    qps = [[QP(side.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=side.cq, rcq=side.cq,
                                   cap=QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)))
            for _ in range(count)] for side in sides]
    for i in range(count):
        for me, peer in ((0, 1), (1, 0)):
            connect_rc(qps[me][i], sides[peer].gid, qps[peer][i].qp_num, sides[me].gid_index)
    elapsed = (time.perf_counter() - started) * 1e3
    for side, mine in zip(sides, qps, strict=True):
        for qp in mine:
            qp.close()
        side.close()
    return elapsed


def setup_qp_pairs(count: int = 64, pair: tuple[str, str] = ("rxe0", "rxe1"), repeat: int = 5) -> list[Record]:
    samples = sorted(setup_pairs_ms(count, pair) for _ in range(repeat))
    return [Record(f"native.setup_{count}_qp_pairs", "ms", samples[len(samples) // 2])]


def run() -> list[Record]:
    return control_verbs() + connect_and_data() + setup_qp_pairs()
