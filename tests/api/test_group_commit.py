"""Group commit on SQLite (issue 14): `Database.group` runs several write units of work in one transaction,
each in a savepoint, and `SqliteWriter` groups the group-committable writes that wait together. Each write
still succeeds or fails alone as far as its caller can tell, nothing of a failed group is committed, and every
write of a failed group runs again alone."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, select

from vrnic.api.auth import OPERATOR
from vrnic.api.controlplane import ControlPlane
from vrnic.api.schemas import TenantCreate, VrnicCreate
from vrnic.api.transactions import SqliteWriter, Transactions, group_committable
from vrnic.backend.service import BackendService
from vrnic.db.engine import make_engine
from vrnic.db.migrate import upgrade
from vrnic.db.tables import Event, Tenant
from vrnic.db.unit_of_work import Database, GroupBroken
from vrnic.db.vf_store import DbVfStateStore


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'vrnic.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def db(sqlite_engine: Engine) -> Database:
    return Database(sqlite_engine)


def _tenants(engine: Engine) -> list[str]:
    """The tenants committed, read on a connection of another process's kind (plain sqlite3)."""
    with sqlite3.connect(str(engine.url.database)) as raw:
        return [name for (name,) in raw.execute("SELECT name FROM tenants ORDER BY vpc_id")]


def _add(db: Database, name: str, vpc_id: int, *, undone: list[str] | None = None,
         fail: bool = False) -> str:
    with db.write("operator") as uow:
        uow.session.add(Tenant(name=name, vpc_id=vpc_id, default_quota={}))
        uow.record("tenant.create", f"tenant/{name}", None, {})
        if undone is not None:
            uow.on_failure(lambda: undone.append(name))
        if fail:
            raise ValueError(f"{name} failed")
    return name


# -- Database.group ---------------------------------------------------------------------------------


def test_a_group_commits_its_units_of_work_together_when_it_ends(db: Database, sqlite_engine: Engine) -> None:
    with db.group():
        _add(db, "a", 1)
        _add(db, "b", 2)
        assert _tenants(sqlite_engine) == []  # nothing is visible outside before the group commits
    assert _tenants(sqlite_engine) == ["a", "b"]
    with db.read() as uow:
        assert uow.session.scalar(select(func.count()).select_from(Event)) == 2


def test_a_unit_of_work_that_fails_in_a_group_rolls_back_alone_and_is_undone_at_once(
        db: Database, sqlite_engine: Engine) -> None:
    undone: list[str] = []
    with db.group():
        _add(db, "a", 1, undone=undone)
        with pytest.raises(ValueError, match="b failed"):
            _add(db, "b", 2, undone=undone, fail=True)
        assert undone == ["b"]  # its undo did not wait for the group
        _add(db, "c", 3, undone=undone)
    assert _tenants(sqlite_engine) == ["a", "c"] and undone == ["b"]
    with db.read() as uow:
        assert uow.session.scalars(select(Event.subject).order_by(Event.id)).all() == ["tenant/a", "tenant/c"]


def test_a_group_whose_commit_fails_commits_nothing_and_undoes_every_unit_in_reverse(
        db: Database, sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    undone: list[str] = []

    def commit_fails(self: Connection) -> None:
        raise ConnectionError("the disk went away at COMMIT")

    with pytest.raises(ConnectionError):  # noqa: SIM117 - the patch must cover only the block
        with monkeypatch.context() as patch:
            patch.setattr(Connection, "commit", commit_fails)
            with db.group():
                _add(db, "a", 1, undone=undone)
                _add(db, "b", 2, undone=undone)
    assert undone == ["b", "a"] and _tenants(sqlite_engine) == []
    _add(db, "after", 9)  # and the database is usable: the group let go of its lock and connection
    assert _tenants(sqlite_engine) == ["after"]


def test_a_read_in_a_group_sees_what_the_group_wrote(db: Database) -> None:
    with db.group():
        _add(db, "a", 1)
        with db.read() as uow:
            assert uow.session.scalar(select(Tenant.name)) == "a"


def test_after_the_groups_transaction_ended_no_unit_of_work_commits_on_its_own(
        db: Database, sqlite_engine: Engine) -> None:
    """SQLite ends the whole transaction on some errors; a savepoint begun after that would be a transaction of
    its own, committed at its RELEASE. The group refuses to go on instead, and commits nothing."""
    undone: list[str] = []
    with pytest.raises(GroupBroken), db.group() as group:
        _add(db, "a", 1, undone=undone)
        group.connection.connection.driver_connection.execute("ROLLBACK")  # type: ignore[union-attr]
        assert not group.alive()
        _add(db, "b", 2, undone=undone)
    assert _tenants(sqlite_engine) == [] and undone == ["a"]


def test_groups_do_not_nest_and_are_sqlite_s_only(db: Database) -> None:
    with db.group(), pytest.raises(RuntimeError, match="inside a group"), db.group():
        pass
    db.serialises_writes = False  # as on PostgreSQL
    with pytest.raises(NotImplementedError), db.group():
        pass


# -- SqliteWriter ----------------------------------------------------------------------------------


def _writes(db: Database) -> tuple[Transactions, SqliteWriter]:
    tx = Transactions(db)
    assert isinstance(tx._writer, SqliteWriter)
    return tx, tx._writer


async def _together(tx: Transactions, *calls: tuple[Callable[..., Any], tuple[Any, ...]]) -> list[Any]:
    """Submit the calls in one turn of the event loop (as requests that arrive together), and gather their
    answers (an exception is an answer)."""
    return await asyncio.gather(*(tx.run_write(operation, *args) for operation, args in calls),
                                return_exceptions=True)


def test_writes_submitted_together_commit_as_one_group_and_each_gets_its_own_answer(
        db: Database, sqlite_engine: Engine) -> None:
    tx, writer = _writes(db)
    add = group_committable(lambda name, vpc, fail=False: _add(db, name, vpc, fail=fail))
    try:
        answers = asyncio.run(_together(tx, (add, ("a", 1)), (add, ("b", 2, True)), (add, ("c", 3))))
    finally:
        tx.close()
    assert answers[0] == "a" and answers[2] == "c"
    assert isinstance(answers[1], ValueError) and str(answers[1]) == "b failed"
    assert (writer.groups, writer.grouped_calls) == (1, 3)
    assert _tenants(sqlite_engine) == ["a", "c"]


def test_writes_not_marked_group_committable_run_alone_in_the_order_they_came(
        db: Database, sqlite_engine: Engine) -> None:
    tx, writer = _writes(db)
    try:
        answers = asyncio.run(_together(tx, *((_add, (db, name, vpc)) for vpc, name in enumerate("abc", 1))))
    finally:
        tx.close()
    assert answers == ["a", "b", "c"] and writer.groups == 0 and _tenants(sqlite_engine) == ["a", "b", "c"]


def test_when_a_groups_commit_fails_each_of_its_writes_runs_again_alone(
        db: Database, sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    tx, writer = _writes(db)
    attempts: list[str] = []
    undone: list[str] = []
    commit = Connection.commit
    failed: list[bool] = []

    def commit_fails_once(self: Connection) -> None:
        if not failed:
            failed.append(True)
            raise ConnectionError("the disk went away at COMMIT")
        commit(self)

    @group_committable
    def add(name: str, vpc_id: int) -> str:
        attempts.append(name)
        return _add(db, name, vpc_id, undone=undone)

    monkeypatch.setattr(Connection, "commit", commit_fails_once)
    try:
        answers = asyncio.run(_together(tx, (add, ("a", 1)), (add, ("b", 2))))
    finally:
        tx.close()
    assert answers == ["a", "b"]
    assert attempts == ["a", "b", "a", "b"] and undone == ["b", "a"]  # the group's, undone; then one by one
    assert writer.groups == 0 and _tenants(sqlite_engine) == ["a", "b"]


def test_an_sriov_write_leaves_the_group_and_runs_alone_after_the_writes_before_it(
        db: Database, sqlite_engine: Engine) -> None:
    """The SR-IOV store follows one unit of work at a time: its writes never join a group. The group so far
    commits, then the SR-IOV write runs alone, then the rest."""
    tx = Transactions(db, DbVfStateStore(sqlite_engine, "test-host"))
    writer = tx._writer
    assert isinstance(writer, SqliteWriter)
    order: list[str] = []

    @group_committable
    def add(name: str, vpc_id: int, sriov: bool = False) -> str:
        order.append(f"{name} tried{' (grouped)' if db.in_group() else ''}")
        with tx.write("operator", sriov=sriov) as uow:
            uow.session.add(Tenant(name=name, vpc_id=vpc_id, default_quota={}))
        return name

    try:
        answers = asyncio.run(_together(tx, (add, ("a", 1)), (add, ("b", 2)), (add, ("vf", 3, True)),
                                        (add, ("c", 4)), (add, ("d", 5))))
    finally:
        tx.close()
    assert answers == ["a", "b", "vf", "c", "d"]
    assert order == ["a tried (grouped)", "b tried (grouped)", "vf tried (grouped)", "vf tried",
                     "c tried (grouped)", "d tried (grouped)"]
    assert (writer.groups, writer.grouped_calls) == (2, 4)
    assert _tenants(sqlite_engine) == ["a", "b", "vf", "c", "d"]


def test_writes_submitted_as_the_writer_closes_are_refused_not_left_waiting(db: Database) -> None:
    tx, _ = _writes(db)

    async def main() -> BaseException | str:
        pending = asyncio.ensure_future(tx.run_write(_add, db, "late", 1))
        await asyncio.sleep(0)  # submitted; handed over at the loop's next turn
        tx.close()
        try:
            return await asyncio.wait_for(pending, 10)
        except RuntimeError as exc:
            return exc

    answer = asyncio.run(main())
    assert isinstance(answer, RuntimeError) and "closed" in str(answer)


def test_concurrent_allocations_in_a_group_are_distinct_and_an_idempotent_retry_in_it_is_replayed(
        sqlite_engine: Engine, backend: BackendService) -> None:
    """The control plane's own allocate, grouped: each vRNIC gets its own address and GID, and a request that
    repeats an Idempotency-Key of the same group gets the vRNIC the first one made (it reads in the group)."""
    cp = ControlPlane(sqlite_engine, backend, host_name="test-host", operator_token="vro_test")
    try:
        cp.inventory.register_host()
        who = cp.tenants.authenticate(cp.tenants.create_tenant(OPERATOR, TenantCreate(name="acme")).token)
        body = VrnicCreate()

        async def main() -> list[Any]:
            plain = [cp.write(cp.vrnics.allocate, who, body) for _ in range(6)]
            keyed = [cp.write(cp.vrnics.allocate, who, body, "key-1") for _ in range(2)]
            return await asyncio.gather(*plain, *keyed)

        answers = asyncio.run(main())
        writer = cp.tx._writer
        assert isinstance(writer, SqliteWriter) and writer.groups == 1 and writer.grouped_calls == 8
        outs = [out for out, _ in answers]
        assert [replayed for _, replayed in answers] == [False] * 7 + [True]
        assert outs[6].id == outs[7].id
        assert len({o.id for o in outs[:7]}) == 7 and len({o.virtual_ip for o in outs[:7]}) == 7
        assert len({o.virtual_gid for o in outs[:7]}) == 7
        assert sorted(backend.vrnic_ids()) == sorted(o.id for o in outs[:7])
    finally:
        cp.close()
