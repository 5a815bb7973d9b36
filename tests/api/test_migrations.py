"""Migrations: up from empty and back down, no drift from the models, and the schema check."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from vrnic.db.migrate import check_schema, current_revision, downgrade, head_revision, upgrade
from vrnic.db.models import Base

TABLES = {"hosts", "devices", "tenants", "api_tokens", "vrnics", "sriov_vfs", "events"}


def test_upgrade_from_empty_then_downgrade_to_base(engine: Engine) -> None:
    assert not TABLES & set(inspect(engine).get_table_names())
    upgrade(engine)
    assert set(inspect(engine).get_table_names()) >= TABLES
    assert current_revision(engine) == head_revision()
    check_schema(engine)
    downgrade(engine)
    assert not TABLES & set(inspect(engine).get_table_names())
    assert current_revision(engine) is None


def test_models_and_migrations_do_not_drift(migrated: Engine) -> None:
    with migrated.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_sriov_vf_table_has_what_the_sriov_driver_needs(migrated: Engine) -> None:
    columns = {c["name"] for c in inspect(migrated).get_columns("sriov_vfs")}
    assert {"pf", "vf_index", "pci_address", "mac", "vlan", "qos", "min_tx_rate_mbps", "max_tx_rate_mbps",
            "trust", "spoofchk", "link_state", "vrnic_serial"} <= columns


def test_schema_check_names_the_command_on_an_empty_database(engine: Engine) -> None:
    with pytest.raises(Exception, match="run `vrnic db upgrade`"):
        check_schema(engine)


def test_schema_check_refuses_an_unknown_newer_revision(migrated: Engine) -> None:
    with migrated.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'ffffffff'"))
    with pytest.raises(Exception, match="newer than this vrnic knows"):
        check_schema(migrated)


def test_schema_check_names_the_command_on_an_older_schema(migrated: Engine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # One revision exists so far: pretend the code's head moved on past what this database has.
    from vrnic.db import migrate

    monkeypatch.setattr(migrate, "head_revision", lambda: "0002")
    with pytest.raises(migrate.SchemaOutOfDate, match=r"older than head 0002; run `vrnic db upgrade`"):
        check_schema(migrated)
