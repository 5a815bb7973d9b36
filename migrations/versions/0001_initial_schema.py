"""initial schema: hosts, devices, tenants, tokens, vrnics, sriov vfs, events

Revision ID: 0001
Revises:
Create Date: 2026-11-22 04:00:23.497149
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('hosts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('api_url', sa.String(length=512), nullable=True),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_hosts')),
    sa.UniqueConstraint('name', name=op.f('uq_hosts_name'))
    )
    op.create_table('tenants',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('vpc_id', sa.BigInteger(), nullable=False),
    sa.Column('default_quota', sa.JSON(), nullable=False),
    sa.Column('max_vrnics', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name')),
    sa.UniqueConstraint('vpc_id', name=op.f('uq_tenants_vpc_id'))
    )
    op.create_table('api_tokens',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_tokens_tenant_id_tenants'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_tokens_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('devices',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('host_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('driver', sa.String(length=32), nullable=False),
    sa.Column('node_guid', sa.String(length=64), nullable=False),
    sa.Column('ports', sa.JSON(), nullable=False),
    sa.Column('caps', sa.JSON(), nullable=False),
    sa.Column('present', sa.Boolean(), nullable=False),
    sa.Column('discovered_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], name=op.f('fk_devices_host_id_hosts'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_devices')),
    sa.UniqueConstraint('host_id', 'driver', 'name', name=op.f('uq_devices_host_id_driver_name'))
    )
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_host_id'), ['host_id'], unique=False)

    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=80), nullable=False),
    sa.Column('action', sa.String(length=40), nullable=False),
    sa.Column('subject', sa.String(length=80), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_events_tenant_id_tenants'),
                            ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('vrnics',
    sa.Column('serial', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('public_id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('host_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('device_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('device_name', sa.String(length=64), nullable=False),
    sa.Column('quota', sa.JSON(), nullable=False),
    sa.Column('qos', sa.JSON(), nullable=False),
    sa.Column('virtual_gid', sa.String(length=45), nullable=False),
    sa.Column('socket_path', sa.String(length=255), nullable=True),
    sa.Column('attach_extra', sa.JSON(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_vrnics_device_id_devices'),
                            ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], name=op.f('fk_vrnics_host_id_hosts'),
                            ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_vrnics_tenant_id_tenants'),
                            ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('serial', name=op.f('pk_vrnics')),
    sa.UniqueConstraint('public_id', name=op.f('uq_vrnics_public_id')),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name=op.f('uq_vrnics_tenant_id_idempotency_key')),
    sa.UniqueConstraint('virtual_gid', name=op.f('uq_vrnics_virtual_gid')),
    sqlite_autoincrement=True
    )
    with op.batch_alter_table('vrnics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_vrnics_host_id'), ['host_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_vrnics_state'), ['state'], unique=False)
        batch_op.create_index('ix_vrnics_tenant_id_serial', ['tenant_id', 'serial'], unique=False)

    op.create_table('sriov_vfs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('host_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('pf', sa.String(length=64), nullable=False),
    sa.Column('vf_index', sa.Integer(), nullable=False),
    sa.Column('pci_address', sa.String(length=32), nullable=True),
    sa.Column('mac', sa.String(length=17), nullable=True),
    sa.Column('vlan', sa.Integer(), nullable=True),
    sa.Column('qos', sa.Integer(), nullable=True),
    sa.Column('min_tx_rate_mbps', sa.Integer(), nullable=True),
    sa.Column('max_tx_rate_mbps', sa.Integer(), nullable=True),
    sa.Column('trust', sa.Boolean(), nullable=True),
    sa.Column('spoofchk', sa.Boolean(), nullable=True),
    sa.Column('link_state', sa.String(length=16), nullable=True),
    sa.Column('vrnic_serial', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], name=op.f('fk_sriov_vfs_host_id_hosts'),
                            ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['vrnic_serial'], ['vrnics.serial'], name=op.f('fk_sriov_vfs_vrnic_serial_vrnics'),
                            ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sriov_vfs')),
    sa.UniqueConstraint('host_id', 'pf', 'vf_index', name=op.f('uq_sriov_vfs_host_id_pf_vf_index')),
    sa.UniqueConstraint('vrnic_serial', name=op.f('uq_sriov_vfs_vrnic_serial'))
    )
    with op.batch_alter_table('sriov_vfs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sriov_vfs_host_id'), ['host_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('sriov_vfs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sriov_vfs_host_id'))

    op.drop_table('sriov_vfs')
    with op.batch_alter_table('vrnics', schema=None) as batch_op:
        batch_op.drop_index('ix_vrnics_tenant_id_serial')
        batch_op.drop_index(batch_op.f('ix_vrnics_state'))
        batch_op.drop_index(batch_op.f('ix_vrnics_host_id'))

    op.drop_table('vrnics')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_events_at'))

    op.drop_table('events')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_host_id'))

    op.drop_table('devices')
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_tokens_tenant_id'))

    op.drop_table('api_tokens')
    op.drop_table('tenants')
    op.drop_table('hosts')
