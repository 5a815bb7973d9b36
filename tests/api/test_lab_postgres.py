"""The two-hosts rig's PostgreSQL (vrnic.lab.two_hosts.postgres) on this host: started by hand as the postgres
user, reached over TCP by URL, restarted fast and immediate under a client that keeps its engine."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from vrnic.db.engine import make_engine
from vrnic.errors import LabError
from vrnic.lab.two_hosts.postgres import LabPostgres


@pytest.fixture
def lab_postgres() -> Iterator[LabPostgres]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(tempfile.mkdtemp(prefix="vrnic-labpg-"))  # under /tmp: the postgres user can reach it
    try:
        server = LabPostgres("127.0.0.1", root, port=port)
    except LabError as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(str(exc))
    try:
        server.start()
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def test_the_rig_database_survives_restarts_and_its_clients_reconnect(lab_postgres: LabPostgres) -> None:
    url = lab_postgres.create_database("vrnic")
    assert url == f"postgresql+psycopg://postgres@127.0.0.1:{lab_postgres.port}/vrnic"
    engine = make_engine(url)  # the agents' engine settings: pre-ping replaces connections a restart cut
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE kept (n int)"))
            connection.execute(text("INSERT INTO kept VALUES (1), (2)"))
        for mode in ("fast", "immediate"):
            assert lab_postgres.restart(mode) < 60
            with engine.connect() as connection:
                assert connection.execute(text("SELECT sum(n) FROM kept")).scalar() == 3
    finally:
        engine.dispose()
