"""vrnics.vm_domain: the libvirt domain a vRNIC is attached to

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 08:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('vrnics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('vm_domain', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('vrnics', schema=None) as batch_op:
        batch_op.drop_column('vm_domain')
