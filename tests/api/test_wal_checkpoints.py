"""SQLite WAL checkpoints on a thread of their own (make_engine(background_checkpoints=True)), on a real file."""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import Engine, text

from vrnic.db.engine import WAL_CHECKPOINT_INTERVAL_S, make_engine

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
