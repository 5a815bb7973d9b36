"""Issue 13 on two real hosts: guests on different hosts connect by virtual IP, tenants are kept apart until
they peer, and the data path rides out a PostgreSQL restart.

Each test allocates through the REST API (placed with host=), drives one guest program per host
(vrnic.lab.two_hosts.guest: the guest library on its host's vRNIC) and checks bytes, API state and the
audit log.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from vrnic.lab.two_hosts.guest import LocalGuest, RemoteGuest
from vrnic.lab.two_hosts.rig import DOWN_AFTER_S, Rig

from .support import events, eventually, ok, release

Guests = dict[str, LocalGuest | RemoteGuest]
PORT = 7471


@pytest.fixture
def guests(rig: Rig) -> Iterator[dict[str, LocalGuest | RemoteGuest]]:
    """A guest program on each host (vrnic.lab.two_hosts.guest), killed afterwards."""
    made: dict[str, LocalGuest | RemoteGuest] = {"a": LocalGuest(), "b": RemoteGuest(rig.control)}
    yield made
    for guest in made.values():
        guest.close()


def connect_by_ip(rig: Rig, guests: Guests, listener: str, vrnics: dict[str, dict[str, Any]],
                  data: str) -> dict[str, Any]:
    """listener's guest listens on PORT; the other one resolves the listener's virtual IP and connects."""
    connector = "a" if listener == "b" else "b"
    for host in ("a", "b"):
        ok(guests[host].call("attach", attach=vrnics[host]["attach"]))
        ok(guests[host].call("qp"))
    ok(guests[listener].call("listen", port=PORT))
    guests[listener].send("accept", timeout=60)  # answered once the connector's request arrives
    ip = vrnics[listener]["virtual_ip"]
    assert ok(guests[connector].call("resolve", ip=ip))["gid"] == vrnics[listener]["virtual_gid"]
    connected = ok(guests[connector].call("cm_connect", ip=ip, port=PORT, data=data))
    accepted = ok(guests[listener].reply())
    assert connected["remote_gid"] == vrnics[listener]["virtual_gid"]
    assert accepted["remote_gid"] == vrnics[connector]["virtual_gid"]
    assert accepted["private_data"] == data
    return accepted


def test_guests_on_two_hosts_connect_by_virtual_ip_send_and_write(rig: Rig, guests: Guests) -> None:
    token = rig.make_tenant("acme")
    vrnics = {host: rig.allocate(host, token) for host in ("a", "b")}
    assert vrnics["a"]["virtual_ip"] != vrnics["b"]["virtual_ip"]
    try:
        connect_by_ip(rig, guests, "b", vrnics, data="hello from a")
        message = os.urandom(200)
        ok(guests["a"].call("send", hex=message.hex()))  # a -> b SEND, across the link
        assert ok(guests["b"].call("recv", count=1))["messages"] == [message.hex()]
        written = os.urandom(1500)
        ok(guests["a"].call("write", hex=written.hex(), offset=16))  # RDMA WRITE into b's MR, then "written"
        assert ok(guests["b"].call("recv", count=1))["messages"] == [b"written".hex()]
        assert ok(guests["b"].call("read", offset=16, length=len(written)))["hex"] == written.hex()
        reply = os.urandom(64)
        ok(guests["b"].call("send", hex=reply.hex()))  # and back
        assert ok(guests["a"].call("recv", count=1))["messages"] == [reply.hex()]
    finally:
        for guest in guests.values():
            guest.close()
        release(rig, *vrnics.values())


def test_ud_datagrams_cross_hosts_by_virtual_gid_and_qpn_and_name_their_source_virtually(
        rig: Rig, guests: Guests) -> None:
    """UD across the link: each guest sends to the other's virtual GID and virtual QPN (its agent resolves the
    destination through the control plane, same tenant only); the receiver sees the sender's virtual QPN."""
    token = rig.make_tenant("datagrams")
    vrnics = {host: rig.allocate(host, token) for host in ("a", "b")}
    try:
        for host in ("a", "b"):
            ok(guests[host].call("attach", attach=vrnics[host]["attach"]))
        qpns = {host: ok(guests[host].call("ud_qp"))["qpn"] for host in ("a", "b")}
        for sender, receiver in (("a", "b"), ("b", "a")):
            for _ in range(3):
                message = os.urandom(200)
                sent = ok(guests[sender].call("ud_send", gid=vrnics[receiver]["virtual_gid"], qpn=qpns[receiver],
                                              hex=message.hex()))
                assert sent["statuses"] == [0], (sender, sent)
                got = ok(guests[receiver].call("ud_recv", count=1))["datagrams"]
                assert got == [{"src_qp": qpns[sender], "hex": message.hex()}], (sender, got)
    finally:
        for guest in guests.values():
            guest.close()
        release(rig, *vrnics.values())


def test_other_tenant_on_other_host_refused_and_audited_then_peering_allows(rig: Rig, guests: Guests) -> None:
    tokens = {"a": rig.make_tenant("initech"), "b": rig.make_tenant("umbrella")}
    vrnics = {host: rig.allocate(host, tokens[host]) for host in ("a", "b")}
    try:
        for host in ("a", "b"):
            ok(guests[host].call("attach", attach=vrnics[host]["attach"]))
        qpn = {host: ok(guests[host].call("qp"))["qpn"] for host in ("a", "b")}
        refused = guests["b"].call("connect_gid", gid=vrnics["a"]["virtual_gid"], qpn=qpn["a"])
        assert refused.get("error") == "NotFound", refused  # looks exactly like a GID that does not exist
        # VPC address spaces overlap: a's address, asked in b's VPC, is at most b's own neighbour, never a.
        resolved = guests["b"].call("resolve", ip=vrnics["a"]["virtual_ip"])
        assert resolved.get("gid") != vrnics["a"]["virtual_gid"], resolved
        if vrnics["a"]["virtual_ip"] == vrnics["b"]["virtual_ip"]:
            assert resolved.get("gid") == vrnics["b"]["virtual_gid"], resolved
        audited = eventually(lambda: [e for e in events(rig, "peer.refused")
                                      if e["subject"] == f"vrnic/{vrnics['b']['id']}"], timeout=10)
        assert audited, "the refusal is not in the audit log"
        assert audited[-1]["detail"]["target"]["vrnic_id"] == vrnics["a"]["id"]
        assert audited[-1]["tenant"] == "umbrella"

        # Peering is explicit on both sides: one allow is not enough.
        for host, peer in (("a", "umbrella"), ("b", "initech")):
            with rig.client(host, tokens[host]) as api:
                made = api.post("/security-rules", json={"action": "allow", "peer_tenant": peer})
            assert made.status_code == 201, made.text
            if host == "a":
                time.sleep(1.5)  # past the agents' rule cache
                still = guests["b"].call("connect_gid", gid=vrnics["a"]["virtual_gid"], qpn=qpn["a"])
                assert still.get("error") == "NotFound", still
        connected = eventually(lambda: "error" not in guests["b"].call(
            "connect_gid", gid=vrnics["a"]["virtual_gid"], qpn=qpn["a"]), timeout=10, every=1.0)
        assert connected, "the two-sided peering rule did not let b's guest connect"
        ok(guests["a"].call("connect_gid", gid=vrnics["b"]["virtual_gid"], qpn=qpn["b"]))
        message = os.urandom(128)
        ok(guests["b"].call("send", hex=message.hex()))
        assert ok(guests["a"].call("recv", count=1))["messages"] == [message.hex()]
        allowed = eventually(lambda: events(rig, "peer.allowed"), timeout=10)
        assert any(e["detail"]["target"]["vrnic_id"] in (vrnics["a"]["id"], vrnics["b"]["id"]) for e in allowed)
    finally:
        for guest in guests.values():
            guest.close()
        release(rig, *vrnics.values())




def lost(rig: Rig, host: str, before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What host's API shows differently from before (id -> (then, now)), or why it cannot say."""
    with rig.client(host) as api:
        listed = api.get("/vrnics", params={"limit": 500})
    if listed.status_code != 200:
        return {"status": listed.status_code, "body": listed.text[:300]}
    now = {v["id"]: v for v in listed.json()["items"]}
    keys = ("state", "host", "virtual_ip", "virtual_gid")
    return {i: ({k: v.get(k) for k in keys}, now.get(i) and {k: now[i].get(k) for k in keys})
            for i, v in before.items() if now.get(i) is None or any(now[i].get(k) != v.get(k) for k in keys)}


def allocations_audited(rig: Rig, vrnics: Iterable[dict[str, Any]]) -> set[str]:
    """The subjects of the vrnic.allocate events of these vRNICs that the audit log holds."""
    with rig.client("a") as api:
        return {e["subject"] for v in vrnics
                for e in api.get("/events", params={"action": "vrnic.allocate", "subject": f"vrnic/{v['id']}"}
                                 ).json()["items"]}


@dataclass
class Writes:
    answers: list[tuple[int, str]] = field(default_factory=list)  # (status, vRNIC id or text); 0: no answer
    made: set[str] = field(default_factory=set)  # allocations answered 201, or 200 on a replay of one
    released: set[str] = field(default_factory=set)  # of those, the ones whose DELETE answered 200


@contextlib.contextmanager
def writes_through(rig: Rig, token: str) -> Iterator[Writes]:
    """A thread allocating on a and releasing what it got, over and over, while the body runs; a 503 is
    retried as Retry-After says, an allocation with the same Idempotency-Key (what a client of this API does)."""
    writes = Writes()
    stop = threading.Event()

    def until_answered(call: Callable[[], httpx.Response]) -> httpx.Response:
        while True:
            answer = call()
            writes.answers.append((answer.status_code, answer.json().get("id") or answer.text[:200]))
            if answer.status_code != 503 or stop.is_set():
                return answer
            time.sleep(float(answer.headers.get("retry-after", "1")))

    def loop() -> None:
        with rig.client("a", token, timeout=60) as api:
            while not stop.is_set():
                key = {"Idempotency-Key": uuid.uuid4().hex}  # a retried allocation is the same allocation
                try:
                    made = until_answered(lambda key=key: api.post("/vrnics", json={"device": "rxe0", "host": "a"},
                                                                   headers=key))
                    if made.status_code in (200, 201):
                        vrnic_id = made.json()["id"]
                        writes.made.add(vrnic_id)
                        if until_answered(lambda v=vrnic_id: api.delete(f"/vrnics/{v}")).status_code == 200:
                            writes.released.add(vrnic_id)
                except httpx.HTTPError as exc:
                    writes.answers.append((0, repr(exc)))
                stop.wait(0.1)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        yield writes
    finally:
        stop.set()
        worker.join(120)


def test_postgres_restarted_in_use_agents_reconnect_nothing_lost(rig: Rig, guests: Guests) -> None:
    token = rig.make_tenant("durable")
    vrnics = {host: rig.allocate(host, token) for host in ("a", "b")}
    try:
        connect_by_ip(rig, guests, "a", vrnics, data="before the restart")

        def settled() -> dict[str, dict[str, Any]] | None:
            """The listing once both guests' attaches are recorded (each agent records what it observes)."""
            with rig.client("a") as api:
                listed = {v["id"]: v for v in api.get("/vrnics", params={"limit": 500}).json()["items"]}
            return listed if all(listed[v["id"]]["state"] == "attached" for v in vrnics.values()) else None

        before = eventually(settled, timeout=30)
        assert before, "the guests' attaches were not recorded"
        audited = allocations_audited(rig, vrnics.values())
        assert audited == {f"vrnic/{v['id']}" for v in vrnics.values()}
        for mode in ("fast", "immediate"):
            with writes_through(rig, token) as writes:  # allocations and releases in flight meanwhile
                rig.postgres.restart(mode)  # every agent's database connection is cut
                time.sleep(2.0)  # and a few more writes once it is back
            statuses = {status for status, _ in writes.answers}
            assert statuses <= {200, 201, 503}, writes.answers  # done, or a clean "retry", never a bare 500
            assert 201 in statuses and writes.released, writes.answers  # writes went through after the restart
            with rig.client("a") as api:
                live = {v["id"] for v in api.get("/vrnics", params={"limit": 500, "tenant": "durable"}).json()["items"]
                        if v["state"] != "released"}
            unreleased = writes.made - writes.released
            assert live == {v["id"] for v in vrnics.values()} | unreleased, (mode, live, writes)
            release(rig, *({"id": i} for i in unreleased))
            message = os.urandom(100)  # the data path never needed the database
            ok(guests["b"].call("send", hex=message.hex()))
            assert ok(guests["a"].call("recv", count=1))["messages"] == [message.hex()]
            for host in ("a", "b"):  # each API answers from the database again, with the same state
                assert eventually(lambda host=host: not lost(rig, host, before), timeout=30, every=1.0), \
                    (mode, host, lost(rig, host, before))
            with rig.client("a") as api:  # both hosts beat again (they reconnected)
                up = eventually(lambda api=api: {h["name"] for h in api.get("/hosts").json()["items"]
                                                 if h["state"] == "up"} >= {"a", "b"}, timeout=DOWN_AFTER_S + 10)
            assert up, "an agent did not beat again after the restart"
        extra = rig.allocate("b", token)  # writes work again, through either API
        release(rig, extra)
        assert allocations_audited(rig, vrnics.values()) == audited  # the audit log kept its past
    finally:
        for guest in guests.values():
            guest.close()
        release(rig, *vrnics.values())
