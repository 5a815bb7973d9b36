"""`vrnic daemon` as a real process: schema refusal, driver fallback, serving, restart, clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

VRNIC = [sys.executable, "-m", "vrnic.cli.main"]


def _env(state: Path, database_url: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRNIC_")}
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
