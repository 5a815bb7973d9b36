"""Across two lab hosts (topology two-hosts): connect and 64-byte SEND latency through two vrnic agents against
native pyverbs between the same two hosts, measured in the same run.

Runs on host a inside `vrnic lab run --topology two-hosts -- python -m vrnic.lab.two_hosts -- python -m
bench.multihost --out FILE` (bench/run.py does this): the rig (PostgreSQL on a, `vrnic daemon` on both), one
vRNIC per host for one tenant, and a follower process on b (vrnic.lab.two_hosts.crosshost) in lock step.

- multihost.native.connect_qp_pair: create an RC QP, exchange (gid, qpn) over TCP, INIT/RTR/RTS, on both hosts.
- multihost.connect_qp_pair: the same on vRNICs: virtual GID and QPN; each agent resolves the peer and programs
  the physical path (the remote one through the owner agent).
- multihost.native.send_lat_64b / multihost.send_lat_64b: half the round trip of a 64-byte SEND ping-pong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import Record, write
from vrnic.errors import VrnicError
from vrnic.lab.two_hosts.crosshost import PORT, Leader, NativeSide, VrnicSide
from vrnic.lab.two_hosts.rig import LOG_DIR, Rig

CONNECT_ROUNDS = 20
PING_PONGS = 100
PING_ROUNDS = 3
HW_COUNTERS = "/sys/class/infiniband/rxe0/ports/1/hw_counters"


def run(out: Path, log: bool = True, repeat: int = 1, wait_s: float = 30.0, vrnic_only: bool = False) -> int:
    """repeat: the vrnic connect rounds and ping-pong that many times (a stall shows more often); wait_s: how long
    a waits for a RECV before it calls the run stalled (b waits longer, so its side is still there to look at)."""
    records: list[Record] = []
    failed = ""
    with Rig.start(log=log) as rig:
        token = rig.make_tenant("bench")
        vrnics = {host: rig.allocate(host, token) for host in ("a", "b")}
        local = os.environ["VRNIC_LAB_LOCAL_ADDR"]
        follower = rig.control.call("spawn", argv=[
            sys.executable, "-m", "vrnic.lab.two_hosts.crosshost", "--leader", f"{local}:{PORT}",
            "--attach", json.dumps(vrnics["b"]["attach"]), "--wait-s", str(wait_s + 90)])
        leader = Leader(local)
        native, busy = NativeSide(), NativeSide(busy=True)
        try:
            if vrnic_only:  # a diagnosis run: no native records, and the vrnic ones measured against nothing
                connect = latency = float("nan")
            else:
                connect, latency = _native(leader, native, busy, records)
            counters_before = _hw_counters(rig)
            side = VrnicSide(vrnics["a"]["attach"], wait_s)
            try:
                connects: list[float] = []
                latencies: list[float] = []
                for number in range(repeat):
                    connects += leader.connect_ms(side, "vrnic", CONNECT_ROUNDS)
                    latencies += leader.ping_pong_us(side, "vrnic", PING_PONGS, PING_ROUNDS)
                    if repeat > 1:
                        print(f"vrnic repetition {number + 1} of {repeat} done", flush=True)
                v_connect, v_latency = statistics.median(connects), statistics.median(latencies)
                records += [Record("multihost.connect_qp_pair", "ms", v_connect, None if vrnic_only else connect),
                            Record("multihost.send_lat_64b", "us", v_latency, None if vrnic_only else latency)]
                print(f"vrnic across hosts: connect {v_connect:.2f} ms ({v_connect / connect:.2f}x native), "
                      f"SEND 64 B {v_latency:.0f} us ({v_latency / latency:.2f}x native)", flush=True)
                print(f"rxe hw counters that moved during the vrnic side: "
                      f"{json.dumps(_moved(counters_before, _hw_counters(rig)))}", flush=True)
            except (VrnicError, OSError) as exc:
                failed = (f"the vrnic side failed at {leader.progress}: {exc}; "
                          f"{_diagnose(rig, side, vrnics, counters_before, follower['id'])}")
            finally:
                side.close()
            with contextlib.suppress(OSError):
                leader.done()
        finally:
            native.close()
            busy.close()
            try:
                result = rig.control.call("wait", id=follower["id"], timeout=30)
            except VrnicError:  # the diagnosis collected it already
                result = {"running": False, "rc": 0}
            if result.get("running"):
                rig.control.call("signal", id=follower["id"], signal=9)
            elif result["rc"] != 0:
                failed = failed or f"the follower on b failed: {result['stderr'][-1500:]}"
    write(records, out)
    if failed:
        print(f"bench.multihost: {failed}", file=sys.stderr)
        return 1
    return 0


def _native(leader: Leader, native: NativeSide, busy: NativeSide, records: list[Record]) -> tuple[float, float]:
    connect = statistics.median(leader.connect_ms(native, "native", CONNECT_ROUNDS))
    latency = statistics.median(leader.ping_pong_us(native, "native", PING_PONGS, PING_ROUNDS))
    busy_latency = statistics.median(leader.ping_pong_us(busy, "native-busy", PING_PONGS, PING_ROUNDS))
    records += [Record("multihost.native.connect_qp_pair", "ms", connect),
                Record("multihost.native.send_lat_64b", "us", latency),
                Record("multihost.native.send_lat_64b_busy_poll", "us", busy_latency)]
    print(f"native across hosts: connect {connect:.2f} ms, SEND 64 B {latency:.0f} us "
          f"({busy_latency:.0f} us busy-polling)", flush=True)
    return connect, latency


def _diagnose(rig: Rig, side: VrnicSide, vrnics: dict[str, dict[str, Any]], counters_before: dict[str, Any],
              follower: int) -> str:
    """What the failure left behind, while b still waits: a's QP as vrnicd sees it, both vRNICs' counters, the
    physical QPs (rdma res), rxe's hw counters then and now, b's follower's output so far, and both agents'
    own dump (SIGUSR1: thread stacks, each session's engine counters and QPs) into their logs."""
    found: dict[str, Any] = {}
    with contextlib.suppress(VrnicError, OSError):
        found["a_qp"] = side.qp.query() if side.qp is not None and not side.qp.closed else None
    with rig.client("a") as api:
        for host, vrnic in vrnics.items():
            found[f"counters_{host}"] = api.get(f"/vrnics/{vrnic['id']}/counters").json()
    found["hw_counters_before"] = counters_before
    found["hw_counters_now"] = _hw_counters(rig)
    for host, result in _on_both(rig, ["rdma", "-j", "-d", "res", "show", "qp"]).items():
        found[f"rdma_res_qp_{host}"] = result
    with contextlib.suppress(OSError, VrnicError):
        so_far = rig.control.call("wait", id=follower, timeout=0.1)
        found["follower"] = {"running": so_far.get("running"), "stderr": so_far.get("stderr", "")[-1500:],
                             "stdout": so_far.get("stdout", "")[-500:]}
    with contextlib.suppress(OSError, VrnicError, KeyError, TypeError):
        pid_a = getattr(rig.agents["a"], "pid", None)
        if pid_a:
            os.kill(pid_a, signal.SIGUSR1)
        pid_b = rig.control.call("agent.status").get("pid")
        if pid_b:
            rig.run_on_b(["kill", "-USR1", str(pid_b)], timeout=10)
        time.sleep(3)
        found["agent_dumps"] = f"see the 'debug dump' lines in {LOG_DIR}/agent-a.log and agent-b.log"
        for host in ("a", "b"):
            found[f"agent_{host}_dump"] = [line[-2000:] for line in _log_lines(rig, host) if "debug dump" in line]
    return json.dumps(found)


def _on_both(rig: Rig, argv: list[str]) -> dict[str, Any]:
    """argv's stdout (JSON when it parses) on a and on b; the error text when it fails."""
    found: dict[str, Any] = {}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        found["a"] = _parsed(done.stdout) if done.returncode == 0 else done.stderr[-500:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        found["a"] = str(exc)
    try:
        result = rig.run_on_b(argv, timeout=20)
        found["b"] = _parsed(str(result.get("stdout", ""))) if result.get("rc") == 0 else result.get("stderr")
    except (OSError, VrnicError) as exc:
        found["b"] = str(exc)
    return found


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text[-3000:]


def _hw_counters(rig: Rig) -> dict[str, Any]:
    """rxe's hw counters on both hosts (the non-zero ones)."""
    shown = _on_both(rig, ["sh", "-c", f"cd {HW_COUNTERS} && grep -v '^0$' -H *"])
    counted: dict[str, Any] = {}
    for host, text in shown.items():
        if isinstance(text, str):
            pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
            counted[host] = {name: value for name, value in pairs}
        else:
            counted[host] = text
    return counted


def _moved(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per host, the counters that grew between two _hw_counters readings, by how much."""
    moved: dict[str, dict[str, int]] = {}
    for host, now in after.items():
        then = before.get(host)
        if isinstance(now, dict) and isinstance(then, dict):
            grew = {name: int(value) - int(then.get(name, 0)) for name, value in now.items()
                    if value.strip().isdigit() and int(value) != int(then.get(name, 0))}
            moved[host] = grew
    return moved


def _log_lines(rig: Rig, host: str) -> list[str]:
    path = LOG_DIR / f"agent-{host}.log"
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        result = rig.run_on_b(["tail", "-n", "400", str(path)], timeout=20) if host == "b" else {}
        return str(result.get("stdout", "")).splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "multihost.json")
    parser.add_argument("--repeat", type=int, default=1, help="vrnic connect rounds and ping-pong this many times")
    parser.add_argument("--wait-s", type=float, default=30.0, help="a RECV later than this is a stall")
    parser.add_argument("--vrnic-only", action="store_true", help="skip the native side (a diagnosis run)")
    args = parser.parse_args()
    started = time.monotonic()
    try:
        rc = run(args.out, repeat=args.repeat, wait_s=args.wait_s, vrnic_only=args.vrnic_only)
    except (VrnicError, OSError) as exc:
        print(f"bench.multihost failed: {exc}", file=sys.stderr)
        return 1
    print(f"bench.multihost: wrote {args.out} after {time.monotonic() - started:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
