"""multi-host: hosts.state, devices.max_vrnics, tenants.vpc_cidr, vrnics.virtual_ip, security_rules, and an
index for counting a device's live vRNICs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 16:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LIVE = "state != 'released'"


# Plain ALTER TABLE, as 0003 and 0004 (a batch rebuild on SQLite would lose vrnics' AUTOINCREMENT).
def upgrade() -> None:
    op.add_column('hosts', sa.Column('state', sa.String(length=8), server_default='up', nullable=False))
    op.add_column('devices', sa.Column('max_vrnics', sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('vpc_cidr', sa.String(length=43), server_default='10.0.0.0/16',
                                       nullable=False))
    op.add_column('vrnics', sa.Column('virtual_ip', sa.String(length=45), nullable=True))
    op.create_index('uq_vrnics_live_virtual_ip', 'vrnics', ['tenant_id', 'virtual_ip'], unique=True,
                    sqlite_where=sa.text(_LIVE), postgresql_where=sa.text(_LIVE))
    op.create_index('ix_vrnics_device_id_state', 'vrnics', ['device_id', 'state'], unique=False)
    op.create_table(
        'security_rules',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('action', sa.String(length=8), nullable=False),
        sa.Column('peer_tenant', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_security_rules_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_security_rules')),
        sa.UniqueConstraint('tenant_id', 'action', 'peer_tenant',
                            name=op.f('uq_security_rules_tenant_id_action_peer_tenant')),
    )
    op.create_index(op.f('ix_security_rules_tenant_id'), 'security_rules', ['tenant_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_security_rules_tenant_id'), table_name='security_rules')
    op.drop_table('security_rules')
    op.drop_index('ix_vrnics_device_id_state', table_name='vrnics')
    op.drop_index('uq_vrnics_live_virtual_ip', table_name='vrnics')
    op.drop_column('vrnics', 'virtual_ip')
    op.drop_column('tenants', 'vpc_cidr')
    op.drop_column('devices', 'max_vrnics')
    op.drop_column('hosts', 'state')
