"""The RoCEv2 packet guard on real rxe (the lab's pair topology): plain pyverbs QPs, no vrnicd.

rxe0 and rxe1 sit on the two ends of a veth, so rxe0 -> rxe1 really passes ip_local_out and netfilter.
Only rxe0's IP is guarded; rxe1's ACKs leave unguarded. Every QP uses a short ack timeout and one retry,
so a packet the guard eats shows up as a retry-exceeded completion within a fraction of a second.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest
import pyverbs.enums as e

import vrnic
from vrnic.backend.packet_guard import PacketGuard
from vrnic.core.roce_guard import GuardFlow
from vrnic.lab.native import RcEndpoint

pytestmark = pytest.mark.kernel

FAST_FAIL = dict(timeout=14, retry_cnt=1)  # 67 ms ack timeout (TCG-safe), one retry
SIZE = 4096
MTU = 1024  # connect_rc's path MTU


def nft(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"nft {' '.join(args)}: {result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def guard_lab(device_pair: tuple[str, str]) -> tuple[str, str]:
    if shutil.which("nft") is None:
        pytest.skip("needs the nft command (Debian package nftables; make setup installs it)")
    if os.geteuid() != 0:
        pytest.skip("needs root for nftables")
    # Loaded up front so a missing module is reported here, not as a confusing nft error later.
    modprobe = subprocess.run(["modprobe", "-a", "nf_tables", "nft_queue"], capture_output=True, text=True)
    probe = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"nftables unusable here: {probe.stderr.strip()} (modprobe: {modprobe.stderr.strip()})")
    version = subprocess.run(["nft", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"\nvrnic from {vrnic.__file__}; {version}; kernel {os.uname().release}; devices {device_pair}")
    return device_pair


@pytest.fixture
def guard() -> Iterator[PacketGuard]:
    g = PacketGuard()
    g.remove()
    yield g
    g.remove()
    assert "vrnic_guard" not in nft("list", "tables")


def ipv4(ep: RcEndpoint) -> str:
    mapped = ipaddress.IPv6Address(ep.gid).ipv4_mapped
    assert mapped is not None, f"{ep.device}: GID {ep.gid} is not IPv4-mapped"
    return str(mapped)


def pair(src: RcEndpoint, dst: RcEndpoint, flow_label: int = 0) -> None:
    src.connect(dst.info(), flow_label=flow_label, **FAST_FAIL)
    dst.connect(src.info(), **FAST_FAIL)


def post_write(src: RcEndpoint, dst: RcEndpoint, payload: bytes) -> None:
    src.mr.write(payload, len(payload), 0)
    src.post_rdma(e.IBV_WR_RDMA_WRITE, dst.info(), len(payload))


def completion(ep: RcEndpoint, timeout: float = 10.0) -> int | None:
    """The status of the next completion, or None if none came within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        npolled, wcs = ep.cq.poll(num_entries=1)
        if npolled:
            return int(wcs[0].status)
        time.sleep(0.001)
    return None


def write(src: RcEndpoint, dst: RcEndpoint, payload: bytes) -> int | None:
    post_write(src, dst, payload)
    return completion(src)


def landed(ep: RcEndpoint) -> bytes:
    return bytes(ep.mr.read(SIZE, 0))


def pattern(seed: int) -> bytes:
    return bytes((seed + 7 * i) % 256 for i in range(SIZE))


def counted(table: str, chain: str) -> int:
    listing = json.loads(nft("-j", "list", "chain", "inet", table, chain))
    return sum(expr["counter"]["packets"] for item in listing["nftables"] if "rule" in item
               for expr in item["rule"]["expr"] if "counter" in expr)


def test_only_allowed_flows_leave_and_revoke_closes_them(guard_lab: tuple[str, str], guard: PacketGuard) -> None:
    dev0, dev1 = guard_lab
    with RcEndpoint(dev0, SIZE) as a, RcEndpoint(dev1, SIZE) as b, RcEndpoint(dev0, SIZE) as a2, \
            RcEndpoint(dev1, SIZE) as b2:
        pair(a, b)
        pair(a2, b2)
        ip0, ip1 = ipv4(a), ipv4(b)
        flow = GuardFlow("v1", ip0, a.qp.qp_num, ip1, b.qp.qp_num)

        guard.install([ip0])
        guard.allow(flow)
        guard.allow(flow)  # again: a no-op
        guard.install([ip0])  # again: converges, and keeps the flow
        assert guard.flows() == [flow]
        assert guard.guarded_ips() == [ip0]
        print(f"\nallowed {flow} (udp sport {flow.sport:#x}); a2 qpn {a2.qp.qp_num} -> b2 qpn {b2.qp.qp_num} not")
        print(nft("list", "table", "inet", "vrnic_guard"))

        started = time.monotonic()
        assert write(a, b, pattern(1)) == e.IBV_WC_SUCCESS
        assert landed(b) == pattern(1)
        allowed_s = time.monotonic() - started

        denied_before = counted("vrnic_guard", "roce")
        started = time.monotonic()
        assert write(a2, b2, pattern(2)) == e.IBV_WC_RETRY_EXC_ERR
        denied_s = time.monotonic() - started
        assert landed(b2) == bytes(SIZE), "a denied WRITE reached b2"
        denied = counted("vrnic_guard", "roce") - denied_before
        # The first try and the one retry, each SIZE / MTU packets; a requester that resends in a loop would
        # count thousands (see the plain-drop test).
        assert denied == 2 * (SIZE // MTU), f"the guard counted {denied} packets"
        print(f"allowed WRITE {allowed_s * 1e3:.0f} ms; denied WRITE: retry exceeded after {denied_s * 1e3:.0f} ms, "
              f"{denied} packets queued to nobody")

        guard.revoke("v1")
        guard.revoke("v1")  # nothing left: a no-op
        assert guard.flows() == []
        assert write(a, b, pattern(3)) == e.IBV_WC_RETRY_EXC_ERR
        assert landed(b) == pattern(1), "a WRITE after revoke reached b"


def test_the_flow_label_picks_the_port(guard_lab: tuple[str, str], guard: PacketGuard) -> None:
    dev0, dev1 = guard_lab
    label = 0x12345
    with RcEndpoint(dev0, SIZE) as a, RcEndpoint(dev1, SIZE) as b, RcEndpoint(dev0, SIZE) as a2, \
            RcEndpoint(dev1, SIZE) as b2:
        pair(a, b, flow_label=label)
        pair(a2, b2, flow_label=label)
        ip0, ip1 = ipv4(a), ipv4(b)
        labelled = GuardFlow("v1", ip0, a.qp.qp_num, ip1, b.qp.qp_num, flow_label=label)
        unlabelled = GuardFlow("v2", ip0, a2.qp.qp_num, ip1, b2.qp.qp_num)  # the port label 0 would give
        assert unlabelled.sport != GuardFlow("v2", ip0, a2.qp.qp_num, ip1, b2.qp.qp_num, flow_label=label).sport
        guard.install([ip0])
        guard.allow(labelled)
        guard.allow(unlabelled)
        assert write(a, b, pattern(4)) == e.IBV_WC_SUCCESS
        assert landed(b) == pattern(4)
        assert write(a2, b2, pattern(5)) == e.IBV_WC_RETRY_EXC_ERR
        assert landed(b2) == bytes(SIZE)


def test_same_device_traffic_never_meets_the_guard(guard_lab: tuple[str, str], guard: PacketGuard) -> None:
    """The gap: rxe loops a packet for its own netdev's MAC back inside the driver (rxe_loopback)."""
    dev0, _ = guard_lab
    with RcEndpoint(dev0, SIZE) as c, RcEndpoint(dev0, SIZE) as d:
        pair(c, d)
        guard.install([ipv4(c)])
        assert guard.flows() == []  # nothing is allowed
        before = counted("vrnic_guard", "roce")
        assert write(c, d, pattern(6)) == e.IBV_WC_SUCCESS
        assert landed(d) == pattern(6)
        assert counted("vrnic_guard", "roce") == before, "the guard saw a same-device packet"


def test_a_plain_drop_spins_the_requester_instead_of_failing_it(guard_lab: tuple[str, str]) -> None:
    """Why the guard queues to nobody instead of dropping.

    A drop makes ip_local_out return an error; rxe then rolls the WQE back and reschedules its requester
    at once (rxe_req.c, -EAGAIN), so it resends in a loop, never times out, and the WRITE lands as soon
    as the drop goes away.
    """
    dev0, dev1 = guard_lab
    table = "vrnic_guard_droptest"
    with RcEndpoint(dev0, SIZE) as a, RcEndpoint(dev1, SIZE) as b:
        pair(a, b)
        try:
            nft("-f", "-", stdin=f"""table inet {table} {{
	chain output {{
		type filter hook output priority filter; policy accept;
		udp dport 4791 ip saddr {ipv4(a)} counter drop
	}}
}}
""")
            post_write(a, b, pattern(7))
            assert completion(a, timeout=2.0) is None, "a dropped WRITE completed"
            spun = counted(table, "output")
        finally:
            nft("-f", "-", stdin=f"table inet {table} {{\n}}\ndelete table inet {table}\n")
        print(f"\nplain drop: {spun} copies of one WRITE dropped in 2 s, no completion; lifting the drop lets it land")
        assert spun > 20
        assert completion(a) == e.IBV_WC_SUCCESS
        assert landed(b) == pattern(7)
