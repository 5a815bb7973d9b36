"""The unit of work (vrnic.db.unit_of_work) on SQLite and PostgreSQL: commit, rollback, undo, actor, and
SQLite's one writer at a time; it is passed explicitly, nothing ambient."""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from vrnic.db.tables import Event, Tenant
from vrnic.db.unit_of_work import DAEMON_ACTOR, Database


def _count(db: Database, what: type[Tenant] | type[Event]) -> int:
    with db.read() as uow:
        return uow.session.scalar(select(func.count()).select_from(what)) or 0


def test_a_unit_of_work_commits_its_rows_and_events_with_its_actor(migrated: Engine) -> None:
    db = Database(migrated)
    with db.write("operator") as uow:
        uow.session.add(Tenant(name="acme", vpc_id=1, default_quota={}))
        uow.record("tenant.create", "tenant/acme", None, {"vpc_id": 1})
        uow.record("host.register", "host/h", None, {}, actor=DAEMON_ACTOR)
    with db.read() as uow:
        assert uow.session.scalar(select(Tenant.name)) == "acme"
        events = uow.session.execute(select(Event.actor, Event.action).order_by(Event.id)).all()
    assert [tuple(e) for e in events] == [("operator", "tenant.create"), ("daemon", "host.register")]


def test_a_failed_unit_of_work_rolls_back_then_runs_its_undo_in_reverse(migrated: Engine) -> None:
    db = Database(migrated)
    undone: list[str] = []
    with pytest.raises(RuntimeError, match="half-way"), db.write("operator") as uow:
        uow.session.add(Tenant(name="acme", vpc_id=1, default_quota={}))
        uow.record("tenant.create", "tenant/acme", None, {})
        uow.on_failure(lambda: undone.append(f"first, tenants visible: {_visible_tenants(uow.session)}"))
        uow.on_failure(lambda: undone.append("second"))
        raise RuntimeError("half-way")
    # the undo ran after the rollback: the rows it concerned were gone already
    assert undone == ["second", "first, tenants visible: 0"]
    assert _count(db, Tenant) == 0 and _count(db, Event) == 0
    with db.write("operator") as uow:  # and a successful one runs no undo at all
        uow.on_failure(lambda: undone.append("never"))
    assert undone == ["second", "first, tenants visible: 0"]


def _visible_tenants(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Tenant)) or 0


def test_a_failing_undo_is_logged_and_the_original_error_goes_up(migrated: Engine,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    db = Database(migrated)

    def broken() -> None:
        raise OSError("the device is gone too")

    with pytest.raises(RuntimeError, match="original"), db.write("operator") as uow:
        uow.on_failure(broken)
        raise RuntimeError("original")
    assert "undoing a failed unit of work" in caplog.text


def test_a_failed_commit_runs_the_undo_too(migrated: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    db = Database(migrated)
    undone: list[bool] = []

    def commit_fails(self: Connection) -> None:
        raise ConnectionError("the database went away at COMMIT")

    with pytest.raises(ConnectionError):  # noqa: SIM117 - the patch must cover only the block
        with monkeypatch.context() as patch:
            patch.setattr(Connection, "commit", commit_fails)  # a write unit of work commits its connection
            with db.write("operator") as uow:
                uow.session.add(Tenant(name="acme", vpc_id=1, default_quota={}))
                uow.on_failure(lambda: undone.append(True))
    assert undone == [True] and _count(db, Tenant) == 0


def test_sqlite_writers_take_turns_in_this_process(migrated: Engine) -> None:
    db = Database(migrated)
    if not db.serialises_writes:
        pytest.skip("PostgreSQL orders its writers with row locks, not a lock in this process")
    inside: list[int] = []
    overlaps: list[int] = []

    def write(n: int) -> None:
        with db.write("operator") as uow:
            inside.append(n)
            overlaps.append(len(inside))
            uow.session.add(Tenant(name=f"t{n}", vpc_id=n, default_quota={}))
            time.sleep(0.01)
            inside.remove(n)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert overlaps == [1] * 8 and _count(db, Tenant) == 8  # one at a time, and none failed as "locked"


def test_a_busy_sqlite_database_fails_begin_with_sqlalchemys_operational_error(migrated: Engine) -> None:
    """BEGIN IMMEDIATE goes straight to sqlite3; a database another process holds past the busy timeout is
    still SQLAlchemy's OperationalError (the API answers it with 503), and the next unit of work goes on."""
    if migrated.dialect.name != "sqlite":
        pytest.skip("SQLite's write lock")

    @event.listens_for(migrated, "connect")
    def short_wait(dbapi_connection: Any, _record: Any) -> None:  # after the engine's own set-up: it wins
        dbapi_connection.execute("PRAGMA busy_timeout=50")

    migrated.dispose()  # the pool's connections are made again, with the short wait
    holder = sqlite3.connect(str(migrated.url.database), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    db = Database(migrated)
    try:
        with pytest.raises(OperationalError) as caught, db.write("operator"):
            pytest.fail("the unit of work began while another process held the write lock")
        assert isinstance(caught.value.orig, sqlite3.OperationalError) and "locked" in str(caught.value.orig)
        assert caught.value.statement == "BEGIN IMMEDIATE"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with db.write("operator") as uow:
        uow.record("tenant.create", "tenant/after", None, {})
    assert _count(db, Event) == 1


def test_sqlite_writes_share_one_held_connection_until_closed_or_disposed(migrated: Engine) -> None:
    """The write units of work reuse one pooled connection (no checkout per write), a failed write leaves it
    usable, an invalidated one is replaced, and close or the engine's disposal gives it back to the pool."""
    db = Database(migrated)
    if not db.serialises_writes:
        pytest.skip("PostgreSQL's writers run in parallel, each on a connection of its own")
    checkouts: list[int] = []
    event.listen(migrated, "checkout", lambda dbapi, *_: checkouts.append(id(dbapi)))
    for n in range(3):
        with db.write("operator") as uow:
            uow.record("tenant.create", f"tenant/{n}", None, {})
    with pytest.raises(RuntimeError), db.write("operator") as uow:
        uow.record("tenant.create", "tenant/rolled-back", None, {})
        raise RuntimeError("half-way")
    with db.write("operator") as uow:
        held = uow.connection
        uow.record("tenant.create", "tenant/3", None, {})
    assert len(checkouts) == 1  # (reads take their own connections: counted after)
    assert _count(db, Event) == 4
    checkouts.clear()
    held.invalidate()
    with db.write("operator") as uow:
        assert uow.connection is not held
        uow.record("tenant.create", "tenant/4", None, {})
    assert len(checkouts) == 1 and _count(db, Event) == 5
    pool = migrated.pool
    db.close()
    assert pool.checkedout() == 0
    with db.write("operator") as uow:  # after close: a connection is taken again
        uow.record("tenant.create", "tenant/5", None, {})
        driver_connection = uow.connection.connection.driver_connection
    assert pool.checkedout() == 1
    migrated.dispose()  # as the daemon stops: the held connection is closed with the pool it came from
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        driver_connection.execute("SELECT 1")
    assert _count(db, Event) == 6
