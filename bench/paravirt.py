"""Mediated verbs through vrnicd against native pyverbs on the same device, in the same run.

connect_qp_pair and setup_64_qp_pairs take native's samples in turns with their own (bench.harness.alternating),
and each control verb its loops in turns with native's loops (bench.harness.loops_in_turns), so that each ratio
compares the two in the same moments of the lab, not minutes apart.

vrnicd runs as its own process, as in production; the two guests share this
process, as the native baseline's two endpoints do.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bench import mediation_floor, native_verbs
from bench.harness import Record, alternating, loops_in_turns, median_ms, samples_ms
from vrnic.core.framing import FrameDecoder, encode_ok, encode_request
from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WrOpcode
from vrnic.frontend.channel import DEFAULT_WIRE_VERSION, WIRE_VERSION_ENV, UnixChannel
from vrnic.lab.latency import ping_pong_us, standalone_vrnicd, this_code_env

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
ARENA = 8 << 20
CONTROL_TARGET = 3.0  # issue 14: each mediated verb (and open_device) within 3x native
CONNECT_TARGET = 1.5
SETUP_TARGET = 1.2
THROUGHPUT_TARGET = 0.95
LATENCY_TARGET = 1.2
CONTROL_ROUNDS = 4  # loops of each control verb on each side, in turns


@contextmanager
def vrnicd(count: int, engine: str = "ring",
           pid_out: list[int] | None = None) -> Iterator[list[AttachInfo]]:
    """vrnicd in a process of its own with count vRNICs on rxe0/rxe1, quotas out of the way."""
    quotas = [arg for q in ("max_pds=4096", "max_cqs=4096", "max_qps=4096", "max_mrs=4096",
                            f"max_pinned_bytes={1 << 40}") for arg in ("--quota", q)]
    with standalone_vrnicd([f"v{i}:bench:rxe{i % 2}:1:{engine}" for i in range(count)], *quotas,
                           pid_out=pid_out) as infos:
        yield infos


def _ratio_record(name: str, unit: str, value: float, native: dict[str, float], target: float,
                  better: str = "lower") -> Record:
    return Record(f"paravirt.{name}", unit, value, native[f"native.{name}"], target, better)  # type: ignore[arg-type]


def control_verbs(infos: list[AttachInfo], native: dict[str, float], repeat: int = 50,
                  rounds: int = CONTROL_ROUNDS) -> list[Record]:
    """Each verb in loops of its own (repeat calls each), a loop of native's and a loop of vrnicd's per round, in
    turns (bench.harness.loops_in_turns). Not single calls in turns: in the lab a native verb of a few hundred
    microseconds runs 1.5-5x slower right after other work than in a loop (measured for reg_mr, create_qp,
    alloc_pd and open_device, also after a 2 ms sleep or a pure-Python loop), so they would compare a cold native
    with a warm mediated verb. Nor loops minutes apart: native open_device took 0.64 ms in one run and 1.41 in
    another (session 34), and the ratios followed. Every mediated loop runs on a context attached for it
    (untimed), so its pools start empty, as a guest's do, and the mean counts that loop's refills at their
    real weight."""
    records = []
    turned: dict[str, float] = {}  # native's median in each verb's turns

    def timed(name: str, loop: Callable[[], list[float]]) -> None:
        native_samples, samples = loops_in_turns(lambda: samples_ms(native_ops[name], repeat), loop, rounds)
        turned[name] = statistics.median(native_samples)
        records.append(Record(f"paravirt.{name}", "ms", statistics.median(samples), turned[name], CONTROL_TARGET))
        # The mean counts the creates that refill a pool (one request for several objects) at their real weight,
        # which the median of pooled handouts leaves out. Its baseline is still native's median.
        records.append(Record(f"paravirt.{name}.mean", "ms", statistics.fmean(samples), turned[name],
                              CONTROL_TARGET))

    def attach():  # type: ignore[no-untyped-def]
        ctx = Context.attach(infos[0], ARENA)
        return ctx.close

    def on_a_new_context(verb: Callable[[Context, PD, CQ], Callable[[], None]]) -> Callable[[], list[float]]:
        def loop() -> list[float]:
            with Context.attach(infos[0], ARENA) as ctx, PD(ctx) as pd, CQ(ctx, 64) as cq:
                return samples_ms(lambda: verb(ctx, pd, cq), repeat)
        return loop

    with native_verbs.control_ops(infos[0].device) as native_ops:
        timed("open_device", lambda: samples_ms(attach, repeat))
        records.append(Record("paravirt.bare_attach", "ms", statistics.median(bare_attach_ms(repeat)),
                              turned["open_device"]))
        timed("alloc_pd", on_a_new_context(lambda ctx, pd, cq: PD(ctx).close))
        timed("create_cq", on_a_new_context(lambda ctx, pd, cq: CQ(ctx, 64).close))
        timed("create_qp", on_a_new_context(lambda ctx, pd, cq: QP(pd, cq, cq, "rc", 64, 64).close))
        timed("reg_mr_4k", on_a_new_context(lambda ctx, pd, cq: MR(pd, 4096, ALL).close))
        timed("reg_mr_1m", on_a_new_context(lambda ctx, pd, cq: MR(pd, 1 << 20, ALL).close))
    baseline = {**native, "native.alloc_pd": turned["alloc_pd"]}
    with Context.attach(infos[0], ARENA) as ctx:
        # The floor: an empty request through the whole dispatch. Native has no such thing; the ratio is against
        # native alloc_pd, the cheapest native verb, to show how much of a verb's budget the round trip eats.
        records.append(Record("paravirt.null_rpc", "ms", median_ms(ctx.null_rpc, repeat), turned["alloc_pd"]))
        records.append(Record("paravirt.bare_rpc", "ms", bare_round_trip_ms(repeat * 4), turned["alloc_pd"]))
        records += codec_in_and_out_of_a_round_trip(repeat * 4)
        records += wire_versions(ctx, infos[1], baseline, repeat * 4)
        records += polled_and_asleep(ctx, baseline, repeat * 4)
    return records


ECHO = ("import socket, sys\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "while data := s.recv(256):\n"
        "    s.sendall(data)\n")


def bare_round_trip_ms(repeat: int) -> float:
    """The floor under the floor: a 64-byte echo over a Unix socket pair between this process and a Python child
    that does nothing else (no vrnic code, no encoding, no dispatch). No request from one process to another
    in this machine's Python gets under it; null_rpc minus this is what vrnicd's channel adds."""
    frame = bytes(64)
    with _echo_child(ECHO) as ours:
        def echo() -> None:
            ours.sendall(frame)
            got = 0
            while got < len(frame):
                got += len(ours.recv(256))

        return median_ms(echo, repeat)


@contextmanager
def _echo_child(script: str, env: dict[str, str] | None = None) -> Iterator[socket.socket]:
    """Our end of a socket pair whose other end a Python child running script holds (its fd in argv[1]); at the
    block's end ours is closed, which ends the child's recv loop, and the child is waited for."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", script, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                             env=env)
    theirs.close()
    try:
        yield ours
    finally:
        ours.close()
        child.wait(timeout=30)


CODEC_ECHO = ("import socket, sys\n"
              "from bench.paravirt import codec_work\n"
              "s = socket.socket(fileno=int(sys.argv[1]))\n"
              "while data := s.recv(256):\n"
              "    codec_work()\n"
              "    s.sendall(data)\n")


_CODEC_DECODERS = (FrameDecoder(), FrameDecoder())  # each end keeps its decoder, as a channel does


def codec_work() -> None:
    """A null_rpc's framing, both ends of it, in the version the frontend speaks: encode the request, decode it,
    encode the reply, decode it."""
    _CODEC_DECODERS[0].feed_frames(encode_request(7, "null_rpc", {}, DEFAULT_WIRE_VERSION))
    _CODEC_DECODERS[1].feed_frames(encode_ok(7, {}, DEFAULT_WIRE_VERSION))


def codec_in_and_out_of_a_round_trip(repeat: int) -> list[Record]:
    """What a round trip does to the Python around it, with no vrnic code but the codec: the same work timed in a
    loop of its own, and between the round trips of a ping-pong with a child that does the same work per message.
    The ratio is the platform's, not vrnicd's: under the lab's TCG, code that runs after the kernel scheduled
    another process (or the idle loop) runs slower than the same code in a loop (README, issue 14's floor)."""
    in_loop = statistics.median(samples_ms(codec_work, repeat)) * 1e3
    between = []
    with _echo_child(CODEC_ECHO, this_code_env()) as ours:
        for n in range(repeat + 20):
            started = time.perf_counter()
            codec_work()
            if n >= 20:  # the child's first messages import and warm up
                between.append((time.perf_counter() - started) * 1e6)
            ours.sendall(b"x")
            if not ours.recv(256):
                raise RuntimeError("the codec echo child ended early")
    return [Record("paravirt.codec_loop", "us", in_loop),
            Record("paravirt.codec_between_round_trips", "us", statistics.median(between), in_loop)]


BARE_ATTACH = ("import mmap, os, socket, sys\n"
               "listening = socket.socket(fileno=int(sys.argv[1]))\n"
               "while True:\n"
               "    conn, _ = listening.accept()\n"
               "    data, fds, _, _ = socket.recv_fds(conn, 256, 3)\n"
               "    if not data:\n"
               "        break\n"
               "    memory = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)\n"
               "    conn.sendall(data)\n"
               "    conn.recv(1)\n"
               "    memory.close()\n"
               "    for fd in fds:\n"
               "        os.close(fd)\n"
               "    conn.close()\n")


def bare_attach_ms(repeat: int) -> list[float]:
    """The floor under open_device, as bare_rpc is under null_rpc: the system calls of an attach and nothing else.
    This process connects to a Python child (no vrnic code), makes an 8 MiB sealed memfd arena and two eventfds
    as the frontend does, sends the three with a 64-byte request, and waits for the echo; the child maps the
    arena, as vrnicd does, before it answers. Closing is untimed, as in open_device."""
    workdir = tempfile.mkdtemp(prefix="vrnic-bare-attach-")
    path = os.path.join(workdir, "s.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(8)
    child = subprocess.Popen([sys.executable, "-c", BARE_ATTACH, str(listening.fileno())],
                             pass_fds=(listening.fileno(),))
    listening.close()
    frame = bytes(64)

    def attach() -> Callable[[], None]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        fd = os.memfd_create("bare-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, ARENA)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        arena = mmap.mmap(fd, ARENA)
        bells = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(2)]
        socket.send_fds(sock, [frame], [fd, *bells])
        got = 0
        while got < len(frame):
            got += len(sock.recv(256))

        def close() -> None:
            sock.close()
            arena.close()
            for each in (fd, *bells):
                os.close(each)
        return close

    try:
        return samples_ms(attach, repeat)
    finally:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stop:  # an empty request ends the child
            stop.connect(path)
        child.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def wire_versions(ctx: Context, other: AttachInfo, native: dict[str, float], rounds: int) -> list[Record]:
    """null_rpc in protocol v3 (MessagePack, what the frontend speaks where msgpack imports) and v2 (binary, what
    a VM's standard-library frontend speaks) to the same vrnicd, one call of each per round, in turns, so that
    both see the same load: what the encoding is worth on the round trip."""
    saved = os.environ.get(WIRE_VERSION_ENV)
    os.environ[WIRE_VERSION_ENV] = "2"
    try:
        binary_ctx = Context.attach(other, ARENA)
    finally:
        if saved is None:
            os.environ.pop(WIRE_VERSION_ENV)
        else:
            os.environ[WIRE_VERSION_ENV] = saved
    with binary_ctx:
        return _null_rpc_records(("msgpack_v3", "binary_v2"),
                                 alternating(_null_rpc_ms(ctx), _null_rpc_ms(binary_ctx), rounds), native)


def polled_and_asleep(ctx: Context, native: dict[str, float], rounds: int) -> list[Record]:
    """null_rpc with the guest polling its socket for the reply (its default) and sleeping in recv at once, one
    call of each per round, in turns: what the poll is worth on the round trip."""
    channel = ctx.open_channel()
    assert isinstance(channel, UnixChannel)
    default = channel.poll_seconds
    try:
        samples = alternating(_null_rpc_ms(ctx, lambda: setattr(channel, "poll_seconds", default)),
                              _null_rpc_ms(ctx, lambda: setattr(channel, "poll_seconds", 0.0)), rounds)
    finally:
        channel.poll_seconds = default
    return _null_rpc_records(("polled", "asleep"), samples, native)


def _null_rpc_ms(ctx: Context, prepare: Callable[[], None] = lambda: None) -> Callable[[], float]:
    """One null_rpc's wall time in ms, after prepare() (untimed)."""
    def measure() -> float:
        prepare()
        started = time.perf_counter()
        ctx.null_rpc()
        return (time.perf_counter() - started) * 1e3
    return measure


def _null_rpc_records(names: tuple[str, str], samples: tuple[list[float], list[float]],
                      native: dict[str, float]) -> list[Record]:
    return [Record(f"paravirt.null_rpc.{name}", "ms", statistics.median(values), native["native.alloc_pd"])
            for name, values in zip(names, samples, strict=True)]


def connect_and_data(infos: list[AttachInfo], native: dict[str, float], repeat: int = 20) -> list[Record]:
    size = 64 * 1024
    with Context.attach(infos[0], ARENA) as ca, Context.attach(infos[1], ARENA) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 256), CQ(cb, 256)
        mra, mrb = MR(pa, size, ALL), MR(pb, size, ALL)

        def connect_pair_ms() -> float:
            qa, qb = QP(pa, cqa, cqa), QP(pb, cqb, cqb)
            started = time.perf_counter()
            qa.connect(cb.gid, qb.qpn)
            qb.connect(ca.gid, qa.qpn)
            elapsed = (time.perf_counter() - started) * 1e3
            qa.close()
            qb.close()
            return elapsed

        pair = (infos[0].device, infos[1].device)
        native_samples, samples = alternating(lambda: native_verbs.connect_pair_ms(pair), connect_pair_ms, repeat)
        records = [Record("paravirt.connect_qp_pair", "ms", statistics.median(samples),
                          statistics.median(native_samples), CONNECT_TARGET)]
        qa, qb = QP(pa, cqa, cqa, "rc", 64, 64), QP(pb, cqb, cqb, "rc", 64, 64)
        qa.connect(cb.gid, qb.qpn)
        qb.connect(ca.gid, qa.qpn)
        latency = ping_pong_us(qa, qb, cqa, cqb, mra, mrb)
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


def setup_qp_pairs(infos: list[AttachInfo], count: int = 64, repeat: int = 11) -> list[Record]:
    """count RC QPs in each of two guests and each pair connected, with the batched verbs: one create_qps and
    one connect_qps per guest (PD and CQ already there, as in native.setup_pairs_ms), in turns with native. Eleven
    rounds: in the lab a native setup took 63-128 ms within one loop of five (session 35), and native's median of
    five in turns was 10-37% over its own loop's in three runs of that session."""
    def setup_ms() -> float:
        with Context.attach(infos[0], ARENA) as ca, Context.attach(infos[1], ARENA) as cb:
            pa, pb = PD(ca), PD(cb)
            cqa, cqb = CQ(ca, 256), CQ(cb, 256)
            started = time.perf_counter()
            qas = QP.create_many(pa, cqa, cqa, count)
            qbs = QP.create_many(pb, cqb, cqb, count)
            QP.connect_many(ca, [(qa, cb.gid, qb.qpn) for qa, qb in zip(qas, qbs, strict=True)])
            QP.connect_many(cb, [(qb, ca.gid, qa.qpn) for qa, qb in zip(qas, qbs, strict=True)])
            return (time.perf_counter() - started) * 1e3

    pair = (infos[0].device, infos[1].device)
    native_samples, samples = alternating(lambda: native_verbs.setup_pairs_ms(count, pair), setup_ms, repeat)
    return [Record(f"paravirt.setup_{count}_qp_pairs", "ms", statistics.median(samples),
                   statistics.median(native_samples), SETUP_TARGET)]


def run(native_records: list[Record]) -> list[Record]:
    native = {r.name: r.value for r in native_records}
    with vrnicd(2) as infos:
        mediated = control_verbs(infos, native) + connect_and_data(infos, native) + setup_qp_pairs(infos)
    floors = mediation_floor.floor_records(native)
    return mediated + floors + mediation_floor.with_framing(floors, mediated)


def control_only() -> list[Record]:
    """The control-path records alone (issue 14), with their native baselines, for a quick lab run:
    `vrnic lab run -- python -m bench.paravirt` writes bench/results/control.json and prints the table."""
    native = native_verbs.control_verbs() + native_verbs.connect_and_data() + native_verbs.setup_qp_pairs()
    baseline = {r.name: r.value for r in native}
    with vrnicd(2) as infos:
        mediated = control_verbs(infos, baseline) + connect_and_data(infos, baseline) + setup_qp_pairs(infos)
    floors = mediation_floor.floor_records(baseline)
    return native + mediated + floors + mediation_floor.with_framing(floors, mediated)


if __name__ == "__main__":
    from bench.harness import RESULTS, show, write

    records = control_only()
    write(records, RESULTS / "control.json")
    show(records)
