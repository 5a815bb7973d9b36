"""How the API runs its units of work: SQLite's single writer thread, and SR-IOV state joined explicitly."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from fastapi.concurrency import run_in_threadpool

from vrnic.db.unit_of_work import Database, UnitOfWork
from vrnic.db.vf_store import DbVfStateStore

T = TypeVar("T")


class Transactions:
    """Units of work on the API's database; vf_store: the SR-IOV driver's desired state when it is kept in
    this database (its writes then join the API's transaction)."""

    def __init__(self, db: Database, vf_store: DbVfStateStore | None = None) -> None:
        self.db = db
        self.vf_store = vf_store
        # SQLite takes one writer at a time, so its writes queue (first come, first served) for one writer
        # thread instead of many threads contending for the lock, which kept tail latency long.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vrnic-db-writer") if db.serialises_writes \
            else None

    def write(self, actor: str, *, sriov: bool = False) -> AbstractContextManager[UnitOfWork]:
        """A write unit of work; sriov: it may change SR-IOV desired state, so the store works in it."""
        if sriov and self.vf_store is not None:
            store = self.vf_store
            return store.working_in(lambda: self.db.write(actor))
        return self.db.write(actor)

    def read(self) -> AbstractContextManager[UnitOfWork]:
        return self.db.read()

    async def run_write(self, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a state-changing operation off the event loop (PostgreSQL: on the shared thread pool)."""
        call = functools.partial(operation, *args, **kwargs)
        if self._writer is None:
            return await run_in_threadpool(call)
        return await asyncio.get_running_loop().run_in_executor(self._writer, call)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.db.close()
