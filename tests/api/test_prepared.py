"""vrnic.db.prepared on SQLite and PostgreSQL: a Prepared statement sends what Connection.execute sends and
returns the same rows, turns DBAPI errors into SQLAlchemy's, and refuses what needs SQLAlchemy's execution."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, cast

import pytest
from sqlalchemy import Engine, Table, bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError, InvalidRequestError, StatementError

from vrnic.db.prepared import Prepared
from vrnic.db.tables import Event, Tenant

TENANTS = cast(Table, Tenant.__table__)
EVENTS = cast(Table, Event.__table__)
AT = datetime(2026, 11, 27, 9, 30, 15, 123456)


def _tenant(name: str, vpc_id: int) -> dict[str, Any]:
    return {"name": name, "vpc_id": vpc_id, "default_quota": {"max_qps": 7, "nested": [1, "two"]},
            "max_vrnics": None, "vpc_cidr": "10.9.0.0/16", "created_at": AT}


def test_insert_returning_select_and_update_match_connection_execute(migrated: Engine) -> None:
    insert_tenant = insert(TENANTS).returning(TENANTS.c.id)
    by_id = select(TENANTS).where(TENANTS.c.id == bindparam("b_id"))
    rename = update(TENANTS).where(TENANTS.c.id == bindparam("b_id"))
    with migrated.begin() as c:
        core_id = c.execute(insert_tenant, _tenant("core", 1)).scalar_one()
        prepared_id = Prepared(insert_tenant).scalar(c, _tenant("prepared", 2))
        assert isinstance(prepared_id, int) and prepared_id == core_id + 1
        core = c.execute(by_id, {"b_id": prepared_id}).one()
        row = Prepared(by_id).first(c, {"b_id": prepared_id})
        # same values, same types (the JSON column decoded, the timestamp a datetime), same attribute names
        assert tuple(row) == tuple(core)
        assert row._fields == tuple(core._fields)
        assert row.default_quota == {"max_qps": 7, "nested": [1, "two"]} and row.created_at.replace(tzinfo=None) == AT
        assert Prepared(by_id).first(c, {"b_id": 10_000}) is None
        assert Prepared(by_id).scalar(c, {"b_id": 10_000}) is None
        assert Prepared(rename).rows(c, {"name": "renamed", "b_id": prepared_id}) == []
        assert c.execute(select(TENANTS.c.name).where(TENANTS.c.id == prepared_id)).scalar_one() == "renamed"
        # another set of parameter names compiles another statement: here it also sets max_vrnics
        Prepared(rename).execute(c, {"name": "again", "max_vrnics": 3, "b_id": prepared_id})
        assert tuple(c.execute(select(TENANTS.c.name, TENANTS.c.max_vrnics)
                               .where(TENANTS.c.id == prepared_id)).one()) == ("again", 3)


def test_the_rows_written_read_back_alike_through_sqlalchemy(migrated: Engine) -> None:
    """What a Prepared writes (a JSON column, an aware timestamp) reads back through the ORM's Core exactly as
    what Connection.execute writes: the column types' bind processors were applied."""
    aware = datetime(2026, 11, 27, 10, 0, 0, 5, tzinfo=timezone(timedelta(hours=1)))
    detail = {"mode": "paravirtual", "n": 3, "list": [None, True]}
    values = {"at": aware, "actor": "operator", "action": "t.one", "subject": "x/1", "tenant_id": None,
              "detail": detail}
    with migrated.begin() as c:
        c.execute(insert(EVENTS), values)
        Prepared(insert(EVENTS)).execute(c, {**values, "action": "t.two"})
        got = c.execute(select(EVENTS.c.action, EVENTS.c.at, EVENTS.c.detail).order_by(EVENTS.c.id)).all()
    assert [g.action for g in got] == ["t.one", "t.two"]
    assert got[0].at == got[1].at and got[0].detail == got[1].detail == detail


def test_a_unique_clash_is_sqlalchemys_integrity_error_and_the_transaction_rolls_back(migrated: Engine) -> None:
    insert_tenant = Prepared(insert(TENANTS))
    with pytest.raises(IntegrityError) as caught, migrated.begin() as c:
        insert_tenant.execute(c, _tenant("twice", 1))
        insert_tenant.execute(c, _tenant("twice", 2))
    assert "INSERT INTO tenants" in str(caught.value.statement)
    with migrated.connect() as c:
        assert c.execute(select(TENANTS.c.id)).all() == []


def test_what_needs_sqlalchemys_execution_is_refused_when_compiled(migrated: Engine) -> None:
    with migrated.begin() as c:
        # Event.at and Event.detail have Python-side defaults, which only Connection.execute fills in
        with pytest.raises(ValueError, match="Python-side column defaults"):
            Prepared(insert(EVENTS)).execute(c, {"actor": "a", "action": "b", "subject": "c", "tenant_id": None})
        # an IN list is expanded at every execution
        with pytest.raises(ValueError, match="rendered at execution"):
            Prepared(select(TENANTS.c.id).where(TENANTS.c.id.in_([1, 2]))).rows(c)


def test_bound_values_come_from_the_caller_the_statement_or_a_callable_as_in_connection_execute(
        migrated: Engine) -> None:
    """The caller's parameter (by key), a value the statement carries, and a callable's value taken at each
    execution; a parameter with no value is refused as Connection.execute refuses it."""
    names = iter(["first", "second"])
    by_name = select(TENANTS.c.vpc_id).where(TENANTS.c.name == bindparam("b_name", callable_=lambda: next(names)))
    with migrated.begin() as c:
        for n, name in enumerate(("first", "second", "third"), start=1):
            Prepared(insert(TENANTS)).execute(c, _tenant(name, n))
        with_value = select(TENANTS.c.vpc_id).where(TENANTS.c.name == "third", TENANTS.c.vpc_id > bindparam("b_min"))
        assert Prepared(with_value).rows(c, {"b_min": 0}) == [(3,)] == c.execute(with_value, {"b_min": 0}).all()
        assert Prepared(with_value).rows(c, {"b_min": 3}) == []
        prepared = Prepared(by_name)
        assert [prepared.scalar(c), prepared.scalar(c)] == [1, 2]  # the callable, again at each execution
        assert prepared.scalar(c, {"b_name": "third"}) == 3  # the caller's value wins
        missing = select(TENANTS.c.vpc_id).where(TENANTS.c.name == bindparam("b_name"))
        with pytest.raises(StatementError, match="A value is required for bind parameter 'b_name'"):
            c.execute(missing)  # (SQLAlchemy wraps the same error with the statement)
        with pytest.raises(InvalidRequestError, match="A value is required for bind parameter 'b_name'"):
            Prepared(missing).rows(c)
