"""preference metrics: a DPO step's rewards and log-probabilities beside its loss, and a
held-out evaluation's, under TRL's names

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05 01:20:00

Rows recorded before this revision have none (null).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ('progress_points', 'evaluations'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('preference', sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in ('evaluations', 'progress_points'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('preference')
