"""QoS enforced on rxe (HTB on the uplink netdev), measured on the lab's pair topology: vRNICs on rxe0 stream
64 KiB RDMA WRITEs (16 in flight) to a peer on rxe1, so their packets leave through veth0 and its qdisc.

The link is made the bottleneck for the sharing records: vrnicd is told it is LINK_MBPS (3 MB/s), below
what rxe does in the lab (10-17 MB/s for one stream; three streams at once share the lab's CPU), so the
rates are ones Soft-RoCE under emulation reaches and the qdisc, not the CPU, decides the shares.

- qos.cap_accuracy: one vRNIC capped at CAP_MBPS alone: achieved / cap (target within 10 %).
- qos.guarantee_under_contention: a vRNIC guaranteed GUARANTEE_MBPS next to two unguaranteed ones, all
  streaming: achieved / guarantee (target >= 0.95).
  Both are rates on the wire, as the qdisc counts them (class byte counters): caps and guarantees are link
  rates. The payload rate is about 7 % lower (headers at a 1024-byte path MTU); both are printed.
- qos.jain_index: three vRNICs, equal weights, no caps, all streaming: Jain's index of their rates
  (target >= 0.95; baseline 1.0, the perfectly fair share).
- qos.enforcement_cost: one uncapped vRNIC with QoS installed (the link set far above rxe's rate) against
  the same vRNIC with no QoS on the device, measured alternately: ratio (target >= 0.95).
Each value is the median of ROUNDS rounds.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness import Record
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.core.qos import jain_index
from vrnic.core.specs import AttachInfo, QosPolicy, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WrOpcode

LINK_MBPS = 24  # 3 MB/s: under what three streams get through rxe and vrnicd in the lab together
CAP_MBPS = 16
GUARANTEE_MBPS = 16
WRITE = 64 * 1024
SECONDS = 3.0
ROUNDS = 3
IN_FLIGHT = 16  # enough that a stream's queue at the qdisc never runs dry (else others borrow its share)


class Streamer:
    """A container guest with one RC QP to the peer, streaming RDMA WRITEs."""

    def __init__(self, info: AttachInfo, peer: Streamer | None = None) -> None:
        self.vrnic_id = info.vrnic_id
        self.ctx = Context.attach(info, 1 << 20)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64)
        self.mr = MR(self.pd, WRITE, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.qps: list[QP] = []
        self.peer = peer

    def connect(self, peer: Streamer) -> None:
        mine, theirs = QP(self.pd, self.cq, self.cq), QP(peer.pd, peer.cq, peer.cq)
        mine.connect(peer.ctx.gid, theirs.qpn)
        theirs.connect(self.ctx.gid, mine.qpn)
        self.qps.append(mine)
        peer.qps.append(theirs)
        self.peer = peer

    def stream(self, seconds: float, result: dict[str, float], key: str) -> None:
        assert self.peer is not None
        qp, sge = self.qps[0], self.mr.sge(0, WRITE)
        posted = done = 0
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            while posted - done < IN_FLIGHT:
                qp.post_send(SendRequest(posted, WrOpcode.RDMA_WRITE, (sge,), remote_addr=self.peer.mr.addr,
                                         rkey=self.peer.mr.rkey))
                posted += 1
            done += len(self.cq.wait(1, timeout=30))
        while done < posted:
            done += len(self.cq.wait(1, timeout=30))
        result[key] = done * WRITE / (time.monotonic() - start) / 1e6

    def close(self) -> None:
        self.ctx.close()


def _together(streamers: dict[str, Streamer], seconds: float = SECONDS) -> dict[str, float]:
    result: dict[str, float] = {}
    threads = [threading.Thread(target=s.stream, args=(seconds, result, k)) for k, s in streamers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def _wire_mbps(driver: VerbsDriver, streamers: dict[str, Streamer]) -> dict[str, float]:
    """Stream all at once; each one's rate on the wire (Mbit/s) from its QoS class's byte counter, read over a
    window in which every stream runs (not while one drains its last WRs and the others have stopped). What
    the qdisc enforces counts headers too (about 7 % on top of the payload at a 1024-byte path MTU)."""
    goodput: dict[str, float] = {}
    threads = [threading.Thread(target=s.stream, args=(SECONDS + 1.0, goodput, k)) for k, s in streamers.items()]
    for t in threads:
        t.start()
    time.sleep(0.5)
    before, t0 = driver.qos_counters(), time.monotonic()
    time.sleep(SECONDS - 0.5)
    after, t1 = driver.qos_counters(), time.monotonic()
    for t in threads:
        t.join()
    wire = {name: (after[s.vrnic_id]["tx_bytes"] - before[s.vrnic_id]["tx_bytes"]) * 8 / (t1 - t0) / 1e6
            for name, s in streamers.items()}
    print(f"  goodput MB/s {({k: round(v, 2) for k, v in goodput.items()})}, "
          f"wire Mbit/s {({k: round(v, 1) for k, v in wire.items()})}")
    return wire


@contextmanager
def _lab(link_mbps: int, policies: dict[str, QosPolicy]) -> Iterator[tuple[VerbsDriver, dict[str, Streamer]]]:
    """A vrnicd with a peer on rxe1 and one vRNIC per policy on rxe0, each connected to the peer."""
    with tempfile.TemporaryDirectory(prefix="vrnic-bench-qos-", dir="/run") as tmp:
        driver = VerbsDriver(socket_path=Path(tmp) / "vrnicd.sock", qos_link_mbps=link_mbps)
        made: list[Streamer] = []
        try:
            serial = iter(range(1, 100))

            def vrnic(device: str, policy: QosPolicy) -> AttachInfo:
                n = next(serial)
                return driver.create_vrnic(VrnicSpec(id=f"b{n}", tenant="bench", vpc_id=1, quota=Quota(),
                                                     virtual_gid=make_virtual_gid(1, 950 + n), qos=policy), device)

            peer = Streamer(vrnic("rxe1", QosPolicy()))
            made.append(peer)
            streamers = {}
            for name, policy in policies.items():
                s = Streamer(vrnic("rxe0", policy))
                made.append(s)
                s.connect(peer)
                streamers[name] = s
            yield driver, streamers
        finally:
            for s in made:
                s.close()
            driver.close()


def run() -> list[Record]:
    cap, guarantee, jain, cost = [], [], [], []
    for _ in range(ROUNDS):
        with _lab(LINK_MBPS, {"capped": QosPolicy(rate_cap_mbps=CAP_MBPS)}) as (d, s):
            cap.append(_wire_mbps(d, s)["capped"] / CAP_MBPS)
        with _lab(LINK_MBPS, {"guaranteed": QosPolicy(guarantee_mbps=GUARANTEE_MBPS), "b": QosPolicy(),
                              "c": QosPolicy()}) as (d, s):
            guarantee.append(_wire_mbps(d, s)["guaranteed"] / GUARANTEE_MBPS)
        # equal weights (2: a weight other than the default is what asks for QoS without a cap or guarantee)
        with _lab(LINK_MBPS, {"x": QosPolicy(weight=2), "y": QosPolicy(weight=2), "z": QosPolicy(weight=2)}) as (_, s):
            rates = _together(s)
            print(f"fair share: {rates}")
            jain.append(jain_index(rates.values()))
        # cost: the same vRNIC alone, with QoS installed (link far above rxe) and without, alternately
        with _lab(100_000, {"free": QosPolicy()}) as (d, s):
            bare, shaped = [], []
            for _ in range(2):
                d.set_qos("b2", QosPolicy())  # asks nothing: no qdisc on the device
                bare.append(_together(s)["free"])
                d.set_qos("b2", QosPolicy(weight=2))  # asks for QoS: the device gets its qdisc and the QP a filter
                shaped.append(_together(s)["free"])
            cost.append(statistics.median(shaped) / statistics.median(bare))
    print(f"qos: cap ratio {cap}, guarantee ratio {guarantee}, jain {jain}, cost {cost}")
    return [
        Record("qos.cap_accuracy", "ratio", statistics.median(cap), 1.0, target=0.10, better="within"),
        Record("qos.guarantee_under_contention", "ratio", statistics.median(guarantee), 1.0, target=0.95,
               better="higher"),
        Record("qos.jain_index", "index", statistics.median(jain), 1.0, target=0.95, better="higher"),
        Record("qos.enforcement_cost", "ratio", statistics.median(cost), 1.0, target=0.95, better="higher"),
    ]
