"""QoS enforced on rxe (issue 12): vrnicd's verbs driver with HTB on the uplink of rxe0 (veth0 in the lab's
pair topology, where traffic from rxe0 to rxe1 leaves through veth0 and so meets the qdisc).

Proves on the real thing: a vRNIC's class appears with its policy and every vRNIC on the device gets one;
each connected QP gets a filter (read back with `tc`), which goes with the QP; a cap holds an RDMA WRITE
stream to within 10 %; a live change (set_qos) applies without disconnecting, and the stream goes on at the
new cap; a live cap whose queue would outlast a connected QP's RC timeout is refused, and so is the connect
that would make the queue outlast one; twenty QPs sending at once into a capped class lose no packet in its
queue; drift made with `tc` is put back by reconcile; a guarantee the link cannot give is refused with the
numbers; what arrives for a vRNIC's QPs is counted (an ingress filter per QP); when no vRNIC on the device
asks for QoS any more the qdiscs go. Kernel objects are back to their baseline at the end.

Run: vrnic lab run -e PYTHONPATH=$PWD -- pytest -m kernel tests/kernel/test_qos_rxe.py
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.qos_shaper import uplink_netdev
from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.specs import AttachInfo, QosPolicy, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict
from vrnic.frontend import SendRequest, WrOpcode

from .conftest import wait_for_baseline
from .guest_objects import Guest, connected_pair

pytestmark = pytest.mark.kernel
LINK_MBPS = 400
WRITE = 64 * 1024


def _tc(*args: str) -> str:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"tc {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def _classes(dev: str) -> dict[str, str]:
    """classid -> ceil, for the vRNIC classes (under 7672:1)."""
    found = {}
    for line in _tc("class", "show", "dev", dev).splitlines():
        words = line.split()
        if len(words) > 4 and words[3:5] == ["parent", "7672:1"]:
            found[words[2]] = words[words.index("ceil") + 1]
    return found


def _flows(dev: str) -> list[str]:
    """The flowid of every u32 filter of ours."""
    return [line.split("flowid")[1].split()[0] for line in _tc("filter", "show", "dev", dev).splitlines()
            if "flowid" in line]


def _counted_arrivals(dev: str) -> list[int]:
    """Bytes counted by each receive-counting filter of ours (ingress, a pass action per local QP)."""
    out = _tc("-s", "filter", "show", "dev", dev, "ingress")
    return [int(line.split()[1]) for line in out.splitlines() if line.strip().startswith("Sent ")]


def _stream_mb_per_s(writer: Guest, qp: object, reader: Guest, seconds: float) -> float:
    """RDMA WRITE 64 KiB at a time, 4 in flight, for `seconds`: MB/s."""
    sge = writer.mr.sge(0, WRITE)
    posted = done = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        while posted - done < 4:
            qp.post_send(SendRequest(posted, WrOpcode.RDMA_WRITE, (sge,), remote_addr=reader.mr.addr,  # type: ignore[attr-defined]
                                     rkey=reader.mr.rkey))
            posted += 1
        for c in writer.cq.wait(1, timeout=30):
            assert c.status == 0, c
            done += 1
    while done < posted:
        done += len(writer.cq.wait(1, timeout=30))
    return done * WRITE / (time.monotonic() - start) / 1e6


def _write_at_once(writer: Guest, qps: list[object], reader: Guest, per_qp: int) -> tuple[float, list[Any]]:
    """per_qp 64 KiB RDMA WRITEs on each QP, posted round-robin all at once: (seconds until all completed, the
    completions)."""
    sge = writer.mr.sge(0, WRITE)
    for n in range(per_qp):
        for qp in qps:
            qp.post_send(SendRequest(n, WrOpcode.RDMA_WRITE, (sge,), remote_addr=reader.mr.addr,  # type: ignore[attr-defined]
                                     rkey=reader.mr.rkey))
    started, done = time.monotonic(), []
    while len(done) < per_qp * len(qps):
        done += writer.cq.wait(1, timeout=60)
    return time.monotonic() - started, done


@pytest.fixture
def qos_driver(device_pair: tuple[str, str], tmp_path: Path) -> Iterator[object]:
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    baseline = resource_counts()
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock", direct_containment="best-effort",
                      qos_link_mbps=LINK_MBPS)
    yield drv
    drv.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"


def _make(drv: object, n: int, device: str, qos: QosPolicy) -> AttachInfo:
    spec = VrnicSpec(id=f"qos{n}", tenant="t1", vpc_id=1, quota=Quota(), virtual_gid=make_virtual_gid(1, 800 + n),
                     qos=qos)
    return drv.create_vrnic(spec, device)  # type: ignore[attr-defined, no-any-return]


def test_caps_guarantees_live_changes_and_drift_on_rxe(qos_driver: object, device_pair: tuple[str, str]) -> None:
    drv = qos_driver
    dev = uplink_netdev(device_pair[0])
    peer_info = _make(drv, 1, device_pair[1], QosPolicy())
    # uncapped first: what this lab's rxe does without QoS
    a_info = _make(drv, 2, device_pair[0], QosPolicy())
    assert "htb 7672:" not in _tc("qdisc", "show", "dev", dev)  # nobody asks for QoS: nothing installed
    a, peer = Guest(a_info), Guest(peer_info)
    try:
        # an RC timeout of 18 (1.07 s): the live caps below hold this QP's packets in the queue longer than the
        # usual 14 (67 ms) would cover, and a timeout during queueing breaks the QP on rxe (vrnic.core.qos)
        qa, qpeer = connected_pair(a, peer, rc_timeout=18)
        uncapped = _stream_mb_per_s(a, qa, peer, 2.0)
        print(f"\nuncapped: {uncapped:.1f} MB/s")
        # a cap on a live vRNIC: its connected QP is classified at once, and the stream obeys
        # Well under what rxe does here, doubled too: doubled, the cap is 30% of the uncapped stream. At 25% (50%
        # doubled), one CI run's stream reached 4.5 MB/s under a doubled cap of 6 (uncapped 12.3) while the lab
        # slowed; the same test alone reached 94-95% of each cap.
        cap_mbps = max(8, min(int(uncapped * 8 * 0.15), 200))
        drv.set_qos(a_info.vrnic_id, QosPolicy(rate_cap_mbps=cap_mbps))  # type: ignore[attr-defined]
        assert _classes(dev) == {"7672:10": f"{cap_mbps}Mbit"} and _flows(dev) == ["7672:10"]
        capped = _stream_mb_per_s(a, qa, peer, 3.0)
        print(f"cap {cap_mbps} Mbit/s = {cap_mbps / 8:.1f} MB/s: achieved {capped:.2f} MB/s")
        assert abs(capped * 8 / cap_mbps - 1) <= 0.10, (capped, cap_mbps)
        # a second vRNIC on the device gets a class too (the fair share needs every one), and its QPs filters
        b_info = _make(drv, 3, device_pair[0], QosPolicy(weight=2))
        b = Guest(b_info)
        try:
            qb, _ = connected_pair(b, peer)
            assert set(_classes(dev)) == {"7672:10", "7672:11"} and sorted(_flows(dev)) == ["7672:10", "7672:11"]
            # qb connected at b's share of the link with the usual timeout: a cap whose queue would outlast it
            # is refused with the numbers, and nothing changes
            assert qb.query()["timeout"] == 14
            with pytest.raises(Conflict, match=r"RC timeout \(QP \d+: 14, 67 ms\); rxe would break them"):
                drv.set_qos(b_info.vrnic_id, QosPolicy(rate_cap_mbps=4, weight=2))  # type: ignore[attr-defined]
            assert _classes(dev)["7672:11"] == f"{LINK_MBPS}Mbit"
            # live change while a stream runs: no disconnect, the new cap holds
            drv.set_qos(a_info.vrnic_id, QosPolicy(rate_cap_mbps=cap_mbps * 2))  # type: ignore[attr-defined]
            doubled = _stream_mb_per_s(a, qa, peer, 3.0)
            print(f"cap doubled live: {doubled:.2f} MB/s")
            assert abs(doubled * 8 / (cap_mbps * 2) - 1) <= 0.15 and doubled > capped * 1.5, (doubled, capped)
            # a guarantee the link cannot give is refused, with the numbers; nothing changes
            drv.set_qos(b_info.vrnic_id, QosPolicy(guarantee_mbps=LINK_MBPS - 10, weight=2))  # type: ignore[attr-defined]
            asked = min(20, cap_mbps * 2)
            refusal = rf"sum to {LINK_MBPS - 10 + asked} Mbit/s \({LINK_MBPS - 10} given \+ {asked} asked\)"
            with pytest.raises(Conflict, match=refusal):
                drv.set_qos(a_info.vrnic_id, QosPolicy(rate_cap_mbps=cap_mbps * 2, guarantee_mbps=asked))  # type: ignore[attr-defined]
            assert _classes(dev)["7672:10"] == f"{cap_mbps * 2}Mbit"  # refused: unchanged
            drv.set_qos(b_info.vrnic_id, QosPolicy(weight=2))  # type: ignore[attr-defined]
            # drift: a class and a filter removed by hand come back
            handle = next(line.split("fh")[1].split()[0] for line in _tc("filter", "show", "dev", dev).splitlines()
                          if "flowid 7672:11" in line)
            _tc("filter", "del", "dev", dev, "parent", "7672:", "protocol", "ip", "prio", "10", "handle", handle, "u32")
            _tc("class", "del", "dev", dev, "classid", "7672:11")  # (a class with filters into it cannot go)
            assert drv.reconcile_qos() >= 2  # type: ignore[attr-defined]
            assert set(_classes(dev)) == {"7672:10", "7672:11"} and sorted(_flows(dev)) == ["7672:10", "7672:11"]
            assert drv.reconcile_qos() == 0  # type: ignore[attr-defined]
            counters = drv.qos_counters()  # type: ignore[attr-defined]
            assert counters[a_info.vrnic_id]["tx_bytes"] > 1_000_000, counters
            # what arrives is counted too (an ingress filter per QP): the peer writes 2 MiB into a
            assert len(_counted_arrivals(dev)) == 2  # a's QP and b's
            before = counters[a_info.vrnic_id]
            for n in range(32):
                qpeer.post_send(SendRequest(n, WrOpcode.RDMA_WRITE, (peer.mr.sge(0, WRITE),),
                                            remote_addr=a.mr.addr, rkey=a.mr.rkey))
                assert peer.cq.wait(1, timeout=30)[0].status == 0
            after = drv.qos_counters()[a_info.vrnic_id]  # type: ignore[attr-defined]
            arrived = after["rx_bytes"] - before["rx_bytes"]
            print(f"received: {arrived} bytes in {after['rx_packets'] - before['rx_packets']} packets "
                  f"for {32 * WRITE} bytes written")
            assert 32 * WRITE <= arrived <= 32 * WRITE * 1.2, (before, after)  # payload + headers
            assert after["tx_bytes"] - before["tx_bytes"] < 32 * WRITE // 10  # a only acknowledged
            # a QP that goes takes its filter
            qb.close()
            b.qps.remove(qb)
            assert _flows(dev) == ["7672:10"] and len(_counted_arrivals(dev)) == 1
        finally:
            b.close()
        drv.release_vrnic(b_info.vrnic_id)  # type: ignore[attr-defined]
        assert set(_classes(dev)) == {"7672:10"}
        drv.set_qos(a_info.vrnic_id, QosPolicy())  # type: ignore[attr-defined]
        qdiscs = _tc("qdisc", "show", "dev", dev)
        assert "htb 7672:" not in qdiscs and "ingress" not in qdiscs  # nobody asks any more: the qdiscs go
        again = _stream_mb_per_s(a, qa, peer, 1.0)
        assert again > capped * 1.3, (again, capped)  # and the QP, connected all along, runs free again
    finally:
        a.close()
        peer.close()


def test_rc_qps_join_a_capped_class_while_their_queue_stays_within_every_timeout(
        qos_driver: object, device_pair: tuple[str, str]) -> None:
    """Each RC QP connected into a capped class adds its packets in flight to the queue all of them wait in,
    and a connected QP's timeout cannot change. At 8 Mbit/s one QP's 65 packets wait 73 ms, so the first QP is
    connected at 17 (537 ms: four times that, rounded up) and the eighth QP would make it wait 581 ms: that
    connect is refused, with the numbers. The seven connected then all write at once, and none breaks."""
    drv = qos_driver
    peer_info = _make(drv, 4, device_pair[1], QosPolicy())
    c_info = _make(drv, 5, device_pair[0], QosPolicy(rate_cap_mbps=8))
    c, peer = Guest(c_info), Guest(peer_info)
    try:
        mine: list[object] = []
        for _ in range(7):
            qc, _qp = connected_pair(c, peer)
            mine.append(qc)
        assert mine[0].query()["timeout"] == 17  # type: ignore[attr-defined]
        late, late_peer = c.qp(), peer.qp()
        with pytest.raises(Conflict, match=rf"connecting RC QP {late.qpn} would .* wait 581 ms .* \(QP "
                                           rf"{mine[0].qpn}: 17, 537 ms\)"):  # type: ignore[attr-defined]
            late.connect(peer.ctx.gid, late_peer.qpn)
        assert late.query()["state"] == "rtr"
        # all seven at once, each with more packets posted than rxe lets fly: the queue holds 7 x 65
        per_qp = 3
        took, done = _write_at_once(c, mine, peer, per_qp)
        print(f"\n7 QPs x {per_qp} x 64 KiB at 8 Mbit/s: {took:.1f} s, statuses {sorted({w.status for w in done})}")
        assert all(w.status == 0 for w in done), [w for w in done if w.status]
        assert took > per_qp * len(mine) * WRITE * 8 / 8e6 * 0.9  # the cap held them back
    finally:
        c.close()
        peer.close()


def _leaf_drops(dev: str) -> dict[str, int]:
    """parent class -> packets its pfifo queue dropped (`tc -s qdisc`)."""
    drops, parent = {}, None
    for line in _tc("-s", "qdisc", "show", "dev", dev).splitlines():
        words = line.split()
        if words[:2] == ["qdisc", "pfifo"] and len(words) > 4 and words[3] == "parent":
            parent = words[4]
        elif parent is not None and words[:1] == ["Sent"]:
            drops[parent] = int(words[words.index("(dropped") + 1].rstrip(","))
            parent = None
    return drops


def test_twenty_rc_qps_sending_at_once_into_a_capped_class_lose_no_packet(
        qos_driver: object, device_pair: tuple[str, str]) -> None:
    """rxe keeps 65 packets of each QP in flight; 20 QPs of one class then queue 1300 packets, past the 1000 of
    HTB's own leaf queue (the netdev's txqueuelen): before vrnicd gave each class a pfifo of its own, this very
    load lost 21,419 packets there, each sent again after a sequence NAK. Now nothing is dropped, every WRITE
    completes, at the cap's pace."""
    drv = qos_driver
    dev = uplink_netdev(device_pair[0])
    peer_info = _make(drv, 6, device_pair[1], QosPolicy())
    c_info = _make(drv, 7, device_pair[0], QosPolicy(rate_cap_mbps=24))
    c, peer = Guest(c_info), Guest(peer_info)
    try:
        # an RC timeout of 18 (1.07 s) covers the 485 ms 20 QPs' packets wait at 24 Mbit/s: no connect is refused
        mine = [connected_pair(c, peer, rc_timeout=18)[0] for _ in range(20)]
        assert _leaf_drops(dev) == {"7672:10": 0}
        per_qp = 8  # long enough that every QP keeps its 65 in flight
        took, done = _write_at_once(c, mine, peer, per_qp)
        print(f"\n20 QPs x {per_qp} x 64 KiB at 24 Mbit/s: {took:.1f} s, drops {_leaf_drops(dev)}")
        assert all(w.status == 0 for w in done), [w for w in done if w.status]
        assert _leaf_drops(dev) == {"7672:10": 0}
        assert took < per_qp * len(mine) * WRITE * 8 / 24e6 * 5  # about the cap's pace: no stall
    finally:
        c.close()
        peer.close()


def test_a_daemon_killed_while_shaping_leaves_no_tc_behind_and_shapes_again_after_restart(
        device_pair: tuple[str, str], tmp_path: Path) -> None:
    """`vrnic daemon` killed with -9 while a capped vRNIC's QP is shaped: its qdisc, class and filter outlive it.
    The restarted daemon removes what nobody wants any more (set difference at start), holds the vRNIC again
    with its policy (its class comes back, with no filter: its QP died with the old process), and once the
    guest attaches again with its token and reconnects, the new QP is classified under the same cap."""
    import httpx

    from vrnic.lab.kill_storm import KillStorm

    dev = uplink_netdev(device_pair[0])
    baseline = resource_counts()
    storm = KillStorm(tmp_path, device_pair, port=8483, say=print)
    storm.env["VRNIC_QOS_LINK_MBPS"] = str(LINK_MBPS)
    guests: list[Guest] = []
    try:
        storm.prepare()
        storm.start_daemon()
        token = storm.api.post("/tenants", json={"name": "shaped"}).raise_for_status().json()["token"]
        tenant = httpx.Client(base_url=f"{storm.url}/api/v1", headers={"Authorization": f"Bearer {token}"},
                              timeout=60)
        capped = tenant.post("/vrnics", json={"device": device_pair[0], "qos": {"rate_cap_mbps": 100}})
        free = tenant.post("/vrnics", json={"device": device_pair[1]})
        infos = [AttachInfo(**r.raise_for_status().json()["attach"]) for r in (capped, free)]
        guests = [Guest(infos[0]), Guest(infos[1])]
        connected_pair(guests[0], guests[1])
        assert _classes(dev) == {"7672:10": "100Mbit"} and _flows(dev) == ["7672:10"]
        capped_url = f"/vrnics/{capped.json()['id']}"
        deadline = time.monotonic() + 30
        while tenant.get(capped_url).json()["state"] != "attached":  # vrnicd reports the attach on its own time
            assert time.monotonic() < deadline, tenant.get(capped_url).json()
            time.sleep(0.2)
        storm.kill()
        assert "htb 7672:" in _tc("qdisc", "show", "dev", dev) and _flows(dev) == ["7672:10"]  # left behind
        for guest in guests:  # their vrnicd is gone: only the frontend's side is left to close
            for obj in (*guest.qps, guest.mr, guest.cq, guest.pd, guest.ctx):
                with contextlib.suppress(Exception):
                    obj.close()
        guests = []
        storm.start_daemon()
        assert _classes(dev) == {"7672:10": "100Mbit"}  # the vRNIC, held again, with its policy
        assert _flows(dev) == []  # the dead QP's filter went with the dead daemon's qdisc
        assert tenant.get(capped_url).json()["state"] == "lost"  # its guest went with the old process
        guests = [Guest(infos[0]), Guest(infos[1])]  # the same tokens attach again
        connected_pair(guests[0], guests[1])
        assert _classes(dev) == {"7672:10": "100Mbit"} and _flows(dev) == ["7672:10"]
        for guest in guests:
            guest.close()
        guests = []
        for made in (capped, free):
            assert tenant.delete(f"/vrnics/{made.json()['id']}").status_code == 200
        assert "htb 7672:" not in _tc("qdisc", "show", "dev", dev)  # nobody asks any more
        tenant.close()
    finally:
        for guest in guests:
            with contextlib.suppress(Exception):
                guest.close()
        storm.stop()
    assert wait_for_baseline(baseline) == baseline
