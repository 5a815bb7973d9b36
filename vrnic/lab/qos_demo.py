"""`make demo-qos`: two tenants share a link under their QoS caps (issue 12), on Soft-RoCE inside the lab.

Run inside the lab: `vrnic lab run --topology pair --timeout 600 -- python -m vrnic.lab.qos_demo`.
1. what rxe moves here with nobody shaping: two unshaped streams at once, from rxe0's uplink counter. The
   demo's link is 64 Mbit/s, or 45 % of that measure when rxe moves less (TCG on a slow or busy host), and
   every policy is scaled with it, so the link, not the CPU, is the bottleneck. Under TCG, HTB holding
   classes at their rates costs the CPU about half of what rxe moves unshaped: in the lab on 2026-11-27, 57-68
   Mbit/s unshaped, 43-45 through classes that did not hold anything back, 30-31 in all with the demo's two
   classes held at their rates on a 40 Mbit/s link;
2. vrnicd (in-process verbs driver) told the link's speed; on rxe0 tenant acme (cap 3/8 of the link: 24
   Mbit/s of 64) and tenant globex (guarantee 1/2, cap 5/8: 32 and 40), each with a peer vRNIC on rxe1;
3. what vrnicd installed on rxe0's uplink: an HTB class per vRNIC, a u32 filter per connected QP (tc);
4. each tenant streams 64 KiB RDMA WRITEs alone: each stays at its cap (globex borrows past its guarantee);
5. both at once: globex gets at least its guarantee, and each stays at or below its cap;
6. acme's cap raised live (set_qos, to 3/4 of the link) while it streams on the same connection; then cleanup:
   no qdisc left, the kernel's RDMA objects back at their baseline.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.qos_shaper import uplink_netdev
from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.specs import AttachInfo, QosPolicy, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import VrnicError
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WrOpcode
from vrnic.lab.migrate_demo import Failed, Steps, check, counts_line, run_demo, wait_for  # the demos' shared steps

FULL_LINK_MBPS = 64  # the demo's link when rxe moves more than that (no TCG guest does much more)
LINK_SHARE = 0.45  # of what rxe moved unshaped: a link the CPU keeps up with while HTB holds classes to rates
MIN_LINK_MBPS = 8  # below this the lab is too starved for rates to mean anything: the demo says so
PROBE_S = 2.5
WRITE, IN_FLIGHT, WARM_S = 64 * 1024, 4, 0.5
ACK_TIMEOUT = 17  # 4.096 us * 2^17 = 0.5 s (default 67 ms): packets wait in the shaper, longer under emulation
ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
T = TypeVar("T")
Rates = dict[str, tuple[float, float]]  # tenant -> (data Mbit/s from completions, wire Mbit/s from its class)


@dataclass(frozen=True)
class Plan:
    """The link vrnicd is told of and the tenants' policies, in eighths of it (64 Mbit/s: 24, 32/40, 48)."""

    link_mbps: int
    acme_cap: int  # 3/8
    globex_guarantee: int  # 4/8
    globex_cap: int  # 5/8
    acme_raised: int  # 6/8

    @classmethod
    def for_capacity(cls, unshaped_mbps: float) -> Plan:
        """The plan for a link on which rxe moved unshaped_mbps with nobody shaping; ValueError if too little."""
        link = min(FULL_LINK_MBPS, int(unshaped_mbps * LINK_SHARE))
        if link < MIN_LINK_MBPS:
            raise ValueError(f"rxe moved only {unshaped_mbps:.1f} Mbit/s unshaped here (the lab is starved of CPU); "
                             f"the demo needs {MIN_LINK_MBPS / LINK_SHARE:.0f}")
        return cls(link, *(max(1, round(link * eighths / 8)) for eighths in (3, 4, 5, 6)))

    @property
    def policies(self) -> dict[str, QosPolicy]:
        return {"acme": QosPolicy(rate_cap_mbps=self.acme_cap),
                "globex": QosPolicy(guarantee_mbps=self.globex_guarantee, rate_cap_mbps=self.globex_cap)}

    @property
    def caps(self) -> dict[str, int]:
        return {"acme": self.acme_cap, "globex": self.globex_cap}


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


def sampled(read: Callable[[], T], seconds: float) -> tuple[T, T, float, float]:
    """read() once the streams have warmed up and again `seconds` later, with the times of the two."""
    time.sleep(WARM_S)
    before, t0 = read(), time.monotonic()
    time.sleep(seconds)
    after, t1 = read(), time.monotonic()
    return before, after, t0, t1


def mbit_per_s(octets: int, seconds: float) -> float:
    return octets * 8 / seconds / 1e6


def window(driver: VerbsDriver, streams: dict[str, Stream], seconds: float) -> Rates:
    """After a warm-up, each stream's rate over `seconds`: its data, and its class's bytes (packet headers too)."""
    before, after, t0, t1 = sampled(driver.qos_counters, seconds)
    return {tenant: (stream.mbit(t0, t1), mbit_per_s(after[tenant]["tx_bytes"] - before[tenant]["tx_bytes"], t1 - t0))
            for tenant, stream in streams.items()}


def tc(*args: str) -> list[str]:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
    check(done.returncode == 0, f"tc {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.splitlines()


def rate_line(plan: Plan, tenant: str, rates: tuple[float, float], policy: QosPolicy) -> str:
    data, wire = rates
    targets = [(what, mbps) for what, mbps in (("cap", policy.rate_cap_mbps), ("guarantee", policy.guarantee_mbps))
               if mbps]
    shares = ", ".join(f"{wire / mbps:.2f}x its {what} of {mbps} Mbit/s" for what, mbps in targets)
    return (f"{tenant:<7} {data / 8:5.2f} MB/s of data; {wire:5.1f} Mbit/s on the wire = {shares or 'no limit'}, "
            f"{wire / plan.link_mbps:.0%} of the link")


def show_tc(out: Steps, plan: Plan, uplink: str) -> None:
    """The HTB classes and u32 filters on the uplink, one line each, with whose they are."""
    owner = {}
    for line in tc("class", "show", "dev", uplink):
        words = line.split()
        owner[words[2]] = "the link" if "root" in words else "acme" if f"ceil {plan.acme_cap}Mbit" in line \
            else "globex" if f"rate {plan.globex_guarantee}Mbit" in line else "?"
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


def add_tenants(driver: VerbsDriver, devices: list[str], policies: dict[str, QosPolicy],
                guests: dict[str, Guest]) -> None:
    """Each tenant's vRNIC on devices[0] under its policy and a peer vRNIC on devices[1], their QPs connected
    (into guests as they are made, so that a failure half-way leaves the caller what to close)."""
    for n, (tenant, policy) in enumerate(policies.items(), 1):
        for role, device, qos in (("-peer", devices[1], QosPolicy()), ("", devices[0], policy)):
            spec = VrnicSpec(id=tenant + role, tenant=tenant, vpc_id=n, quota=Quota(), qos=qos,
                             virtual_gid=make_virtual_gid(n, 2 if role else 1))
            guests[tenant + role] = Guest(driver.create_vrnic(spec, device))
        guests[tenant].connect(guests[f"{tenant}-peer"])


def close_tenants(driver: VerbsDriver, guests: dict[str, Guest]) -> None:
    for name in list(guests):
        guests.pop(name).close()
        driver.release_vrnic(name)


def tx_bytes(netdev: str) -> int:
    return int(Path(f"/sys/class/net/{netdev}/statistics/tx_bytes").read_text())


@contextlib.contextmanager
def vrnicd(socket_path: Path, link_mbps: int | None = None) -> Iterator[tuple[VerbsDriver, dict[str, Guest]]]:
    """An in-process vrnicd and the guests to be made on it: any guest still open at the end is closed, then
    vrnicd (which releases what it still holds)."""
    driver = VerbsDriver(socket_path=socket_path, qos_link_mbps=link_mbps)
    guests: dict[str, Guest] = {}
    try:
        yield driver, guests
    finally:
        for guest in guests.values():
            with contextlib.suppress(VrnicError):
                guest.close()
        driver.close()


def unshaped_mbps(work: Path, devices: list[str], uplink: str) -> float:
    """What the two tenants' streams put on the uplink together with no QoS at all (Mbit/s, frames)."""
    with vrnicd(work / "unshaped.sock") as (driver, guests):
        add_tenants(driver, devices, {"acme": QosPolicy(), "globex": QosPolicy()}, guests)
        streams = start(guests, "acme", "globex")
        before, after, t0, t1 = sampled(lambda: tx_bytes(uplink), PROBE_S)
        stop(streams)
        close_tenants(driver, guests)
    return mbit_per_s(after - before, t1 - t0)


def run(out: Steps, work: Path) -> None:
    devices = sorted(rdma_devices())
    check(len(devices) >= 2, f"needs two RDMA devices (the lab's pair topology); found {devices or 'none'}")
    uplink = uplink_netdev(devices[0])
    baseline = resource_counts()
    out.title(f"What rxe moves here unshaped: both tenants stream 64 KiB RDMA WRITEs at once for {PROBE_S} s")
    measured = unshaped_mbps(work, devices, uplink)
    try:
        plan = Plan.for_capacity(measured)
    except ValueError as exc:
        raise Failed(str(exc)) from exc
    out.say(f"{uplink} carried {measured:.1f} Mbit/s (tx_bytes): the demo's link is "
            f"{plan.link_mbps} Mbit/s (at most {FULL_LINK_MBPS}, at most {LINK_SHARE:.0%} of that: shaping at a rate "
            f"costs the emulated CPU), so the link, not the CPU, is the bottleneck; each policy is a share of it")
    policies, caps = plan.policies, plan.caps
    out.title(f"vrnicd with QoS on {devices[0]} (uplink {uplink}, taken as a {plan.link_mbps} Mbit/s link)")
    with vrnicd(work / "vrnicd.sock", plan.link_mbps) as (driver, guests):
        add_tenants(driver, devices, policies, guests)
        for tenant, policy in policies.items():
            out.say(f"tenant {tenant}: vRNIC {tenant} on {devices[0]} {policy.model_dump(exclude_none=True)}, "
                    f"QP {guests[tenant].qp.qpn} connected to {tenant}-peer on {devices[1]}")
        out.title(f"What vrnicd installed on {uplink} (tc class show, tc filter show)")
        show_tc(out, plan, uplink)
        out.title("Each tenant streams 64 KiB RDMA WRITEs alone for 3 s")
        for tenant in policies:
            streams = start(guests, tenant)
            alone = window(driver, streams, 3.0)[tenant]
            stop(streams)
            out.say(rate_line(plan, tenant, alone, policies[tenant]))
            check(alone[1] <= caps[tenant] * 1.15, f"{tenant} alone: {alone[1]:.1f} Mbit/s, more than "
                  f"15 % above its cap of {caps[tenant]} Mbit/s")
        out.say("each stays at its cap; globex, with nobody else sending, borrows beyond its guarantee up to it")
        out.title("Both at once for 4 s: the link is shared")
        streams = start(guests, *policies)
        both = window(driver, streams, 4.0)
        stop(streams)
        for tenant, rates in both.items():
            out.say(rate_line(plan, tenant, rates, policies[tenant]))
        out.say(f"together {sum(wire for _, wire in both.values()):.1f} Mbit/s of the {plan.link_mbps} Mbit/s link "
                f"(wire rates from each class's byte counter, driver.qos_counters())")
        for tenant, cap in caps.items():
            check(both[tenant][1] <= cap * 1.15, f"{tenant} under contention: {both[tenant][1]:.1f} Mbit/s, more "
                  f"than 15 % above its cap of {cap} Mbit/s")
        check(both["globex"][1] >= plan.globex_guarantee * 0.9, f"globex under contention: "
              f"{both['globex'][1]:.1f} Mbit/s, below 0.9x its guarantee of {plan.globex_guarantee} Mbit/s")
        raised_policy = QosPolicy(rate_cap_mbps=plan.acme_raised)
        out.title(f"A live change: acme's cap raised to {plan.acme_raised} Mbit/s while it streams")
        streams = start(guests, "acme")
        old = window(driver, streams, 2.5)["acme"]
        driver.set_qos("acme", raised_policy)
        raised = [line.split(" burst")[0] for line in tc("class", "show", "dev", uplink)
                  if f"ceil {plan.acme_raised}Mbit" in line]
        check(len(raised) == 1, f"no class with acme's new ceil of {plan.acme_raised} Mbit/s on {uplink}")
        out.say(f"driver.set_qos: the class changed in place: {raised[0]}")
        new = window(driver, streams, 2.5)["acme"]
        stop(streams)
        out.say(f"before: {rate_line(plan, 'acme', old, policies['acme'])}")
        out.say(f"after:  {rate_line(plan, 'acme', new, raised_policy)}")
        out.say(f"{len(streams['acme'].times)} WRITEs on QP {guests['acme'].qp.qpn} throughout: no error, no reconnect")
        check(new[1] <= plan.acme_raised * 1.15 and new[1] >= old[1] * 1.3, f"the raised cap did not apply: "
              f"{old[1]:.1f} -> {new[1]:.1f} Mbit/s for caps {plan.acme_cap} -> {plan.acme_raised}")
        out.say("clean up: the guests close, vrnicd releases the vRNICs")
        close_tenants(driver, guests)
        left = [line for line in tc("qdisc", "show", "dev", uplink) if "htb 7672:" in line]
        check(not left, f"QoS left on {uplink} after the vRNICs went: {left}")
        out.say(f"tc qdisc show dev {uplink}: no htb 7672: (the qdisc went with the last vRNIC that asked for QoS)")
    final = wait_for(baseline)
    check(final == baseline, f"kernel objects leaked: before {counts_line(baseline)}, after {counts_line(final)}")
    out.say(f"rdma res show: {counts_line(final)} (the baseline from before vrnicd started)")


def main() -> int:
    return run_demo("demo-qos", run)


if __name__ == "__main__":
    sys.exit(main())
