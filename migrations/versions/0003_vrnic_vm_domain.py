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


# Plain ALTER TABLE, not batch mode: on SQLite a batch rebuild of vrnics would lose its AUTOINCREMENT (serials,
# and so virtual GIDs, must never be reused) and, with foreign keys on, null sriov_vfs.vrnic_serial.
def upgrade() -> None:
    op.add_column('vrnics', sa.Column('vm_domain', sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column('vrnics', 'vm_domain')
