"""sriov_vfs as SR-IOV desired state: netns, vanished; one live holder per VF

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 05:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NOT_VANISHED = sa.text('NOT vanished')


def upgrade() -> None:
    with op.batch_alter_table('sriov_vfs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('netns', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('vanished', sa.Boolean(), server_default=sa.false(), nullable=False))
        # A vanished allocation keeps its index until released while a new vRNIC may take the re-created VF:
        # the VF is unique among live holders only.
        batch_op.drop_constraint('uq_sriov_vfs_host_id_pf_vf_index', type_='unique')
        batch_op.create_index('uq_sriov_vfs_held_vf', ['host_id', 'pf', 'vf_index'], unique=True,
                              sqlite_where=NOT_VANISHED, postgresql_where=NOT_VANISHED)


def downgrade() -> None:
    op.execute(sa.text('DELETE FROM sriov_vfs WHERE vanished'))  # the old schema cannot hold them
    with op.batch_alter_table('sriov_vfs', schema=None) as batch_op:
        batch_op.drop_index('uq_sriov_vfs_held_vf')
        batch_op.create_unique_constraint('uq_sriov_vfs_host_id_pf_vf_index', ['host_id', 'pf', 'vf_index'])
        batch_op.drop_column('vanished')
        batch_op.drop_column('netns')
