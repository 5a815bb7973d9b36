"""The unit of work: one database transaction, who it acts for, and what undoes its side effects.

Database hands out units of work and owns SQLite's write serialisation. A unit of work is passed
explicitly to whatever writes in its transaction (the control plane, the SR-IOV state store), so the
vRNIC rows, desired VF state and audit events commit or roll back together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

from sqlalchemy import Connection, Engine, Table, event, insert
from sqlalchemy.orm import Session, sessionmaker

from vrnic.db.engine import session_factory, write_lock
from vrnic.db.prepared import Prepared
from vrnic.db.tables import Event, utcnow

log = logging.getLogger(__name__)

DAEMON_ACTOR = "daemon"
_INSERT_EVENT = Prepared(insert(cast(Table, Event.__table__)))


class UnitOfWork:
    """One open transaction acting for actor ("operator", "tenant:<name>", "daemon").

    A write unit of work owns its Connection; its ORM session is made only when asked for, on that connection
    and in its transaction. The REST allocation runs on Core and Prepared statements alone, and creating,
    committing and closing a session per request cost about a seventh of it (issue 14)."""

    def __init__(self, actor: str, *, session: Session | None = None, connection: Connection | None = None,
                 sessions: Callable[[Connection], Session] | None = None) -> None:
        self.actor = actor
        self._session = session
        self._given_connection = connection
        self._sessions = sessions
        self._undo: list[Callable[[], None]] = []
        self._connection: Connection | None = None

    @property
    def session(self) -> Session:
        """The ORM session of this transaction (made on first use)."""
        session = self._session
        if session is None:
            if self._sessions is None or self._given_connection is None:
                raise RuntimeError("a unit of work without a session or a connection")
            session = self._session = self._sessions(self._given_connection)
        return session

    @property
    def connection(self) -> Connection:
        """The transaction's connection, for Core statements (a read unit of work: its session's, asked for once,
        as asking each time costs as much as a small statement)."""
        if self._given_connection is not None:
            return self._given_connection
        connection = self._connection
        if connection is None or connection.closed:
            connection = self._connection = self.session.connection()
        return connection

    def _flush(self) -> None:
        if self._session is not None:
            self._session.flush()

    def _drop_session(self) -> None:
        """Forget the session and what it holds (after a rollback; the next use makes a new one)."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def on_failure(self, undo: Callable[[], None]) -> None:
        """Run undo if this unit of work fails (in the block or at commit). It runs after the rollback, in a
        new transaction that is rolled back too; the SR-IOV store still knows what this unit of work wrote."""
        self._undo.append(undo)

    def record(self, action: str, subject: str, tenant_id: int | None, detail: dict[str, Any], *,
               actor: str | None = None) -> None:
        """An audit-log row in this transaction."""
        self._flush()  # rows this event may refer to go first
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

    SQLite has one writer at a time: write units of work wait on a lock in this process (the engine's, shared by
    every Database on it and by its WAL checkpoints), which wakes up at once, where SQLite's own busy handler
    sleeps and polls (tens of ms of tail latency under concurrency). They also share one connection, held from
    the first write until `close` (or the engine's disposal): taking a Connection from the pool and giving it
    back cost a seventh of a REST allocation's database work (issue 14).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions: sessionmaker[Session] = session_factory(engine)
        self._readonly_sessions: sessionmaker[Session] = session_factory(
            engine.execution_options(vrnic_read_only=True))
        self.serialises_writes = engine.dialect.name == "sqlite"
        self._write_lock: AbstractContextManager[object] = write_lock(engine) if self.serialises_writes \
            else nullcontext()
        self._writer: Connection | None = None  # SQLite: the write units' connection, under _write_lock
        if self.serialises_writes:
            event.listen(engine, "engine_disposed", self._on_disposed)

    def _joined_session(self, connection: Connection) -> Session:
        # in the connection's transaction: the session neither commits nor ends it; the unit of work does
        return self._sessions(bind=connection, join_transaction_mode="rollback_only")

    @contextmanager
    def write(self, actor: str) -> Iterator[UnitOfWork]:
        """A read-write unit of work, committed when the block ends; on an exception it rolls back and its
        undo actions run (in a new transaction, rolled back too: what they wrote concerned rolled-back rows)."""
        with self._write_lock, self._write_connection() as connection:
            connection.begin()
            uow = UnitOfWork(actor, connection=connection, sessions=self._joined_session)
            try:
                yield uow
                uow._flush()
                connection.commit()
            except BaseException:
                self._roll_back(uow, connection)
                try:
                    uow._run_undo()
                finally:
                    self._roll_back(uow, connection)
                raise
            finally:
                uow._drop_session()

    def _write_connection(self) -> AbstractContextManager[Connection]:
        """A connection for one write unit of work (called under _write_lock): SQLite's held one (made again if
        closed or invalidated), else one from the pool for the unit alone."""
        if not self.serialises_writes:
            return self.engine.connect()
        writer = self._writer
        if writer is None or writer.closed or writer.invalidated:
            if writer is not None:
                writer.close()
            writer = self._writer = self.engine.connect()
        return nullcontext(writer)

    def close(self) -> None:
        """Give the held write connection back to the pool (the next write takes one again)."""
        self._let_go(discard=False)

    def _on_disposed(self, _engine: Engine) -> None:
        self._let_go(discard=True)  # its pool is gone: close the connection rather than give it back there

    def _let_go(self, *, discard: bool) -> None:
        with self._write_lock:
            writer, self._writer = self._writer, None
            if writer is not None:
                if discard:
                    writer.invalidate()
                writer.close()

    @staticmethod
    def _roll_back(uow: UnitOfWork, connection: Connection) -> None:
        uow._drop_session()
        if connection.in_transaction():
            connection.rollback()

    @contextmanager
    def read(self, actor: str = DAEMON_ACTOR) -> Iterator[UnitOfWork]:
        """A read-only unit of work (on SQLite it runs beside the writer)."""
        with self._readonly_sessions() as session, session.begin():
            yield UnitOfWork(actor, session=session)
