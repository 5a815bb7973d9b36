"""Migrations: up from empty and back down, no drift from the models, and the schema check."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError

from vrnic.db.migrate import current_revision, downgrade, head_revision, upgrade
from vrnic.db.schema import SCHEMA_HEAD, SchemaOutOfDate, check_schema
from vrnic.db.tables import Base

TABLES = {"hosts", "devices", "tenants", "api_tokens", "vrnics", "sriov_vfs", "events"}


def test_upgrade_from_empty_then_downgrade_to_base(engine: Engine) -> None:
    assert not TABLES & set(inspect(engine).get_table_names())
    upgrade(engine)
    assert set(inspect(engine).get_table_names()) >= TABLES
    assert current_revision(engine) == head_revision() == SCHEMA_HEAD  # the daemon's check knows the head
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


def test_schema_check_names_the_command_on_an_older_schema(migrated: Engine) -> None:
    downgrade(migrated, "0001")
    with pytest.raises(SchemaOutOfDate, match=rf"at schema 0001, older than head {head_revision()}; "
                                              r"run `vrnic db upgrade`"):
        check_schema(migrated)


def test_sriov_desired_state_columns_and_one_live_holder_per_vf(migrated: Engine) -> None:
    columns = {c["name"]: c for c in inspect(migrated).get_columns("sriov_vfs")}
    assert {"netns", "vanished"} <= set(columns) and not columns["vanished"]["nullable"]
    with migrated.begin() as connection:
        connection.execute(text("INSERT INTO hosts (name, version, registered_at, last_seen_at) "
                                "VALUES ('h', '0', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        insert = text("INSERT INTO sriov_vfs (host_id, pf, vf_index, vanished, updated_at) "
                      "VALUES (1, 'eth0', 3, :vanished, CURRENT_TIMESTAMP)")
        connection.execute(insert, {"vanished": True})
        connection.execute(insert, {"vanished": False})  # a vanished holder does not block the re-created VF
    with pytest.raises(IntegrityError), migrated.begin() as connection:
        connection.execute(insert, {"vanished": False})
    downgrade(migrated, "0001")  # the vanished row goes, the live one stays under the old unique constraint
    with migrated.connect() as connection:
        assert connection.execute(text("SELECT pf, vf_index FROM sriov_vfs")).all() == [("eth0", 3)]
    upgrade(migrated)
    with migrated.connect() as connection:
        assert connection.execute(text("SELECT vanished, netns FROM sriov_vfs")).all() == [(False, None)]


def test_vrnic_vm_domain_is_added_and_dropped_in_place(migrated: Engine) -> None:
    columns = {c["name"]: c for c in inspect(migrated).get_columns("vrnics")}
    assert columns["vm_domain"]["nullable"]
    with migrated.begin() as connection:
        connection.execute(text("INSERT INTO hosts (name, version, registered_at, last_seen_at) "
                                "VALUES ('h', '0', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        connection.execute(text("INSERT INTO tenants (name, vpc_id, default_quota, created_at) "
                                "VALUES ('t', 1, '{}', CURRENT_TIMESTAMP)"))
        connection.execute(text(
            "INSERT INTO vrnics (public_id, tenant_id, mode, state, host_id, device_name, quota, qos, virtual_gid, "
            "attach_extra, created_at, updated_at, vm_domain) VALUES ('vr-1', 1, 'paravirtual', 'allocated', 1, "
            "'fake0', '{}', '{}', 'gid-1', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 'vm-1')"))
        connection.execute(text("INSERT INTO sriov_vfs (host_id, pf, vf_index, vanished, vrnic_serial, updated_at) "
                                "VALUES (1, 'eth0', 0, false, 1, CURRENT_TIMESTAMP)"))
    downgrade(migrated, "0002")
    assert "vm_domain" not in {c["name"] for c in inspect(migrated).get_columns("vrnics")}
    with migrated.connect() as connection:  # the rows stay, and so does what refers to them
        assert connection.execute(text("SELECT public_id FROM vrnics")).all() == [("vr-1",)]
        assert connection.execute(text("SELECT vrnic_serial FROM sriov_vfs")).all() == [(1,)]
    upgrade(migrated)
    with migrated.connect() as connection:
        assert connection.execute(text("SELECT public_id, vm_domain FROM vrnics")).all() == [("vr-1", None)]


def test_vrnic_engine_is_added_as_ring_and_dropped_in_place(migrated: Engine) -> None:
    column = {c["name"]: c for c in inspect(migrated).get_columns("vrnics")}["engine"]
    assert not column["nullable"]
    downgrade(migrated, "0003")
    assert "engine" not in {c["name"] for c in inspect(migrated).get_columns("vrnics")}
    row = ("INSERT INTO vrnics (public_id, tenant_id, mode, state, host_id, device_name, quota, qos, virtual_gid, "
           "attach_extra, created_at, updated_at{}) VALUES ('vr-{}', 1, 'paravirtual', 'allocated', 1, 'fake0', "
           "'{{}}', '{{}}', 'gid-{}', '{{}}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP{})")
    with migrated.begin() as connection:  # a vRNIC from before engines existed
        connection.execute(text("INSERT INTO hosts (name, version, registered_at, last_seen_at) "
                                "VALUES ('h', '0', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        connection.execute(text("INSERT INTO tenants (name, vpc_id, default_quota, created_at) "
                                "VALUES ('t', 1, '{}', CURRENT_TIMESTAMP)"))
        connection.execute(text(row.format("", 1, 1, "")))
        connection.execute(text("INSERT INTO sriov_vfs (host_id, pf, vf_index, vanished, vrnic_serial, updated_at) "
                                "VALUES (1, 'eth0', 0, false, 1, CURRENT_TIMESTAMP)"))
    upgrade(migrated)
    with migrated.begin() as connection:  # it keeps the engine it always had
        assert connection.execute(text("SELECT public_id, engine FROM vrnics")).all() == [("vr-1", "ring")]
        connection.execute(text(row.format(", engine", 2, 2, ", 'direct'")))
    if migrated.dialect.name == "sqlite":  # altered in place: serials are still never reused
        with migrated.connect() as connection:
            assert "AUTOINCREMENT" in connection.scalar(text("SELECT sql FROM sqlite_master WHERE name = 'vrnics'"))
    downgrade(migrated, "0003")
    assert "engine" not in {c["name"] for c in inspect(migrated).get_columns("vrnics")}
    with migrated.connect() as connection:  # the rows stay, and so does what refers to them
        assert connection.execute(text("SELECT public_id FROM vrnics ORDER BY serial")).all() == [("vr-1",), ("vr-2",)]
        assert connection.execute(text("SELECT vrnic_serial FROM sriov_vfs")).all() == [(1,)]


def test_multi_host_columns_and_one_live_holder_per_virtual_ip(migrated: Engine) -> None:
    assert {c["name"] for c in inspect(migrated).get_columns("hosts")} >= {"state"}
    assert "security_rules" in inspect(migrated).get_table_names()
    vrnic = ("INSERT INTO vrnics (public_id, tenant_id, mode, state, host_id, device_name, quota, qos, virtual_gid, "
             "attach_extra, created_at, updated_at, virtual_ip) VALUES (:id, :tenant, 'paravirtual', :state, 1, "
             "'fake0', '{}', '{}', :id, '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, :ip)")
    with migrated.begin() as connection:  # hosts and tenants from before 0005 get its defaults
        connection.execute(text("INSERT INTO hosts (name, version, registered_at, last_seen_at) "
                                "VALUES ('h', '0', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        for tenant, vpc in (("t", 1), ("u", 2)):
            connection.execute(text("INSERT INTO tenants (name, vpc_id, default_quota, created_at) "
                                    "VALUES (:n, :v, '{}', CURRENT_TIMESTAMP)"), {"n": tenant, "v": vpc})
        assert connection.execute(text("SELECT state FROM hosts")).all() == [("up",)]
        assert connection.execute(text("SELECT DISTINCT vpc_cidr FROM tenants")).all() == [("10.0.0.0/16",)]
        connection.execute(text(vrnic), {"id": "vr-1", "tenant": 1, "state": "released", "ip": "10.0.0.1"})
        connection.execute(text(vrnic), {"id": "vr-2", "tenant": 1, "state": "allocated", "ip": "10.0.0.1"})
        connection.execute(text(vrnic), {"id": "vr-3", "tenant": 2, "state": "allocated", "ip": "10.0.0.1"})
    with pytest.raises(IntegrityError), migrated.begin() as connection:  # a second live holder in one tenant
        connection.execute(text(vrnic), {"id": "vr-4", "tenant": 1, "state": "attached", "ip": "10.0.0.1"})
    downgrade(migrated, "0004")
    assert "virtual_ip" not in {c["name"] for c in inspect(migrated).get_columns("vrnics")}
    assert "security_rules" not in inspect(migrated).get_table_names()
    with migrated.connect() as connection:  # the rows stay
        assert connection.execute(text("SELECT public_id FROM vrnics ORDER BY serial")).all() == [
            ("vr-1",), ("vr-2",), ("vr-3",)]
    upgrade(migrated)
    check_schema(migrated)
