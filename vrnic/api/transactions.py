"""How the API runs its units of work: SQLite's one writer thread (with group commits), and SR-IOV state
joined explicitly."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any, TypeVar

from fastapi.concurrency import run_in_threadpool

from vrnic.db.unit_of_work import Database, UnitOfWork
from vrnic.db.vf_store import DbVfStateStore

T = TypeVar("T")
log = logging.getLogger(__name__)

GROUP_MAX = 16  # units of work in one group commit: more would only make the first ones wait longer


def group_committable(operation: Callable[..., T]) -> Callable[..., T]:
    """Mark an operation that SQLite's writer may run in a group commit with others waiting: it writes in one
    unit of work, everything it does outside the database is undone by that unit of work's undo actions or
    is harmless to do again, and it may run again alone (when the group's commit fails, or when its unit of
    work cannot join a group: `Ungroupable`)."""
    operation.group_commit = True  # type: ignore[attr-defined]
    return operation


class Ungroupable(Exception):
    """A unit of work that cannot share a transaction (it writes SR-IOV desired state, whose store follows one
    unit of work at a time) was asked for in a group: the writer commits the group so far and runs the
    operation again alone. Raised before the unit of work begins."""


class Transactions:
    """Units of work on the API's database; vf_store: the SR-IOV driver's desired state when it is kept in
    this database (its writes then join the API's transaction)."""

    def __init__(self, db: Database, vf_store: DbVfStateStore | None = None) -> None:
        self.db = db
        self.vf_store = vf_store
        self._writer = SqliteWriter(db) if db.serialises_writes else None

    def write(self, actor: str, *, sriov: bool = False) -> AbstractContextManager[UnitOfWork]:
        """A write unit of work; sriov: it may change SR-IOV desired state, so the store works in it."""
        if sriov and self.vf_store is not None:
            if self.db.in_group():
                raise Ungroupable("SR-IOV desired state is written one unit of work at a time")
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
        return await self._writer.run(call, grouped=getattr(operation, "group_commit", False))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@dataclass(slots=True)
class _Call:
    run: Callable[[], Any]
    grouped: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


_Outcome = tuple[_Call, bool, Any]  # (the call, whether it returned, what it returned or raised)


class SqliteWriter:
    """SQLite's one writer: a thread that runs the API's writes in the order they came, one at a time, instead
    of many threads contending for SQLite's lock (which kept tail latency long).

    Group commit: the group-committable calls waiting together (`group_committable`, up to GROUP_MAX) run in
    one transaction (`Database.group`), each in a savepoint, and are answered when it has committed. Under
    concurrency that saves most of a transaction's cost per request (BEGIN, COMMIT and the WAL writes of the
    pages each one changes) and one thread switch each way per request (issue 14). A call waiting alone runs
    alone, as before."""

    def __init__(self, db: Database, group_max: int = GROUP_MAX) -> None:
        self.db = db
        self.group_max = group_max
        self.groups = 0  # group commits made, and the calls they carried (the bench reports their mean)
        self.grouped_calls = 0
        self._queue: SimpleQueue[list[_Call] | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._submitted: dict[asyncio.AbstractEventLoop, list[_Call]] = {}  # not yet handed over, per loop
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first write

    async def run(self, call: Callable[[], T], *, grouped: bool = False) -> T:
        if self._closed:
            raise RuntimeError("the database writer is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="vrnic-db-writer", daemon=True)
                self._thread.start()
            waiting = self._submitted.get(loop)
            if waiting is None:
                # Handed over at the loop's next turn, with whatever the requests being handled in this
                # turn submit too: calls that arrive together reach the writer together (a group).
                waiting = self._submitted[loop] = []
                loop.call_soon(self._hand_over, loop)
            waiting.append(_Call(call, grouped, loop, future))
        return await future

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            calls = self._submitted.pop(loop, [])
            if not self._closed:
                self._queue.put(calls)
                return
        _deliver([(call, False, RuntimeError("the database writer is closed")) for call in calls])

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
            thread = self._thread
        if thread is not None:
            thread.join()

    def _serve(self) -> None:
        waiting: deque[_Call] = deque()
        stop = False
        while not (stop and not waiting):
            if not waiting:
                calls = self._queue.get()
                if calls is None:
                    return
                waiting.extend(calls)
            while not stop:  # and whatever else has been handed over meanwhile
                try:
                    calls = self._queue.get_nowait()
                except Empty:
                    break
                if calls is None:
                    stop = True
                else:
                    waiting.extend(calls)
            self._run_some(waiting)

    def _run_some(self, waiting: deque[_Call]) -> None:
        """Run the calls at the head of waiting, in order: a run of two or more group-committable ones (up to
        group_max) as a group, else the first one alone. Their answers go out as soon as they have committed."""
        run: list[_Call] = []
        while waiting and waiting[0].grouped and len(run) < self.group_max:
            run.append(waiting.popleft())
        if len(run) >= 2:
            answered, back = self._group(run)
            waiting.extendleft(reversed(back))
        else:
            answered = [self._alone(run[0] if run else waiting.popleft())]
        _deliver(answered)

    def _group(self, run: list[_Call]) -> tuple[list[_Outcome], list[_Call]]:
        """(the answers, the calls to run after them): a call whose unit of work cannot join goes back, with
        those after it. If the group fails to commit, every call tried in it runs again alone."""
        answered: list[_Outcome] = []
        tried, back = len(run), []
        try:
            with self.db.group() as group:
                for index, call in enumerate(run):
                    try:
                        answered.append((call, True, call.run()))
                    except Ungroupable:
                        call.grouped = False
                        tried, back = index, run[index:]
                        break
                    except Exception as exc:
                        answered.append((call, False, exc))
                        if not group.alive():  # its failure ended the transaction: the commit below fails
                            tried, back = index + 1, run[index + 1:]
                            break
        except Exception as exc:
            log.warning("a group commit of %d writes failed (%s); each runs again alone", tried, exc)
            return [self._alone(call) for call in run[:tried]], run[tried:]
        self.groups += 1
        self.grouped_calls += len(answered)
        return answered, back

    def _alone(self, call: _Call) -> _Outcome:
        try:
            return call, True, call.run()
        except Exception as exc:
            return call, False, exc


def _deliver(answered: list[_Outcome]) -> None:
    """Hand the answers to their event loops: one wake-up per loop for all of them."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    for outcome in answered:
        by_loop.setdefault(outcome[0].loop, []).append(outcome)
    for loop, outcomes in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, outcomes)
        except RuntimeError:  # the loop has closed: nobody waits for these answers any more
            log.debug("an event loop closed before %d writes were answered", len(outcomes))


def _settle(outcomes: list[_Outcome]) -> None:
    for call, returned, value in outcomes:
        if call.future.cancelled():
            continue
        if returned:
            call.future.set_result(value)
        else:
            call.future.set_exception(value)
