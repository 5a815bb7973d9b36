"""The unit of work: one database transaction, who it acts for, and what undoes its side effects.

Database hands out units of work and owns SQLite's write serialisation. A unit of work is passed
explicitly to whatever writes in its transaction (the control plane, the SR-IOV state store), so the
vRNIC rows, desired VF state and audit events commit or roll back together.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

from sqlalchemy import Connection, Engine, Table, insert
from sqlalchemy.orm import Session, sessionmaker

from vrnic.db.engine import session_factory
from vrnic.db.prepared import Prepared
from vrnic.db.tables import Event, utcnow

log = logging.getLogger(__name__)

DAEMON_ACTOR = "daemon"
_INSERT_EVENT = Prepared(insert(cast(Table, Event.__table__)))


class UnitOfWork:
    """One open transaction (session) acting for actor ("operator", "tenant:<name>", "daemon")."""

    def __init__(self, session: Session, actor: str) -> None:
        self.session = session
        self.actor = actor
        self._undo: list[Callable[[], None]] = []
        self._connection: Connection | None = None

    @property
    def connection(self) -> Connection:
        """The transaction's connection, for Core statements (asking the session each time costs as much as a
        small statement); after a rollback the session hands out a new one."""
        connection = self._connection
        if connection is None or connection.closed:
            connection = self._connection = self.session.connection()
        return connection

    def on_failure(self, undo: Callable[[], None]) -> None:
        """Run undo if this unit of work fails (in the block or at commit). It runs after the rollback, in a
        new transaction that is rolled back too; the SR-IOV store still knows what this unit of work wrote."""
        self._undo.append(undo)

    def record(self, action: str, subject: str, tenant_id: int | None, detail: dict[str, Any], *,
               actor: str | None = None) -> None:
        """An audit-log row in this transaction."""
        self.session.flush()  # rows this event may refer to go first
        _INSERT_EVENT.execute(self.connection, {"at": utcnow(), "actor": actor or self.actor, "action": action,
                                                "subject": subject, "tenant_id": tenant_id, "detail": detail})

    def _run_undo(self) -> None:
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:  # the original failure is the one to report
                log.exception("undoing a failed unit of work")
        self._undo.clear()


class Database:
    """Units of work on one engine.

    SQLite has one writer at a time: write units of work wait on a lock in this process, which wakes up at
    once, where SQLite's own busy handler sleeps and polls (tens of ms of tail latency under concurrency).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions: sessionmaker[Session] = session_factory(engine)
        self._readonly_sessions: sessionmaker[Session] = session_factory(
            engine.execution_options(vrnic_read_only=True))
        self.serialises_writes = engine.dialect.name == "sqlite"
        self._write_lock: AbstractContextManager[object] = threading.Lock() if self.serialises_writes \
            else nullcontext()

    @contextmanager
    def write(self, actor: str) -> Iterator[UnitOfWork]:
        """A read-write unit of work, committed when the block ends; on an exception it rolls back and its
        undo actions run."""
        with self._write_lock, self._sessions() as session:
            uow = UnitOfWork(session, actor)
            session.begin()
            try:
                yield uow
                session.flush()
                session.commit()
            except BaseException:
                session.rollback()
                uow._run_undo()
                session.rollback()  # whatever the undo wrote is not kept: it concerned rolled-back rows
                raise

    @contextmanager
    def read(self, actor: str = DAEMON_ACTOR) -> Iterator[UnitOfWork]:
        """A read-only unit of work (on SQLite it runs beside the writer)."""
        with self._readonly_sessions() as session, session.begin():
            yield UnitOfWork(session, actor)
