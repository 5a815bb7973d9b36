"""`make demo-qos`: two tenants share a link under their QoS caps (issue 12), on Soft-RoCE inside the lab.

Run inside the lab: `vrnic lab run --topology pair --timeout 600 -- python -m vrnic.lab.qos_demo`.
1. vrnicd (in-process verbs driver) told the link does 64 Mbit/s, below what rxe does here, so the link is
   the bottleneck; on rxe0 tenant acme (cap 24 Mbit/s) and tenant globex (guarantee 32, cap 40 Mbit/s),
   each with a peer vRNIC on rxe1;
2. what vrnicd installed on rxe0's uplink: an HTB class per vRNIC, a u32 filter per connected QP (tc);
3. each tenant streams 64 KiB RDMA WRITEs alone: each stays at its cap (globex borrows past its guarantee);
4. both at once: globex gets at least its guarantee, and each stays at or below its cap;
5. acme's cap raised live (set_qos) while it streams on the same connection; then cleanup: no qdisc left,
   the kernel's RDMA objects back at their baseline.
Wire rates come from each class's byte counter (driver.qos_counters(); frames, as HTB counts them). It fails
(exit 1) if a tenant is more than 15 % above its cap, globex below 0.9x its guarantee under contention, or
anything is left behind.
"""

from __future__ import annotations

import bisect
import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.qos_shaper import uplink_netdev
from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.specs import AttachInfo, QosPolicy, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import VrnicError
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WrOpcode
from vrnic.lab.migrate_demo import Steps, check, counts_line, run_demo, wait_for  # the demos' shared steps

LINK_MBPS, ACME_CAP, GLOBEX_GUARANTEE, GLOBEX_CAP, ACME_RAISED = 64, 24, 32, 40, 48
POLICIES = {"acme": QosPolicy(rate_cap_mbps=ACME_CAP),
            "globex": QosPolicy(guarantee_mbps=GLOBEX_GUARANTEE, rate_cap_mbps=GLOBEX_CAP)}
CAPS = {"acme": ACME_CAP, "globex": GLOBEX_CAP}
WRITE, IN_FLIGHT, WARM_S = 64 * 1024, 4, 0.5
ACK_TIMEOUT = 17  # 4.096 us * 2^17 = 0.5 s (default 67 ms): packets wait in the shaper, longer under emulation
ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
Rates = dict[str, tuple[float, float]]  # tenant -> (data Mbit/s from completions, wire Mbit/s from its class)


class Guest:
    """A tenant's program on its vRNIC: a PD, a CQ, a 64 KiB MR and an RC QP."""

    def __init__(self, info: AttachInfo) -> None:
        self.ctx = Context.attach(info, 1 << 20)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64)
        self.mr = MR(self.pd, WRITE, ALL)
        self.qp = QP(self.pd, self.cq, self.cq)

    def connect(self, peer: Guest) -> None:
        for qp, remote, gid in ((self.qp, peer.qp, peer.ctx.gid), (peer.qp, self.qp, self.ctx.gid)):
            qp.modify("init", access=15)
            qp.modify("rtr", remote_gid=gid, remote_qpn=remote.qpn)
            qp.modify("rts", timeout=ACK_TIMEOUT)

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq, self.pd, self.ctx):
            obj.close()


class Stream(threading.Thread):
    """64 KiB RDMA WRITEs, 4 in flight, from a tenant into its peer's MR until stopped; completion times."""

    def __init__(self, writer: Guest, reader: Guest) -> None:
        super().__init__(daemon=True)
        self.writer, self.reader, self.halt = writer, reader, threading.Event()
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        sge, posted = self.writer.mr.sge(0, WRITE), 0
        try:
            while not self.halt.is_set() or len(self.times) < posted:
                while not self.halt.is_set() and posted - len(self.times) < IN_FLIGHT:
                    self.writer.qp.post_send(SendRequest(posted, WrOpcode.RDMA_WRITE, (sge,),
                                                         remote_addr=self.reader.mr.addr, rkey=self.reader.mr.rkey))
                    posted += 1
                for c in self.writer.cq.wait(1, timeout=30):
                    if c.status != 0:
                        raise RuntimeError(f"a WRITE completed with status {c.status}")
                    self.times.append(time.monotonic())
        except (VrnicError, RuntimeError) as exc:
            self.error = str(exc)

    def mbit(self, start: float, end: float) -> float:
        done = bisect.bisect_left(self.times, end) - bisect.bisect_left(self.times, start)
        return done * WRITE * 8 / (end - start) / 1e6


def start(guests: dict[str, Guest], *tenants: str) -> dict[str, Stream]:
    streams = {tenant: Stream(guests[tenant], guests[f"{tenant}-peer"]) for tenant in tenants}
    for stream in streams.values():
        stream.start()
    return streams


def stop(streams: dict[str, Stream]) -> None:
    for stream in streams.values():
        stream.halt.set()
    for stream in streams.values():
        stream.join(60)
        check(stream.error is None and not stream.is_alive(), f"a stream failed: {stream.error or 'it hung'}")


def window(driver: VerbsDriver, streams: dict[str, Stream], seconds: float) -> Rates:
    """After a warm-up, each stream's rate over `seconds`: its data, and its class's bytes (packet headers too)."""
    time.sleep(WARM_S)
    before, t0 = driver.qos_counters(), time.monotonic()
    time.sleep(seconds)
    after, t1 = driver.qos_counters(), time.monotonic()
    wire = {tenant: (after[tenant]["tx_bytes"] - before[tenant]["tx_bytes"]) * 8 / (t1 - t0) / 1e6
            for tenant in streams}
    return {tenant: (stream.mbit(t0, t1), wire[tenant]) for tenant, stream in streams.items()}


def tc(*args: str) -> list[str]:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
    check(done.returncode == 0, f"tc {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.splitlines()


def rate_line(tenant: str, rates: tuple[float, float], policy: QosPolicy) -> str:
    data, wire = rates
    targets = [(what, mbps) for what, mbps in (("cap", policy.rate_cap_mbps), ("guarantee", policy.guarantee_mbps))
               if mbps]
    shares = ", ".join(f"{wire / mbps:.2f}x its {what} of {mbps} Mbit/s" for what, mbps in targets)
    return (f"{tenant:<7} {data / 8:5.2f} MB/s of data; {wire:5.1f} Mbit/s on the wire = {shares or 'no limit'}, "
            f"{wire / LINK_MBPS:.0%} of the link")


def show_tc(out: Steps, uplink: str) -> None:
    """The HTB classes and u32 filters on the uplink, one line each, with whose they are."""
    owner = {}
    for line in tc("class", "show", "dev", uplink):
        words = line.split()
        owner[words[2]] = "the link" if "root" in words else "acme" if f"ceil {ACME_CAP}Mbit" in line \
            else "globex" if f"rate {GLOBEX_GUARANTEE}Mbit" in line else "?"
        out.say(f"{line.split(' burst')[0]}  <- {owner[words[2]]}")
    filters: list[str] = []
    for line in tc("filter", "show", "dev", uplink):
        if "flowid" in line:
            flow = line.split("flowid")[1].split()[0]
            filters.append(f"filter u32 {line.split(' fh ')[1].split()[0]} -> {flow} ({owner.get(flow, '?')}):")
        elif "match" in line and filters:
            filters[-1] += " " + " ".join(line.split()[1:])
    for line in filters:
        out.say(line)
    out.say("(matches: IP protocol UDP; UDP source port (from the QP numbers) . port 4791; BTH destination QP)")


def run(out: Steps, work: Path) -> None:
    devices = sorted(rdma_devices())
    check(len(devices) >= 2, f"needs two RDMA devices (the lab's pair topology); found {devices or 'none'}")
    uplink = uplink_netdev(devices[0])
    baseline = resource_counts()
    out.title(f"vrnicd with QoS on {devices[0]} (uplink {uplink}, taken as a {LINK_MBPS} Mbit/s link)")
    driver = VerbsDriver(socket_path=work / "vrnicd.sock", qos_link_mbps=LINK_MBPS)
    guests: dict[str, Guest] = {}
    try:
        for n, (tenant, policy) in enumerate(POLICIES.items(), 1):
            for role, device, qos in (("-peer", devices[1], QosPolicy()), ("", devices[0], policy)):
                spec = VrnicSpec(id=tenant + role, tenant=tenant, vpc_id=n, quota=Quota(), qos=qos,
                                 virtual_gid=make_virtual_gid(n, 2 if role else 1))
                guests[tenant + role] = Guest(driver.create_vrnic(spec, device))
            guests[tenant].connect(guests[f"{tenant}-peer"])
            out.say(f"tenant {tenant}: vRNIC {tenant} on {devices[0]} {policy.model_dump(exclude_none=True)}, "
                    f"QP {guests[tenant].qp.qpn} connected to {tenant}-peer on {devices[1]}")
        out.title(f"What vrnicd installed on {uplink} (tc class show, tc filter show)")
        show_tc(out, uplink)
        out.title("Each tenant streams 64 KiB RDMA WRITEs alone for 3 s")
        for tenant in POLICIES:
            streams = start(guests, tenant)
            alone = window(driver, streams, 3.0)[tenant]
            stop(streams)
            out.say(rate_line(tenant, alone, POLICIES[tenant]))
            check(alone[1] <= CAPS[tenant] * 1.15, f"{tenant} alone: {alone[1]:.1f} Mbit/s, more than "
                  f"15 % above its cap of {CAPS[tenant]} Mbit/s")
        out.say("each stays at its cap; globex, with nobody else sending, borrows beyond its guarantee up to it")
        out.title("Both at once for 4 s: the link is shared")
        streams = start(guests, *POLICIES)
        both = window(driver, streams, 4.0)
        stop(streams)
        for tenant, rates in both.items():
            out.say(rate_line(tenant, rates, POLICIES[tenant]))
        out.say(f"together {sum(wire for _, wire in both.values()):.1f} Mbit/s of the {LINK_MBPS} Mbit/s link "
                f"(wire rates from each class's byte counter, driver.qos_counters())")
        for tenant, cap in CAPS.items():
            check(both[tenant][1] <= cap * 1.15, f"{tenant} under contention: {both[tenant][1]:.1f} Mbit/s, more "
                  f"than 15 % above its cap of {cap} Mbit/s")
        check(both["globex"][1] >= GLOBEX_GUARANTEE * 0.9, f"globex under contention: {both['globex'][1]:.1f} Mbit/s,"
              f" below 0.9x its guarantee of {GLOBEX_GUARANTEE} Mbit/s")
        out.title(f"A live change: acme's cap raised to {ACME_RAISED} Mbit/s while it streams")
        streams = start(guests, "acme")
        old = window(driver, streams, 2.5)["acme"]
        driver.set_qos("acme", QosPolicy(rate_cap_mbps=ACME_RAISED))
        raised = [line.split(" burst")[0] for line in tc("class", "show", "dev", uplink)
                  if f"ceil {ACME_RAISED}Mbit" in line]
        check(len(raised) == 1, f"no class with acme's new ceil of {ACME_RAISED} Mbit/s on {uplink}")
        out.say(f"driver.set_qos: the class changed in place: {raised[0]}")
        new = window(driver, streams, 2.5)["acme"]
        stop(streams)
        out.say(f"before: {rate_line('acme', old, POLICIES['acme'])}")
        out.say(f"after:  {rate_line('acme', new, QosPolicy(rate_cap_mbps=ACME_RAISED))}")
        out.say(f"{len(streams['acme'].times)} WRITEs on QP {guests['acme'].qp.qpn} throughout: no error, no reconnect")
        check(new[1] <= ACME_RAISED * 1.15 and new[1] >= old[1] * 1.3, f"the raised cap did not apply: "
              f"{old[1]:.1f} -> {new[1]:.1f} Mbit/s for caps {ACME_CAP} -> {ACME_RAISED}")
        out.say("clean up: the guests close, vrnicd releases the vRNICs")
        for name in list(guests):
            guests.pop(name).close()
            driver.release_vrnic(name)
        left = [line for line in tc("qdisc", "show", "dev", uplink) if "htb 7672:" in line]
        check(not left, f"QoS left on {uplink} after the vRNICs went: {left}")
        out.say(f"tc qdisc show dev {uplink}: no htb 7672: (the qdisc went with the last vRNIC that asked for QoS)")
    finally:
        for guest in guests.values():
            with contextlib.suppress(VrnicError):
                guest.close()
        driver.close()
    final = wait_for(baseline)
    check(final == baseline, f"kernel objects leaked: before {counts_line(baseline)}, after {counts_line(final)}")
    out.say(f"rdma res show: {counts_line(final)} (the baseline from before vrnicd started)")


def main() -> int:
    return run_demo("demo-qos", run)


if __name__ == "__main__":
    sys.exit(main())
