"""Engines and sessions: SQLite (the embedded default) tuned for one daemon, or PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, **options: Any) -> Engine:
    """An engine for url; for SQLite the file's directory is created and each connection is set up."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        options.setdefault("pool_size", 10)
        options.setdefault("max_overflow", 40)
        options.setdefault("pool_pre_ping", True)
        return create_engine(url, **options)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **options)
    event.listen(engine, "connect", _sqlite_connect)
    event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take over transaction control from pysqlite so BEGIN IMMEDIATE below is what starts them.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL keeps it consistent
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(connection: Any) -> None:
    # A deferred transaction that later writes fails at once with SQLITE_BUSY under concurrency
    # (busy_timeout does not apply to lock upgrades); taking the write lock up front makes it wait instead.
    # Sessions that only read say so (execution option vrnic_read_only) and run beside the writer (WAL).
    read_only = connection.get_execution_options().get("vrnic_read_only", False)
    connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
