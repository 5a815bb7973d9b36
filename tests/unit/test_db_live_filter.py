"""The live-vRNIC filter (vrnic.db.tables.vrnic_is_live): the partial index's own predicate, with 'released' in
the SQL rather than bound. A bound value there made SQLite prepare each statement again at every execution."""

from __future__ import annotations

from typing import cast

import pytest
from sqlalchemy import Index, Table, select
from sqlalchemy.dialects import postgresql, sqlite

from vrnic.api import vrnics
from vrnic.db.tables import LIVE_VRNIC, Vrnic, vrnic_is_live

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.dialect()], ids=["sqlite", "postgresql"])
def test_the_live_filter_renders_released_inline_on_core_and_orm_columns(dialect: object) -> None:
    table = cast(Table, Vrnic.__table__)
    for state in (table.c.state, Vrnic.state):
        compiled = select(table.c.serial).where(vrnic_is_live(state)).compile(dialect=dialect)  # type: ignore[arg-type]
        assert compiled.params == {}
        assert str(compiled).endswith("WHERE vrnics.state != 'released'")


def test_the_partial_index_and_the_allocations_newest_address_query_use_the_same_predicate() -> None:
    index = next(i for i in cast(Table, Vrnic.__table__).indexes if i.name == "uq_vrnics_live_virtual_ip")
    assert isinstance(index, Index)
    assert str(index.dialect_options["sqlite"]["where"]) == LIVE_VRNIC
    assert str(index.dialect_options["postgresql"]["where"]) == LIVE_VRNIC
    newest = vrnics._NEWEST_IP.statement.compile(dialect=sqlite.dialect())
    assert "vrnics.state != 'released'" in str(newest)
    assert "released" not in [str(v) for v in newest.params.values()]
