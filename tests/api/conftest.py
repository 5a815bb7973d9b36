"""API tier: the real app over a real database (SQLite file, and PostgreSQL when installed), migrated
by the real migrations, with the in-tree fake driver behind BackendService."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine, text

from vrnic.api.app import create_app
from vrnic.backend.driver import load_driver
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.db.engine import make_engine
from vrnic.db.migrate import upgrade

OPERATOR_TOKEN = "vro_test-operator-token"


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class PostgresCluster:
    """A throw-away PostgreSQL cluster in a temp dir, on a private port and socket (no systemd here)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="vrnic-pg-"))
        self.data = self.dir / "data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # PostgreSQL refuses to run as root: as root, run it as the postgres user.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")

    def _run(self, *argv: str) -> None:
        result = subprocess.run([*self.as_user, *argv], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}")

    def start(self) -> None:
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8", "--locale=C")
        options = f"-p {self.port} -k {self.dir} -c listen_addresses='' -c fsync=off -c max_connections=200"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
                  "-t", "60", "-o", options, "start")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.dir}&port={self.port}"

    def create_database(self) -> str:
        name = f"vrnic_{uuid.uuid4().hex[:12]}"
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return self.url(name)

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                        "-w", "stop"], capture_output=True, timeout=60, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (/usr/lib/postgresql/*/bin); `make setup` installs it "
                    "(Debian package postgresql)")
    cluster = PostgresCluster(bin_dir)
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        cluster.stop()
        pytest.fail(f"could not start a throw-away PostgreSQL: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'vrnic.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    return cluster.create_database()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def migrated(engine: Engine) -> Engine:
    upgrade(engine)
    return engine


@pytest.fixture
def operator_token() -> str:
    return OPERATOR_TOKEN


@pytest.fixture
def settings(tmp_path: Path) -> DaemonSettings:
    return DaemonSettings(state_dir=tmp_path, operator_token=SecretStr(OPERATOR_TOKEN), host_name="test-host",
                          paravirtual_driver="fake", sriov_driver=None)


@pytest.fixture
def backend() -> Iterator[BackendService]:
    service = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake")})
    yield service
    service.close()


@pytest.fixture
def client(migrated: Engine, settings: DaemonSettings, backend: BackendService) -> Iterator[TestClient]:
    """The operator's client (token set); pass headers= to act as someone else."""
    app = create_app(settings, backend, engine=migrated)
    with TestClient(app, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as test_client:
        yield test_client


@pytest.fixture
def make_tenant(client: TestClient) -> Callable[..., dict[str, str]]:
    """make_tenant(name, **fields) -> {"name", "token", "auth"}: auth is the Authorization header value."""

    def make(name: str, **fields: object) -> dict[str, str]:
        response = client.post("/api/v1/tenants", json={"name": name, **fields})
        assert response.status_code == 201, response.text
        token = response.json()["token"]
        return {"name": name, "token": token, "auth": f"Bearer {token}"}

    return make
