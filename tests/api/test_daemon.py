"""`vrnic daemon` as a real process: schema refusal, driver fallback, serving, restart, clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

VRNIC = [sys.executable, "-m", "vrnic.cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def _env(state: Path, database_url: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRNIC_")}
    # the daemon runs this checkout's code, also from another git worktree (the venv's editable install points
    # at one), as pytest itself does (pythonpath in pyproject.toml)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(VRNIC_STATE_DIR=str(state), VRNIC_DATABASE_URL=database_url, VRNIC_LISTEN_PORT=str(port),
               VRNIC_PARAVIRTUAL_DRIVER="fake", VRNIC_SRIOV_DRIVER="no-such-driver", VRNIC_HOST_NAME="daemon-host")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([*VRNIC, "daemon"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{env['VRNIC_LISTEN_PORT']}/api/v1/health"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"daemon exited {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError(f"daemon did not come up:\n{log.read_text()}")


def _stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)


def test_daemon_refuses_an_old_schema_then_serves_after_upgrade(tmp_path: Path, database_url: str) -> None:
    env, log = _env(tmp_path, database_url, _free_port()), tmp_path / "daemon.log"
    refused = subprocess.run([*VRNIC, "daemon"], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "run `vrnic db upgrade`" in refused.stderr
    assert subprocess.run([*VRNIC, "db", "current"], env=env, capture_output=True, timeout=60).returncode == 1
    upgraded = subprocess.run([*VRNIC, "db", "upgrade"], env=env, capture_output=True, text=True, timeout=60)
    assert upgraded.returncode == 0 and "empty -> " in upgraded.stdout

    process = _start(env, log)
    base = f"http://127.0.0.1:{env['VRNIC_LISTEN_PORT']}/api/v1"
    token = (tmp_path / "operator-token").read_text().strip()  # generated, since none was configured
    assert (tmp_path / "operator-token").stat().st_mode & 0o077 == 0
    auth = {"Authorization": f"Bearer {token}"}
    try:
        assert httpx.post(f"{base}/tenants", json={"name": "acme"}, headers=auth).status_code == 201
        vrnic = httpx.post(f"{base}/vrnics", json={"tenant": "acme"}, headers=auth)
        assert vrnic.status_code == 201 and vrnic.json()["host"] == "daemon-host"
        sriov = httpx.post(f"{base}/vrnics", json={"tenant": "acme", "mode": "sriov"}, headers=auth)
        assert sriov.status_code == 422 and sriov.json()["code"] == "not_supported"
    finally:
        assert _stop(process) == 0
    text = log.read_text()
    assert "mode sriov: driver 'no-such-driver' unavailable, mode disabled" in text
    assert "mode paravirtual: driver fake" in text
    assert "stopped; released the backend state of 1 vRNIC(s)" in text  # torn down, not leaked

    # Restarted (SIGTERM tore the backend state down), the daemon holds the vRNIC again (crash recovery), with
    # the same attach token, and releases it.
    process = _start(env, log)
    try:
        assert "recovery: 1 vRNIC(s) held again (0 lost), 0 orphan(s) released" in log.read_text()
        assert httpx.get(f"{base}/vrnics/{vrnic.json()['id']}", headers=auth).json()["state"] == "allocated"
        released = httpx.delete(f"{base}/vrnics/{vrnic.json()['id']}", headers=auth)
        assert released.status_code == 200 and released.json()["state"] == "released"
        hosts = httpx.get(f"{base}/hosts", headers=auth).json()["items"]
        assert [h["name"] for h in hosts] == ["daemon-host"]  # registered once, refreshed on restart
    finally:
        assert _stop(process) == 0


def test_serve_in_process_for_tests_with_any_backend(tmp_path: Path) -> None:
    from pydantic import SecretStr

    from vrnic.backend.driver import load_driver
    from vrnic.backend.service import BackendService
    from vrnic.config import DaemonSettings
    from vrnic.core.specs import VrnicMode
    from vrnic.daemon import serve_in_process

    backend = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake")})
    settings = DaemonSettings(state_dir=tmp_path, operator_token=SecretStr("op"), host_name="in-process")
    with serve_in_process(settings, backend) as url:
        auth = {"Authorization": "Bearer op"}
        tenant = httpx.post(f"{url}/api/v1/tenants", json={"name": "acme"}, headers=auth).json()
        vrnic = httpx.post(f"{url}/api/v1/vrnics", json={},
                           headers={"Authorization": f"Bearer {tenant['token']}"}).json()
        assert vrnic["attach"]["token"] and vrnic["id"] in backend.vrnic_ids()
        assert httpx.delete(f"{url}/api/v1/vrnics/{vrnic['id']}", headers=auth).json()["state"] == "released"
    assert backend.vrnic_ids() == set()
    backend.close()


CLIENTS = 8  # each on its own keep-alive connection; SQLite's one writer thread keeps the others' requests queued
BEFORE_SIGTERM = 24  # allocations answered before SIGTERM is sent
# Each allocation holds the one writer this long (the fake driver's create_delay_s), so the requests queued at
# SIGTERM take ~CLIENTS x this to finish: longer than uvicorn's own pause (0.1 s) before it waits for them.
CREATE_DELAY_S = 0.05


@dataclass
class _Request:
    """One POST /vrnics of a client under load, as that client saw it."""

    key: str  # its Idempotency-Key: what ties a row of the database to the request that wrote it
    events: list[str] = field(default_factory=list)  # httpcore's trace, in order
    status: int | None = None
    vrnic_id: str | None = None
    connection_close: bool = False  # the answer said `Connection: close`
    error: str | None = None

    def trace(self, event: str, _info: dict[str, Any]) -> None:
        self.events.append(event)

    @property
    def outcome(self) -> str:
        if self.status is not None:
            return {201: "allocated", 503: "unavailable"}.get(self.status, "wrong answer")
        if "http11.send_request_headers.started" not in self.events:
            return "refused"  # no connection: nothing was sent
        if "http11.send_request_body.complete" not in self.events:
            return "not sent"  # the write failed: the server had closed the connection
        if "connection.connect_tcp.started" not in self.events \
                and "http11.receive_response_headers.complete" not in self.events and self.error is not None \
                and self.error.startswith(("RemoteProtocolError: Server disconnected without sending a response",
                                           "ReadError: ")):
            return "unanswered"  # sent on a kept-alive connection, not a byte of an answer
        return "cut off"


def _allocate_until_refused(base: str, auth: dict[str, str], client_no: int, requests: list[_Request],
                            answered: threading.Semaphore) -> None:
    """Allocate in a loop over one keep-alive connection (a new one after `Connection: close`) until a request
    is not answered 201; answered is released per 201."""
    with httpx.Client(base_url=base, headers=auth, timeout=30) as client:
        n = 0
        while True:
            request = _Request(f"client{client_no}-{n}")
            requests.append(request)
            n += 1
            try:
                response = client.post("/vrnics", json={}, headers={"Idempotency-Key": request.key},
                                       extensions={"trace": request.trace})
            except httpx.TransportError as exc:
                request.error = f"{type(exc).__name__}: {exc}"
                return
            request.status = response.status_code
            request.connection_close = response.headers.get("connection", "").lower() == "close"
            if response.status_code != 201:
                request.error = response.text[:300]
                return
            request.vrnic_id = response.json()["id"]
            answered.release()


def _released(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"stopped; released the backend state of (\d+) vRNIC\(s\)", log)]


def test_sigterm_under_load_answers_every_allocation_it_commits(tmp_path: Path) -> None:
    """Issue 15: SIGTERM during work finishes or rolls back the in-flight request and releases everything.

    CLIENTS clients allocate in a loop over keep-alive connections; SIGTERM comes while their requests are in
    flight. The daemon exits 0; every request is answered whole or refused without an answer (never cut off);
    what the clients got 201 for is exactly what the database holds live (nothing committed without its answer,
    nothing answered and lost); the daemon released exactly that backend state, and held all of it again after
    a restart on the same database.
    """
    db = tmp_path / "vrnic.db"
    env, log = _env(tmp_path, f"sqlite:///{db}", _free_port()), tmp_path / "daemon.log"
    env["VRNIC_PARAVIRTUAL_DRIVER_OPTIONS"] = json.dumps({"create_delay_s": CREATE_DELAY_S})
    assert subprocess.run([*VRNIC, "db", "upgrade"], env=env, capture_output=True, timeout=60).returncode == 0
    base = f"http://127.0.0.1:{env['VRNIC_LISTEN_PORT']}/api/v1"
    process = _start(env, log)
    operator = {"Authorization": f"Bearer {(tmp_path / 'operator-token').read_text().strip()}"}
    requests: list[list[_Request]] = [[] for _ in range(CLIENTS)]
    try:
        tenant = httpx.post(f"{base}/tenants", json={"name": "acme"}, headers=operator)
        assert tenant.status_code == 201
        auth = {"Authorization": f"Bearer {tenant.json()['token']}"}
        answered = threading.Semaphore(0)
        clients = [threading.Thread(target=_allocate_until_refused, args=(base, auth, c, requests[c], answered),
                                    name=f"client{c}", daemon=True) for c in range(CLIENTS)]
        for client in clients:
            client.start()
        # SIGTERM once every client has been answered (its connection is kept alive, so from now on a client opens
        # a new connection only after a `Connection: close`, when the listening socket is closed already)
        got = 0
        while got < BEFORE_SIGTERM or not all(any(r.status == 201 for r in list(c)) for c in requests):
            assert answered.acquire(timeout=30), f"allocations stalled before SIGTERM:\n{log.read_text()}"
            got += 1
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        stopped_after = time.monotonic() - signalled
        for client in clients:
            client.join(timeout=30)
            assert not client.is_alive()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert stopped_after < 15, f"SIGTERM took {stopped_after:.1f}s to stop the daemon"

    made = [r for per_client in requests for r in per_client]
    outcomes = Counter(r.outcome for r in made)
    # Each client ends on its first request not answered 201. On SIGTERM uvicorn's graceful shutdown
    # (Server.shutdown) closes the listening socket, marks every connection with a request under way
    # keep-alive off (that request runs to its end and is answered whole, with `Connection: close`; the daemon
    # sets no timeout_graceful_shutdown, so none is cancelled) and closes every idle keep-alive connection at once,
    # as HTTP/1.1 lets a server close an idle persistent connection at any time (RFC 9112 §9.6). Hence the
    # connection-level errors a client may legitimately get, none of them after the server has read its request:
    # - "refused": no connection (the listening socket is closed), nothing sent;
    # - "not sent": writing the request failed, the server having closed the connection;
    # - "unanswered": the request was written on a kept-alive connection the server was closing while it was idle;
    #   the server never read it (its bytes met a closed socket: a reset, or the client read the close first).
    #   The client cannot tell whether the request was read, so this one is checked from the other side: its
    #   Idempotency-Key wrote nothing (that key is what lets such a client retry a POST, RFC 9112 §9.3.1).
    # An answer cut off mid-way, an error on a new connection after connecting, a timeout, or any status other than
    # 201 or 503 is a failure.
    assert set(outcomes) <= {"allocated", "unavailable", "refused", "not sent", "unanswered"}, \
        [vars(r) for r in made if r.outcome in ("cut off", "wrong answer")]
    # requests were in flight at SIGTERM: read before the shutdown began, finished and answered (Connection: close)
    assert any(r.outcome == "allocated" and r.connection_close for r in made), outcomes

    allocated = {r.key: r.vrnic_id for r in made if r.outcome == "allocated"}
    with closing(sqlite3.connect(db)) as connection:
        rows = connection.execute("SELECT idempotency_key, public_id, state FROM vrnics").fetchall()
    assert {key: public_id for key, public_id, _ in rows} == allocated  # no row for a request not answered 201
    live = {public_id for _, public_id, state in rows if state != "released"}
    assert live == set(allocated.values()) and len(live) >= BEFORE_SIGTERM
    assert _released(log.read_text()) == [len(live)]  # the first daemon held exactly those, and released them

    mark = len(log.read_bytes())
    process = _start(env, log)
    try:
        assert f"recovery: {len(live)} vRNIC(s) held again (0 lost), 0 orphan(s) released" \
            in log.read_bytes()[mark:].decode()
        listed: dict[str, str] = {}
        cursor: str | None = None
        while True:
            page = httpx.get(f"{base}/vrnics", params={"limit": 500, **({"cursor": cursor} if cursor else {})},
                             headers=operator).json()
            listed.update((v["id"], v["state"]) for v in page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert listed == dict.fromkeys(live, "allocated")
    finally:
        assert _stop(process) == 0
    assert _released(log.read_text()) == [len(live), len(live)]
