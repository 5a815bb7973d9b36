"""SQLite WAL checkpoints on a thread of their own (make_engine(background_checkpoints=True)), on a real file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from vrnic.db import engine as engine_module
from vrnic.db.engine import WAL_CHECKPOINT_INTERVAL_S, make_engine
from vrnic.db.unit_of_work import Database

ROWS = 1200  # 4 KB each: the WAL passes SQLite's 1000-page checkpoint mark
PAGES_BYTES = 4 * 1000 * 1000


def _fill(engine: Engine) -> float:
    """ROWS rows in commits of 100; how long it took."""
    started = time.monotonic()
    with engine.begin() as c:
        c.execute(text("CREATE TABLE blobs (id INTEGER PRIMARY KEY, data BLOB)"))
    for _ in range(0, ROWS, 100):
        with engine.begin() as c:
            c.execute(text("INSERT INTO blobs (data) VALUES (randomblob(4000))"), [{}] * 100)
    return time.monotonic() - started


def test_commits_leave_checkpoints_to_the_thread_which_copies_the_wal_back_and_truncates_it_at_the_end(
        tmp_path: Path) -> None:
    # By default (every other process on the file) the commit past the mark checkpoints: the pages are in the file.
    default = tmp_path / "default.db"
    engine = make_engine(f"sqlite:///{default}")
    try:
        _fill(engine)
        assert default.stat().st_size > PAGES_BYTES
    finally:
        engine.dispose()

    path = tmp_path / "vrnic.db"
    wal = path.with_name(path.name + "-wal")
    engine = make_engine(f"sqlite:///{path}", background_checkpoints=True)
    try:
        with engine.connect() as c:
            assert c.execute(text("PRAGMA wal_autocheckpoint")).scalar() == 0
        # No commit checkpointed: the WAL holds every page and, unless the thread ran meanwhile, the file none.
        if _fill(engine) < WAL_CHECKPOINT_INTERVAL_S:
            assert path.stat().st_size < PAGES_BYTES / 4
        assert wal.stat().st_size > PAGES_BYTES
        # The thread's passes copy them back (passive checkpoints: writers go on meanwhile).
        deadline = time.monotonic() + 10
        while path.stat().st_size < PAGES_BYTES:
            assert time.monotonic() < deadline, "no checkpoint within 10 s"
            with engine.begin() as c:
                c.execute(text("INSERT INTO blobs (data) VALUES (randomblob(10))"))
            time.sleep(0.05)
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM blobs")).scalar() > ROWS
    finally:
        engine.dispose()
    assert not wal.exists() or wal.stat().st_size == 0  # the last checkpoint, when the engine went
    # Once disposed, the engine's new connections checkpoint on commit again (nobody else would).
    with engine.connect() as c:
        assert c.execute(text("PRAGMA wal_autocheckpoint")).scalar() == 1000
    engine.dispose()


def test_steady_writes_restart_the_wal_from_its_start_instead_of_growing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes back to back leave a checkpoint pass no moment with every frame copied, so the WAL would only grow;
    past WAL_RESET_FRAMES a pass holds this process's writers (the engine's write lock) and the next write starts
    the WAL over. Nothing written is lost, and the writers go on throughout."""
    monkeypatch.setattr(engine_module, "WAL_CHECKPOINT_INTERVAL_S", 0.02)
    monkeypatch.setattr(engine_module, "WAL_RESET_FRAMES", 256)  # 1 MiB of 4 KiB pages
    path = tmp_path / "vrnic.db"
    wal = path.with_name(path.name + "-wal")
    engine = make_engine(f"sqlite:///{path}", background_checkpoints=True)
    db = Database(engine)
    try:
        with db.write("operator") as uow:
            uow.connection.execute(text("CREATE TABLE blobs (id INTEGER PRIMARY KEY, data BLOB)"))
        commits, largest, started = 0, 0, time.monotonic()
        while commits * 4 * 4096 < 128 << 20 and time.monotonic() - started < 20:  # about 1.5 s on the host
            with db.write("operator") as uow:
                uow.connection.execute(text("INSERT INTO blobs (data) VALUES (randomblob(4000))"), [{}] * 4)
            commits += 1
            largest = max(largest, wal.stat().st_size)
        written = commits * 4 * 4096
        assert written > 64 << 20, "too few writes to tell"
        # Without the held pass the WAL takes every page written (measured: 595 MB of 595); with it, the reset
        # mark plus what the writers append in a pass or two (13 MB of 330).
        assert largest < written / 4, f"the WAL grew to {largest} bytes of {written} written"
        with db.read() as uow:
            assert uow.session.execute(text("SELECT count(*) FROM blobs")).scalar() == commits * 4
    finally:
        db.close()
        engine.dispose()
