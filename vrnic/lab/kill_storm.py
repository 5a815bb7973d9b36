"""Kill storm (lab only): `vrnic daemon` killed with SIGKILL at random points under guest traffic, restarted,
and checked after every restart.

A guest pair keeps RC round trips going between two paravirtual vRNICs on two rxe devices; when its vrnicd
dies it gets ChannelLost, attaches again with the same tokens and rebuilds its objects. Meanwhile each round
runs one kill point (allocate, attach, create_qp, connect, release, token re-issue, and, with netdevsim VFs,
SR-IOV allocate/release and a forced VF count change) in a thread and kills the daemon a random moment into it.

check() compares the database (REST), vrnicd (the /agent/v1 routes), the kernel (`rdma res`: who owns each
object) and netlink (`ip -j -d link`: the VFs' settings) and returns every disagreement as a sentence.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vrnic.errors import LabError
from vrnic.lab.health import health

PROJECT = Path(__file__).resolve().parents[2]
KILL_POINTS = ("allocate", "attach", "create_qp", "connect", "release", "reissue", "sriov", "num_vfs", "idle")
CLEAN_MAC, ARENA = "00:00:00:00:00:00", 1 << 20


@dataclass
class StormResult:
    kills: int = 0
    restarts: int = 0
    disagreements: list[str] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)  # SIGKILL -> the new daemon answers
    kill_points: dict[str, int] = field(default_factory=dict)
    guest_rebuilds: int = 0
    guest_round_trips: int = 0

    @property
    def mean_recovery_s(self) -> float:
        return sum(self.recovery_s) / len(self.recovery_s) if self.recovery_s else 0.0


class _Guest(threading.Thread):
    """Two attached vRNICs doing RC SEND round trips; on any error (vrnicd died) it attaches again and rebuilds.
    quiet() parks it attached between round trips, so a check sees a steady state."""

    def __init__(self, infos: list[dict[str, Any]], healthy: Callable[[], bool]) -> None:
        super().__init__(daemon=True, name="kill-storm-guest")
        self.infos, self.healthy = infos, healthy
        self.stop, self.park, self.parked = threading.Event(), threading.Event(), threading.Event()
        self.rebuilds = self.round_trips = 0
        self.nic_qps = 0  # QPs of its attachment on the NIC: its pair and its contexts' spare ones (pre-setup)
        self.error: str | None = None

    def run(self) -> None:
        from vrnic.core.specs import AttachInfo
        from vrnic.frontend import CQ, MR, PD, QP, Access, Context, RecvRequest, SendRequest, VrnicError, WrOpcode

        first = True
        while not self.stop.is_set():
            if not first:
                self.rebuilds += 1
                while not self.stop.is_set() and not self.healthy():
                    time.sleep(0.1)
            first = False
            try:
                with Context.attach(AttachInfo(**self.infos[0]), ARENA) as ca, \
                        Context.attach(AttachInfo(**self.infos[1]), ARENA) as cb:
                    access = Access.LOCAL_WRITE | Access.REMOTE_WRITE
                    pa, pb = PD(ca), PD(cb)
                    cqa, cqb = CQ(ca, 16), CQ(cb, 16)
                    mra, mrb = MR(pa, 4096, access), MR(pb, 4096, access)
                    qa, qb = QP(pa, cqa, cqa), QP(pb, cqb, cqb)
                    qa.connect(cb.gid, qb.qpn)
                    qb.connect(ca.gid, qa.qpn)
                    self.nic_qps = 2 + ca.spare_qp_count + cb.spare_qp_count
                    here = 0  # round trips on this attachment: it parks only once traffic flowed again
                    while not self.stop.is_set():
                        if self.park.is_set() and here:
                            self.parked.set()
                            time.sleep(0.05)
                            continue
                        self.parked.clear()
                        qb.post_recv(RecvRequest(1, (mrb.sge(0, 64),)))
                        mra.write(b"storm" + bytes(59))
                        qa.post_send(SendRequest(1, WrOpcode.SEND, (mra.sge(0, 64),)))
                        if cqa.wait(1)[0].status != 0 or cqb.wait(1)[0].status != 0 or mrb.read(5) != b"storm":
                            self.error = "a round trip completed with an error or wrong bytes"
                        self.round_trips += 1
                        here += 1
            except VrnicError:
                self.parked.clear()
                continue
            except Exception as exc:  # noqa: BLE001 - anything else ends the guest, reported by the storm
                self.error = f"guest failed: {exc!r}"
                return


class KillStorm:
    def __init__(self, workdir: Path, devices: tuple[str, str], *, pf: str | None = None, seed: int = 0,
                 port: int = 8479, say: Callable[[str], None] = lambda _: None) -> None:
        self.workdir, self.devices, self.pf, self.say = workdir, devices, pf, say
        self.rng = random.Random(seed)
        self.token = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{port}"
        # the database and the socket on a local filesystem (SQLite over the lab's 9p share gives I/O errors);
        # workdir keeps the daemon's log
        self.state = Path(tempfile.mkdtemp(prefix="vrnic-storm-"))
        self.env = {**os.environ, "VRNIC_STATE_DIR": str(self.state), "VRNIC_OPERATOR_TOKEN": self.token,
                    "VRNIC_LISTEN_PORT": str(port), "VRNIC_SRIOV_DRIVER": "sriov" if pf else "",
                    "VRNIC_SRIOV_RECONCILE_INTERVAL": "0", "VRNIC_QOS_RECONCILE_INTERVAL": "0",
                    "VRNIC_HEARTBEAT_INTERVAL_S": "3600", "PYTHONPATH": str(PROJECT),
                    "VRNIC_PARAVIRTUAL_DRIVER_OPTIONS": json.dumps({"socket_path": str(self.state / "vrnicd.sock"),
                                                                    "devices": list(devices)})}
        auth = {"Authorization": f"Bearer {self.token}"}
        self.api = httpx.Client(base_url=f"{self.url}/api/v1", headers=auth, timeout=60)
        self.agent = httpx.Client(base_url=f"{self.url}/agent/v1", headers=auth, timeout=60)
        self.daemon: subprocess.Popen[bytes] | None = None
        self.dead_pids: set[int] = set()
        self.tenant: httpx.Client | None = None
        self.extras: list[str] = []  # vRNICs the kill points allocate and release
        self.result = StormResult()

    # ----- the daemon --------------------------------------------------------------------------
    def start_daemon(self, timeout: float = 400) -> float:
        """Start `vrnic daemon`; the monotonic time it first answered. The timeout stays under the lab's hang
        watch (10 min without progress), so a daemon that never answers fails the test with its log."""
        log = (self.workdir / "daemon.log").open("ab")
        self.daemon = subprocess.Popen([sys.executable, "-m", "vrnic.cli.main", "daemon"], env=self.env,
                                       stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.daemon.poll() is not None:
                raise LabError(f"vrnic daemon exited ({self.daemon.returncode}): "
                               f"{(self.workdir / 'daemon.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise LabError(f"vrnic daemon did not answer within {timeout:.0f} s: "
                               f"{(self.workdir / 'daemon.log').read_text()[-3000:]}")
            time.sleep(0.05)
        return time.monotonic()

    def healthy(self) -> bool:
        return health(self.url) is not None

    def kill(self) -> float:
        assert self.daemon is not None
        self.dead_pids.add(self.daemon.pid)
        os.kill(self.daemon.pid, signal.SIGKILL)
        killed = time.monotonic()
        self.daemon.wait(30)
        return killed

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
        self.api.close()
        self.agent.close()
        if self.tenant is not None:
            self.tenant.close()
        shutil.rmtree(self.state, ignore_errors=True)

    # ----- the storm ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """The state dir and an upgraded database, before the first start."""
        self.state.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "vrnic.cli.main", "db", "upgrade"], env=self.env, check=True,
                       capture_output=True, timeout=300)

    def run(self, kills: int) -> StormResult:
        self.prepare()
        self.start_daemon()
        token = self.api.post("/tenants", json={"name": "storm"}).raise_for_status().json()["token"]
        self.tenant = httpx.Client(base_url=f"{self.url}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                   timeout=60)
        infos = [self.tenant.post("/vrnics", json={"device": d}).raise_for_status().json()["attach"]
                 for d in self.devices]
        guest = _Guest(infos, self.healthy)
        guest.start()
        try:
            self._settle(guest)
            self.result.disagreements += [f"before any kill: {d}" for d in self.check(guest.nic_qps)]
            for round_ in range(kills):
                point = self.rng.choice([p for p in KILL_POINTS if self.pf or p not in ("sriov", "num_vfs")])
                self.result.kill_points[point] = self.result.kill_points.get(point, 0) + 1
                guest.park.clear()  # traffic again while the kill point runs
                worker = threading.Thread(target=self._kill_point, args=(point,), daemon=True)
                worker.start()
                time.sleep(self.rng.uniform(0.0, 0.25))  # somewhere inside the operation (or just after it)
                killed = self.kill()
                self.result.kills += 1
                worker.join(60)
                answered = self.start_daemon()
                self.result.restarts += 1
                self.result.recovery_s.append(answered - killed)
                self._settle(guest)
                found = self.check(guest.nic_qps)
                self.result.disagreements += [f"kill {round_ + 1} ({point}): {d}" for d in found]
                self.say(f"kill {round_ + 1}/{kills} during {point}: back in {answered - killed:.2f} s, "
                         f"{len(found)} disagreement(s)" + "".join(f"\n  - {d}" for d in found))
            if guest.error:
                self.result.disagreements.append(guest.error)
        finally:
            guest.stop.set()
            guest.join(30)
            self.result.guest_rebuilds, self.result.guest_round_trips = guest.rebuilds, guest.round_trips
        return self.result

    def _settle(self, guest: _Guest, timeout: float = 120) -> None:
        """Park the guest attached (it re-attached after the kill) and wait for it."""
        guest.parked.clear()
        guest.park.set()  # stays parked through the check; the next round lets it go
        if not guest.parked.wait(timeout):
            raise LabError(f"the guest did not attach again within {timeout:.0f} s ({guest.error})")

    def _kill_point(self, point: str) -> None:
        """One operation the kill lands in; its errors are the kill's doing."""
        from vrnic.core.specs import AttachInfo
        from vrnic.frontend import CQ, PD, QP, Context

        assert self.tenant is not None
        with contextlib.suppress(Exception):
            if point == "allocate":
                created = self.tenant.post("/vrnics", json={"device": self.rng.choice(self.devices)})
                if created.status_code == 201:
                    self.extras.append(created.json()["id"])
            elif point == "release" and self.extras:
                self.tenant.delete(f"/vrnics/{self.extras.pop()}")
            elif point == "reissue" and self.extras:
                self.tenant.post(f"/vrnics/{self.extras[-1]}/token")
            elif point in ("attach", "create_qp", "connect"):
                created = self.tenant.post("/vrnics", json={"device": self.rng.choice(self.devices)}).json()
                self.extras.append(created["id"])
                with Context.attach(AttachInfo(**created["attach"]), ARENA) as ctx:
                    if point != "attach":
                        pd = PD(ctx)
                        cq = CQ(ctx, 8)
                        qp = QP(pd, cq, cq)
                        if point == "connect":
                            qp.connect(ctx.gid, qp.qpn)
            elif point == "sriov" and self.pf:
                created = self.tenant.post("/vrnics", json={"mode": "sriov"})
                if created.status_code == 201:
                    self.extras.append(created.json()["id"])
            elif point == "num_vfs" and self.pf:
                pf = self.api.get(f"/sriov/pfs/{self.pf}").json()
                count = pf["num_vfs"] - 1 if pf["num_vfs"] > 2 else pf["num_vfs"] + 1
                self.api.put(f"/sriov/pfs/{self.pf}/num-vfs", json={"num_vfs": count, "force": True})
        # in `idle` the daemon is killed between requests, with the guest's traffic alone

    # ----- the checker -------------------------------------------------------------------------
    def check(self, guest_qps: int) -> list[str]:
        """Database vs vrnicd vs kernel vs netlink; every difference as a sentence (none: they agree)."""
        found: list[str] = []
        stored = self._stored()  # GET /vrnics takes vrnicd's observed attach state in first
        live = {vid for vid, v in stored.items() if v["state"] != "released"}
        held = set(self.agent.get("/vrnics").raise_for_status().json()["vrnic_ids"])
        attached = set(self.agent.get("/attached").raise_for_status().json()["vrnic_ids"])
        found += [f"{v} is live in the database ({stored[v]['state']}) but vrnicd does not hold it"
                  for v in sorted(live - held)]
        found += [f"vrnicd holds {v}, which the database does not hold live" for v in sorted(held - live)]
        for vid in sorted(live):
            if (stored[vid]["state"] == "attached") != (vid in attached):
                found.append(f"{vid} is {stored[vid]['state']} in the database, vrnicd sees it "
                             f"{'attached' if vid in attached else 'not attached'}")
        found += self._check_kernel(guest_qps)
        if self.pf:
            found += self._check_vfs(stored, live)
        return found

    def _stored(self) -> dict[str, dict[str, Any]]:
        items: dict[str, dict[str, Any]] = {}
        cursor = None
        while True:
            page = self.api.get("/vrnics", params={"limit": 500, **({"cursor": cursor} if cursor else {})})
            page.raise_for_status()
            items.update({v["id"]: v for v in page.json()["items"]})
            cursor = page.json()["next_cursor"]
            if cursor is None:
                return items

    def _check_kernel(self, guest_qps: int) -> list[str]:
        assert self.daemon is not None
        found: list[str] = []
        for kind in ("pd", "cq", "mr", "qp"):
            records = json.loads(subprocess.run(["rdma", "-j", "res", "show", kind], capture_output=True,
                                                text=True, check=True).stdout or "[]")
            owned = [r for r in records if r.get("pid")]
            for r in owned:
                if r["pid"] in self.dead_pids or not Path(f"/proc/{r['pid']}").exists():
                    found.append(f"a {kind} on {r.get('ifname')} is still owned by dead pid {r['pid']}")
            if kind == "qp":
                # `rdma res` names the task that created an object: one of vrnicd's threads, not its pid
                threads = {int(t.name) for t in Path(f"/proc/{self.daemon.pid}/task").iterdir()}
                ours = sum(1 for r in owned if r["pid"] in threads and r.get("ifname") in self.devices)
                if ours != guest_qps:  # the parked guest's QPs (its pair and their pools' spares), nothing else
                    found.append(f"vrnicd (pid {self.daemon.pid}) owns {ours} QP(s) on the storm's devices, "
                                 f"the attached guests hold {guest_qps}")
        return found

    def _check_vfs(self, stored: dict[str, dict[str, Any]], live: set[str]) -> list[str]:
        assert self.pf is not None
        found: list[str] = []
        link = json.loads(subprocess.run(["ip", "-j", "-d", "link", "show", self.pf], capture_output=True,
                                         text=True, check=True).stdout)[0]
        kernel = {vf["vf"]: (vf["address"], ((vf.get("vlan_list") or [{}])[0]).get("vlan", 0))
                  for vf in link.get("vfinfo_list", [])}
        vfs = self.api.get(f"/sriov/pfs/{self.pf}/vfs", params={"limit": 500}).raise_for_status().json()["items"]
        held = {}
        for vf in vfs:
            allocation = vf["allocation"]
            seen = kernel.get(vf["index"])
            if allocation is None:
                if seen is not None and seen != (CLEAN_MAC, 0):
                    found.append(f"VF {vf['index']} is free but carries {seen} (orphaned settings)")
                continue
            held[allocation["vrnic_id"]] = vf["index"]
            desired = (allocation["desired"]["mac"], allocation["desired"]["vlan"])
            if not allocation["vanished"] and seen != desired:
                found.append(f"VF {vf['index']} of {allocation['vrnic_id']} is {seen} in the kernel, {desired} "
                             "desired")
        sriov_live = {v for v in live if stored[v]["mode"] == "sriov"}
        found += [f"{v} is a live SR-IOV vRNIC without a VF" for v in sorted(sriov_live - set(held))]
        found += [f"VF {held[v]} is held for {v}, which is not live" for v in sorted(set(held) - sriov_live)]
        return found
