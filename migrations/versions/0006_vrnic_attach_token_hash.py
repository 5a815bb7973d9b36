"""crash recovery: vrnics.attach_token_hash, so a restarted vrnicd recognizes the token a guest already holds

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 19:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE, as 0003 to 0005 (a batch rebuild on SQLite would lose vrnics' AUTOINCREMENT).
def upgrade() -> None:
    op.add_column('vrnics', sa.Column('attach_token_hash', sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column('vrnics', 'attach_token_hash')
