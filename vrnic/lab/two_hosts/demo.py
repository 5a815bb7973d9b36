"""`make demo-two-hosts`: two lab hosts, one control plane on PostgreSQL, guests connecting by virtual IP.

Run on both guests of `vrnic lab run --topology two-hosts -- python -m vrnic.lab.two_hosts -- python -m
vrnic.lab.two_hosts.demo` (host a drives, host b serves):
1. PostgreSQL on host a; `vrnic db upgrade`; `vrnic daemon` on a and on b, both against it;
2. a tenant and one vRNIC on each host, placed through the API, each with a virtual IP in the tenant's VPC;
3. a guest on b listens on a port; a guest on a knows only b's virtual IP: resolve, connect with private data;
4. SEND and RDMA WRITE across the hosts, the bytes checked on the other side;
5. a guest of another tenant on b is refused (and audited) until both tenants add a peering rule;
6. b's agent is killed with -9: a's API reports b down and its vRNIC unreachable, then b comes back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from vrnic.lab.migrate_demo import Steps, check, run_demo
from vrnic.lab.two_hosts.guest import LocalGuest, RemoteGuest
from vrnic.lab.two_hosts.rig import DOWN_AFTER_S, Rig

PORT = 7471


def _ok(answer: dict[str, Any], what: str) -> dict[str, Any]:
    check("error" not in answer, f"{what}: {answer.get('error')}: {answer.get('message')}")
    return answer


def _hosts(rig: Rig) -> dict[str, str]:
    with rig.client("a") as api:
        return {h["name"]: h["state"] for h in api.get("/hosts").json()["items"]}


def run(out: Steps, _work: Path) -> None:
    out.title("the control plane: PostgreSQL on host a, `vrnic daemon` on both hosts")
    with Rig.start(log=False) as rig:
        t = rig.timings
        out.say(f"PostgreSQL {rig.postgres.addr}:{rig.postgres.port} up in {t['postgres_s']:.0f} s; schema "
                f"migrated in {t['db_upgrade_s']:.0f} s; agents serving after {t['agent_a_s']:.0f} s (a) and "
                f"{t['agent_b_s']:.0f} s (b)")
        with rig.client("b") as api:  # either host's API shows the whole system
            for host in api.get("/hosts").json()["items"]:
                out.say(f"host {host['name']}: {host['state']}, agent at {host['api_url']}")

        out.title("tenant acme: one vRNIC on each host, each with a virtual IP in acme's VPC")
        token = rig.make_tenant("acme")
        vrnics = {host: rig.allocate(host, token) for host in ("a", "b")}
        for v in vrnics.values():
            out.say(f"{v['id']} on host {v['host']} ({v['device']}): virtual IP {v['virtual_ip']}, "
                    f"virtual GID {v['virtual_gid']}")

        guests: dict[str, LocalGuest | RemoteGuest] = {"a": LocalGuest(), "b": RemoteGuest(rig.control)}
        try:
            out.title("a guest on b listens; a guest on a knows only b's virtual IP and connects")
            for host in ("a", "b"):
                _ok(guests[host].call("attach", attach=vrnics[host]["attach"]), f"attach on {host}")
                _ok(guests[host].call("qp"), f"QP on {host}")
            _ok(guests["b"].call("listen", port=PORT), "listen")
            guests["b"].send("accept", timeout=60)
            ip = vrnics["b"]["virtual_ip"]
            gid = _ok(guests["a"].call("resolve", ip=ip), "resolve")["gid"]
            out.say(f"a: resolve({ip}) -> {gid}")
            started = time.perf_counter()
            connected = _ok(guests["a"].call("cm_connect", ip=ip, port=PORT, data="hello from host a"), "connect")
            accepted = _ok(guests["b"].reply(), "accept")
            out.say(f"a: connected to {connected['remote_gid']} QP {connected['remote_qpn']} in "
                    f"{(time.perf_counter() - started) * 1e3:.0f} ms (through both agents)")
            out.say(f"b: accepted {accepted['remote_gid']} with private data {accepted['private_data']!r}")

            out.title("SEND and RDMA WRITE across the hosts, checked on the other side")
            message = os.urandom(200)
            _ok(guests["a"].call("send", hex=message.hex()), "send")
            got = _ok(guests["b"].call("recv", count=1), "recv")["messages"]
            check(got == [message.hex()], "b received other bytes than a sent")
            out.say(f"SEND a -> b: {len(message)} bytes arrived intact")
            written = os.urandom(1500)
            _ok(guests["a"].call("write", hex=written.hex()), "write")
            _ok(guests["b"].call("recv", count=1), "the SEND after the write")
            landed = _ok(guests["b"].call("read", offset=0, length=len(written)), "read")["hex"]
            check(landed == written.hex(), "the RDMA WRITE did not land intact in b's memory")
            out.say(f"RDMA WRITE a -> b: {len(written)} bytes in b's MR, byte for byte")
        finally:
            for guest in guests.values():
                guest.close()

        out.title("another tenant's guest on host b is refused until both tenants peer")
        other = rig.make_tenant("globex")
        intruder = rig.allocate("b", other)
        guests = {"a": LocalGuest(), "b": RemoteGuest(rig.control)}
        try:
            _ok(guests["a"].call("attach", attach=vrnics["a"]["attach"]), "attach on a")
            qpn = _ok(guests["a"].call("qp"), "QP on a")["qpn"]
            _ok(guests["b"].call("attach", attach=intruder["attach"]), "attach on b")
            _ok(guests["b"].call("qp"), "QP on b")
            refused = guests["b"].call("connect_gid", gid=vrnics["a"]["virtual_gid"], qpn=qpn)
            check(refused.get("error") == "NotFound", f"globex reached acme's QP: {refused}")
            out.say(f"globex -> acme: refused ({refused['error']}: looks like no such GID)")
            with rig.client("a") as api:
                event = api.get("/events", params={"action": "peer.refused"}).json()["items"][-1]
            out.say(f"audit: {event['action']} {event['subject']} -> {event['detail']['target']['vrnic_id']} "
                    f"({event['detail'].get('reason')})")
            for tenant_token, peer in ((token, "globex"), (other, "acme")):
                with rig.client("a", tenant_token) as api:
                    check(api.post("/security-rules", json={"action": "allow", "peer_tenant": peer}).status_code
                          == 201, "adding a rule failed")
            out.say("acme allows globex, globex allows acme (cross-VPC peering is two-sided)")
            deadline = time.monotonic() + 10
            while "error" in (answer := guests["b"].call("connect_gid", gid=vrnics["a"]["virtual_gid"], qpn=qpn)):
                check(time.monotonic() < deadline, f"still refused after the rules: {answer}")
                time.sleep(1)
            out.say("globex -> acme: connected")
        finally:
            for guest in guests.values():
                guest.close()

        out.title("host b's agent is killed with -9")
        killed = time.monotonic()
        rig.agents["b"].kill(signal.SIGKILL)
        while _hosts(rig)["b"] != "down":
            check(time.monotonic() - killed < DOWN_AFTER_S + 20, "b was never marked down")
            time.sleep(0.2)
        out.say(f"a's API: host b down after {time.monotonic() - killed:.1f} s (down after {DOWN_AFTER_S:.0f} s "
                f"without a heartbeat)")
        with rig.client("a") as api:
            shown = api.get(f"/vrnics/{vrnics['b']['id']}").json()
        out.say(f"{shown['id']}: state {shown['state']}, reachable {shown['reachable']} (kept, not reallocated)")
        seconds = rig.agents["b"].start()
        while _hosts(rig)["b"] != "up":
            time.sleep(0.2)
        out.say(f"b's agent restarted ({seconds:.0f} s): host b up again")


def main() -> int:
    return run_demo("demo-two-hosts", run)


if __name__ == "__main__":
    sys.exit(main())
