"""The floor of mediation itself: what any control plane that runs each verb in a Python process of its own costs,
with none of vrnicd's code.

A child process (`serve`) holds both devices' contexts, PDs and CQs, as vrnicd does, and runs each request as
vrnicd's device edge does: QPs with pyverbs as native does (vrnic.lab.native.connect_rc), MRs by a legacy REG_MR
write on pyverbs' own command fd (uverbs_edge.reg_mr_by_write; since session 47, when vrnicd's edge moved to it:
with pyverbs' MR() the floor would stand over what vrnicd does), after reading a fixed struct from its socket: no
envelope, no schema, no handles, no quotas, no rings. Each sample is the guest's side of it (a request
sent, its reply read), in turns with native's own samples. Where the ratio of such a bare mediation is already
over a target, no design with a daemon in Python meets it on this platform; where it is under, the difference is
what vrnicd and the guest library may spend (issue 14).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bench import native_verbs
from bench.harness import Record, alternating, loops_in_turns, samples_ms
from vrnic.frontend.guest_library import mr_pool_refills, qp_pool_refills

# Requests: one byte of kind, then the kind's struct; replies are one struct each.
_CREATE = b"P"  # make count RC QPs on one side's device ("<BH") -> "<H"
_CONNECT = b"C"  # connect side's QPs to the other side's ("<B"): INIT, RTR, RTS each -> "<B"
_CLOSE = b"X"  # close every QP -> "<B"
_CLOSE_FIRST = b"Q"  # close the first QP one side made and left (a handed-out QP's close) ("<B") -> "<B"
_REG = b"M"  # register (offset, length) of the arena ("<QQ") -> "<II" lkey, rkey
_DEREG = b"D"  # close that MR -> "<B"
_REG_MANY = b"N"  # register count MRs of length side by side from offset ("<QQH"), kept -> "<H"
_DEREG_MANY = b"Y"  # close every MR _REG_MANY made and left -> "<B"
_DEREG_FIRST = b"F"  # close the first MR _REG_MANY made and left (a handed-out MR's close) -> "<B"
_ARENA_SIZE = 8 << 20
# The pooled 4 KiB loops register fresh pages, as a new context's pool does: each loop its own region past the
# first MiB (reg_mr_1m's), so that no page is registered twice until the regions come round again.
_SMALL_MR = 4096
_POOL_REGION = 256 << 10
_POOL_REGIONS = (_ARENA_SIZE - (1 << 20)) // _POOL_REGION
LOOP = 50  # MR()s or QP()s per loop, as bench.paravirt's control loops

SERVER = ("import sys\n"
          "from bench.mediation_floor import serve\n"
          "serve(int(sys.argv[1]), sys.argv[2], sys.argv[3])\n")


def serve(fd: int, first: str, second: str) -> None:
    """The bare mediator: requests from the socket fd (the arena's memfd comes with the first), until it closes."""
    import pyverbs.enums as e
    from pyverbs.qp import QP, QPCap, QPInitAttr

    from vrnic.backend.uverbs_edge import dereg_mr_by_write, reg_mr_by_write
    from vrnic.lab.native import ACCESS, RcEndpoint, connect_rc

    sock = socket.socket(fileno=fd)
    ends = [RcEndpoint(first), RcEndpoint(second)]
    cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
    inits = [QPInitAttr(qp_type=e.IBV_QPT_RC, scq=end.cq, rcq=end.cq, cap=cap) for end in ends]
    qps: list[list[QP]] = [[], []]
    _, fds, _, _ = socket.recv_fds(sock, 64, 1)
    arena = mmap.mmap(fds[0], _ARENA_SIZE)
    anchor = ctypes.c_char.from_buffer(arena)
    base = ctypes.addressof(anchor)
    sock.sendall(b"k")
    command_fd, pd_handle = ends[0].ctx.cmd_fd, ends[0].pd.handle

    def reg(address: int, length: int) -> tuple[int, int, int]:  # (handle, lkey, rkey)
        return reg_mr_by_write(command_fd, pd_handle, address, length, ACCESS)

    def dereg(made: tuple[int, int, int]) -> None:
        dereg_mr_by_write(command_fd, made[0])

    mr = None
    pool: list[tuple[int, int, int]] = []
    buffer = bytearray(64)
    while True:
        got = sock.recv_into(buffer)
        if not got:
            break
        kind = buffer[:1]
        if kind == _CONNECT:
            me = buffer[1]
            peer = 1 - me
            for qp, other in zip(qps[me], qps[peer], strict=True):
                connect_rc(qp, ends[peer].gid, other.qp_num, ends[me].gid_index)
            sock.sendall(b"k")
        elif kind == _REG:
            offset, length = struct.unpack_from("<QQ", buffer, 1)
            mr = reg(base + offset, length)
            sock.sendall(struct.pack("<II", mr[1], mr[2]))
        elif kind == _DEREG:
            if mr is not None:
                dereg(mr)
                mr = None
            sock.sendall(b"k")
        elif kind == _REG_MANY:
            offset, length, count = struct.unpack_from("<QQH", buffer, 1)
            pool += [reg(base + offset + n * length, length) for n in range(count)]
            sock.sendall(struct.pack("<H", count))
        elif kind == _DEREG_MANY:
            for each in pool:
                dereg(each)
            pool.clear()
            sock.sendall(b"k")
        elif kind == _DEREG_FIRST:
            dereg(pool.pop(0))
            sock.sendall(b"k")
        elif kind == _CREATE:
            side, count = struct.unpack_from("<BH", buffer, 1)
            qps[side] += [QP(ends[side].pd, inits[side]) for _ in range(count)]
            sock.sendall(struct.pack("<H", count))
        elif kind == _CLOSE_FIRST:
            qps[buffer[1]].pop(0).close()
            sock.sendall(b"k")
        elif kind == _CLOSE:
            for side in qps:
                for qp in side:
                    qp.close()
                side.clear()
            sock.sendall(b"k")
        else:
            raise SystemExit(f"mediation floor: unknown request {bytes(kind)!r}")
    for each in [*pool, *([mr] if mr is not None else [])]:  # before their PD goes with its context
        dereg(each)
    del anchor
    arena.close()
    for end in ends:
        end.close()


class BareMediator:
    """The guest's end of a bare mediator child: one request at a time, each a few bytes each way."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid  # the child's, whose objects `rdma res` lists under it

    def call(self, request: bytes) -> bytes:
        self.sock.sendall(request)
        reply = self.sock.recv(64)
        if not reply:
            raise RuntimeError("the bare mediator ended early")
        return reply

    def create(self, side: int, count: int) -> None:
        self.call(_CREATE + struct.pack("<BH", side, count))

    def connect(self, side: int) -> None:
        self.call(_CONNECT + bytes([side]))

    def close_qps(self) -> None:
        self.call(_CLOSE)

    def close_first(self, side: int) -> None:
        self.call(_CLOSE_FIRST + bytes([side]))

    def reg(self, offset: int, length: int) -> Callable[[], None]:
        self.call(_REG + struct.pack("<QQ", offset, length))
        return self.dereg

    def dereg(self) -> None:
        self.call(_DEREG)

    def reg_many(self, offset: int, length: int, count: int) -> None:
        self.call(_REG_MANY + struct.pack("<QQH", offset, length, count))

    def dereg_many(self) -> None:
        self.call(_DEREG_MANY)

    def dereg_first(self) -> None:
        self.call(_DEREG_FIRST)


@contextmanager
def bare_mediator(pair: tuple[str, str]) -> Iterator[BareMediator]:
    """A bare mediator child on these two devices, its 8 MiB arena (a memfd, touched, as a guest's is) shared."""
    from vrnic.lab.latency import this_code_env

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", SERVER, str(theirs.fileno()), *pair],
                             pass_fds=(theirs.fileno(),), env=this_code_env())
    theirs.close()
    fd = os.memfd_create("bare-mediator-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _ARENA_SIZE)
        with mmap.mmap(fd, _ARENA_SIZE) as arena:
            arena.write(b"\1" * _ARENA_SIZE)
        socket.send_fds(ours, [b"A"], [fd])
        if ours.recv(64) != b"k":
            raise RuntimeError("the bare mediator did not start")
        yield BareMediator(ours, child.pid)
    finally:
        os.close(fd)
        ours.close()
        child.wait(timeout=30)


def floor_records(native: dict[str, float], pair: tuple[str, str] = ("rxe0", "rxe1"), repeat: int = 50,
                  pair_rounds: int = 20, setup_rounds: int = 11, count: int = 64, loop_rounds: int = 4) -> list[Record]:
    """paravirt.bare_*: reg_mr_1m in a loop (against native's loop, as paravirt.reg_mr_1m), reg_mr_4k.mean in
    loops in turns with native's (as paravirt's), connect_qp_pair and setup_64_qp_pairs in turns with native's own
    samples (as theirs)."""
    records = []
    with bare_mediator(pair) as bare:
        samples = samples_ms(lambda: bare.reg(0, 1 << 20), repeat)
        records.append(Record("paravirt.bare_reg_mr_1m", "ms", statistics.median(samples),
                              native["native.reg_mr_1m"]))
        records.append(pooled_small_mrs(bare, pair[0], loop_rounds))
        records.append(pooled_qps(bare, pair[0], loop_rounds))

        def connect_pair_ms() -> float:
            bare.create(0, 1)
            bare.create(1, 1)
            started = time.perf_counter()
            bare.connect(0)
            bare.connect(1)
            elapsed = (time.perf_counter() - started) * 1e3
            bare.close_qps()
            return elapsed

        native_samples, samples = alternating(lambda: native_verbs.connect_pair_ms(pair), connect_pair_ms,
                                              pair_rounds)
        records.append(Record("paravirt.bare_connect_qp_pair", "ms", statistics.median(samples),
                              statistics.median(native_samples)))

        def setup_ms() -> float:
            started = time.perf_counter()
            bare.create(0, count)
            bare.create(1, count)
            bare.connect(0)
            bare.connect(1)
            elapsed = (time.perf_counter() - started) * 1e3
            bare.close_qps()
            return elapsed

        native_samples, samples = alternating(lambda: native_verbs.setup_pairs_ms(count, pair), setup_ms,
                                              setup_rounds)
        records.append(Record(f"paravirt.bare_setup_{count}_qp_pairs", "ms", statistics.median(samples),
                              statistics.median(native_samples)))
    return records


def _pool_loop(refills: list[int], refill: Callable[[int], None], close_one: Callable[[], None],
               close_spares: Callable[[], None]) -> list[float]:
    """LOOP samples of a guest's pooled creates with a bare mediator for vrnicd and nothing for the guest's
    handouts: a sample that finds the pool empty sends the next refill (refills, the frontend's own schedule), the
    others are free. After each sample one untimed request closes the object, as the guest's loop closes each
    between its samples; the spares the loop left go at its end."""
    sizes = iter(refills)
    held = 0
    samples = []
    for _ in range(LOOP):
        started = time.perf_counter()
        if not held:
            held = next(sizes)
            refill(held)
        held -= 1
        samples.append((time.perf_counter() - started) * 1e3)
        close_one()
    close_spares()
    return samples


def pooled_small_mrs(bare: BareMediator, device: str, rounds: int) -> Record:
    """paravirt.bare_reg_mr_4k.mean: LOOP MR()s of 4 KiB on a new context as the guest library makes them
    (_pool_loop), each refill registering fresh pages side by side. What is left is what the pool's design costs:
    its round trips, and pyverbs' registration of a fresh page per MR (and of the spares), where native's loop
    registers one hot page again and again. In loops in turns with native's, its baseline native's median, as
    paravirt.reg_mr_4k.mean."""
    loops = itertools.count()

    def loop() -> list[float]:
        offset = (1 << 20) + next(loops) % _POOL_REGIONS * _POOL_REGION

        def refill(count: int) -> None:
            nonlocal offset
            bare.reg_many(offset, _SMALL_MR, count)
            offset += count * _SMALL_MR

        return _pool_loop(mr_pool_refills(_SMALL_MR, LOOP), refill, bare.dereg_first, bare.dereg_many)

    with native_verbs.control_ops(device) as ops:
        native_samples, samples = loops_in_turns(lambda: samples_ms(ops["reg_mr_4k"], LOOP), loop, rounds)
    return Record("paravirt.bare_reg_mr_4k.mean", "ms", statistics.fmean(samples), statistics.median(native_samples))


def pooled_qps(bare: BareMediator, device: str, rounds: int) -> Record:
    """paravirt.bare_create_qp.mean: LOOP QP()s of one shape (RC, 64 WRs each way) on a new context as the guest
    library makes them (_pool_loop: refills of qp_pool_refills, each that many QPs made one after another). What is
    left is what the pool's design costs: its round trips, and distinct live QPs on the NIC (a refill's and its
    spares), where native's loop makes one QP and closes it again. In loops in turns with native's, its baseline
    native's median, as paravirt.create_qp.mean."""
    def loop() -> list[float]:
        return _pool_loop(qp_pool_refills(LOOP), lambda count: bare.create(0, count), lambda: bare.close_first(0),
                          bare.close_qps)

    with native_verbs.control_ops(device) as ops:
        native_samples, samples = loops_in_turns(lambda: samples_ms(ops["create_qp"], LOOP), loop, rounds)
    return Record("paravirt.bare_create_qp.mean", "ms", statistics.fmean(samples), statistics.median(native_samples))


def _requests(verb: str) -> float | None:
    """Requests the mediated record sends per sample (bench.paravirt): a connected pair is one connect per side, a
    setup of N pairs a create and a connect per side, a loop of small MRs a reg_mrs per refill, a loop of QPs a
    create_qps per refill; None for a record with no floor."""
    if verb == "reg_mr_1m":
        return 1
    if verb == "reg_mr_4k.mean":
        return len(mr_pool_refills(_SMALL_MR, LOOP)) / LOOP
    if verb == "create_qp.mean":
        return len(qp_pool_refills(LOOP)) / LOOP
    if verb == "connect_qp_pair":
        return 2
    if verb.startswith("setup_") and verb.endswith("_qp_pairs"):
        return 4
    return None


def with_framing(floors: list[Record], mediated: list[Record]) -> list[Record]:
    """paravirt.floor_*: each bare_* floor plus what vrnicd's wire and dispatch add to a round trip with no verb
    in it (null_rpc - bare_rpc: both ends' framing, the envelope, the schema, the lock), once per request the
    record sends. Derived, not measured: the least any verb could cost through vrnicd's channel if it ran no
    Python of its own beyond pyverbs. Over a target, that target is out of reach on this platform."""
    values = {r.name: r for r in mediated}
    null, bare = values.get("paravirt.null_rpc"), values.get("paravirt.bare_rpc")
    if null is None or bare is None:
        return []
    framing = max(null.value - bare.value, 0.0)
    out = []
    for floor in floors:
        verb = floor.name.removeprefix("paravirt.bare_")
        requests = _requests(verb)
        if requests is not None and floor.baseline:
            out.append(Record(f"paravirt.floor_{verb}", "ms", floor.value + requests * framing, floor.baseline))
    return out


if __name__ == "__main__":
    from bench.harness import show

    baseline = native_verbs.control_verbs()
    show(baseline + floor_records({r.name: r.value for r in baseline}))
