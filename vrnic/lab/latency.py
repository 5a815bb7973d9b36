"""SEND/RECV ping-pong latency: native pyverbs, and two guests through vrnicd on either engine (for the demo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import vrnic
from vrnic.core.specs import AttachInfo
from vrnic.errors import VrnicError
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, RecvRequest, SendRequest, WrOpcode
from vrnic.lab.native import RcEndpoint


def native_ping_pong_us(a: RcEndpoint, b: RcEndpoint, iterations: int = 200) -> float:
    """64-byte SEND/RECV ping-pong between two connected native endpoints: half a round trip, in µs."""
    started = time.perf_counter()
    for _ in range(iterations):
        b.post_recv(64)
        a.post_send(64)
        a.poll()
        b.poll()
        a.post_recv(64)
        b.post_send(64)
        b.poll()
        a.poll()
    return (time.perf_counter() - started) / iterations / 2 * 1e6


def ping_pong_us(qa: QP, qb: QP, cqa: CQ, cqb: CQ, mra: MR, mrb: MR, iterations: int = 200) -> float:
    """The same between two connected vrnic guests (either engine)."""
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
    return (time.perf_counter() - started) / iterations / 2 * 1e6


def native_send_latency_us(pair: tuple[str, str], iterations: int = 100, rounds: int = 3) -> float:
    """The median of `rounds` ping-pong runs (one TCG run alone varies by tens of percent)."""
    with RcEndpoint(pair[0], 4096) as a, RcEndpoint(pair[1], 4096) as b:
        a.connect(b.info())
        b.connect(a.info())
        return sorted(native_ping_pong_us(a, b, iterations) for _ in range(rounds))[rounds // 2]


def this_code_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which a `python -m vrnic...` child imports the vrnic this process runs. Left alone,
    `-m` puts the child's working directory first on sys.path, so a benchmark or an A/B probe run from one tree
    would measure the vrnicd of whatever tree it stands in."""
    env = dict(os.environ if base is None else base)
    root = str(Path(vrnic.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONSAFEPATH"] = "1"  # Python 3.11: no working directory (or script directory) on sys.path
    return env


@contextmanager
def standalone_vrnicd(vrnics: list[str], *extra: str, pid_out: list[int] | None = None,
                      quiet: bool = False) -> Iterator[list[AttachInfo]]:
    """`python -m vrnic.backend.vrnicd` in its own process with these --vrnic specs; pid_out gets its pid.

    Its guests here share the caller's cgroup, so a direct-engine guest is not contained (best-effort):
    fine for a demo or a benchmark (containment costs nothing per post), not for tenants."""
    with tempfile.TemporaryDirectory(dir="/run") as tmp:
        attach = Path(tmp) / "attach.json"
        daemon = subprocess.Popen([sys.executable, "-m", "vrnic.backend.vrnicd", "--socket", f"{tmp}/s.sock",
                                   "--attach-out", str(attach), "--direct-containment", "best-effort", *extra,
                                   *(f"--vrnic={v}" for v in vrnics)],
                                  env=this_code_env(), stderr=subprocess.DEVNULL if quiet else None)
        if pid_out is not None:
            pid_out.append(daemon.pid)
        try:
            deadline = time.monotonic() + 180  # Python under TCG on a loaded host can take a minute to start
            while not attach.exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise VrnicError("vrnicd did not start")
                time.sleep(0.05)
            yield [AttachInfo(**json.loads(line)) for line in attach.read_text().splitlines()]
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


def vrnic_send_latency_us(pair: tuple[str, str], engine: str, iterations: int = 100, rounds: int = 3) -> float:
    """Two guests on two vRNICs of this engine: the median of `rounds` ping-pong runs."""
    specs = [f"d0:demo:{pair[0]}:1:{engine}", f"d1:demo:{pair[1]}:1:{engine}"]
    with standalone_vrnicd(specs, quiet=True) as infos, Context.attach(infos[0], 1 << 20) as ca, \
            Context.attach(infos[1], 1 << 20) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 64), CQ(cb, 64)
        mra, mrb = MR(pa, 4096, Access.LOCAL_WRITE), MR(pb, 4096, Access.LOCAL_WRITE)
        qa, qb = QP(pa, cqa, cqa), QP(pb, cqb, cqb)
        qa.connect(cb.gid, qb.qpn)
        qb.connect(ca.gid, qa.qpn)
        latency = sorted(ping_pong_us(qa, qb, cqa, cqb, mra, mrb, iterations) for _ in range(rounds))[rounds // 2]
        for obj in (qa, qb, mra, mrb, cqa, cqb, pa, pb):
            obj.close()
        return latency
