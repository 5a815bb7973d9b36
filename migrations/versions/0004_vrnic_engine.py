"""vrnics.engine: a paravirtual vRNIC's data-path engine (ring or direct)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 10:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE, as 0003 (a batch rebuild on SQLite would lose vrnics' AUTOINCREMENT); the server default
# gives every existing vRNIC the engine it has always had.
def upgrade() -> None:
    op.add_column('vrnics', sa.Column('engine', sa.String(length=16), server_default='ring', nullable=False))


def downgrade() -> None:
    op.drop_column('vrnics', 'engine')
