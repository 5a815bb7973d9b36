"""Engines and sessions: SQLite (the embedded default) tuned for one daemon, or PostgreSQL."""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

WAL_CHECKPOINT_INTERVAL_S = 0.25
WAL_RESET_FRAMES = 16384  # 64 MiB of 4 KiB pages: past it, a checkpoint pass holds the writers so the WAL restarts
_WRITE_LOCKS: weakref.WeakKeyDictionary[Engine, threading.RLock] = weakref.WeakKeyDictionary()
_WRITE_LOCKS_GUARD = threading.Lock()


def write_lock(engine: Engine) -> threading.RLock:
    """The lock this process's writers to engine's SQLite database take in turn. Every Database on the engine
    shares it, and so do the engine's WAL checkpoints. (Reentrant: a write nested in another, on a second
    connection, meets SQLite's own busy timeout and fails, as it always has, rather than hanging here.)"""
    with _WRITE_LOCKS_GUARD:
        found = _WRITE_LOCKS.get(engine)
        if found is None:
            found = _WRITE_LOCKS[engine] = threading.RLock()
        return found


def make_engine(url: str, *, background_checkpoints: bool = False, **options: Any) -> Engine:
    """An engine for url; for SQLite the file's directory is created and each connection is set up.

    background_checkpoints (a SQLite file; for a long-lived process such as the daemon): the engine's commits
    never checkpoint the WAL, a thread of its own does (WalCheckpoints), until the engine is disposed."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        options.setdefault("pool_size", 10)
        options.setdefault("max_overflow", 40)
        options.setdefault("pool_pre_ping", True)
        return create_engine(url, **options)
    path = Path(parsed.database) if parsed.database and parsed.database != ":memory:" else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **options)
    event.listen(engine, "connect", _sqlite_connect)
    event.listen(engine, "begin", _sqlite_begin)
    if background_checkpoints and path is not None:
        checkpoints = WalCheckpoints(path, write_lock(engine), WAL_CHECKPOINT_INTERVAL_S, WAL_RESET_FRAMES)
        event.listen(engine, "connect", checkpoints.take_over)
        event.listen(engine, "engine_disposed", lambda _: checkpoints.stop())
    return engine


class WalCheckpoints:
    """Checkpoints of a SQLite file's WAL on a thread of their own, so that no commit pays for one.

    Left to itself, SQLite checkpoints inside the commit that takes the WAL past 1000 pages: that commit, which
    holds the write lock and so every writer queued behind it, copies the pages into the database file and
    (synchronous=NORMAL) waits for two fsyncs. Under REST load that was the API's p99 at one client. Here the
    engine's connections do not checkpoint on commit; this thread runs a PASSIVE checkpoint (it waits for
    neither readers nor the writer) every WAL_CHECKPOINT_INTERVAL_S, and a TRUNCATE one when it stops. Other
    processes on the file (the CLI) checkpoint as SQLite does by default.

    The WAL starts over from its beginning only when a write begins with every frame copied back, and under
    steady writes a pass never ends in such a moment: the writers append while it copies. So once the WAL holds
    WAL_RESET_FRAMES, a second pass runs with the engine's write lock held (`write_lock`): no writer of this
    process appends meanwhile, it copies only what the first pass missed, and the next write restarts the WAL.
    It replaces a RESTART checkpoint, which blocked every new writer, sleeping in SQLite's busy handler, until
    the one in a transaction was done: stalls of about 100 ms under load (issue 14)."""

    def __init__(self, path: Path, writers: threading.RLock, interval_s: float = WAL_CHECKPOINT_INTERVAL_S,
                 reset_frames: int = WAL_RESET_FRAMES) -> None:
        self.path = path
        self.writers = writers
        self.interval_s = interval_s
        self.reset_frames = reset_frames
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def take_over(self, dbapi_connection: Any, _record: Any) -> None:
        """A new connection of the engine: it leaves checkpoints to this thread, which starts with the first
        (once stopped, new connections checkpoint on commit again)."""
        with self._lock:
            if self._stop.is_set():
                return
            dbapi_connection.execute("PRAGMA wal_autocheckpoint=0")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vrnic-wal-checkpoints", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        connection = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    _busy, frames, _copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if frames >= self.reset_frames:
                        with self.writers:
                            connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:  # the file may be busy or going away: try again next time
                    log.warning("WAL checkpoint of %s failed: %s", self.path, exc)
            connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            log.warning("final WAL checkpoint of %s failed: %s", self.path, exc)
        finally:
            connection.close()


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take over transaction control from pysqlite so BEGIN IMMEDIATE below is what starts them.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL keeps it consistent
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    # A deferred transaction that later writes fails at once with SQLITE_BUSY under concurrency
    # (busy_timeout does not apply to lock upgrades); taking the write lock up front makes it wait instead.
    # Sessions that only read say so (execution option vrnic_read_only) and run beside the writer (WAL).
    statement = "BEGIN" if connection.get_execution_options().get("vrnic_read_only", False) else "BEGIN IMMEDIATE"
    # Straight to the DBAPI connection (SQLAlchemy's execution around it cost more than the BEGIN, issue 14);
    # an error is raised as SQLAlchemy's (a busy database: OperationalError, which the API answers with 503).
    try:
        connection.connection.driver_connection.execute(statement)  # type: ignore[union-attr]
    except sqlite3.Error as exc:
        raise DBAPIError.instance(statement, (), exc, sqlite3.Error, dialect=connection.dialect) from exc


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
