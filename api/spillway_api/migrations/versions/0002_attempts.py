"""attempts and evaluations: each run of a job keeps its own outcome, steps and cost;
held-out losses

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 21:40:00

Jobs recorded before this revision get one attempt, number 1, holding their whole
history and their current phase.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import spillway_api.models

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

TERMINAL = ("Succeeded", "Failed", "Diverged", "BudgetExceeded", "Deleted")


def upgrade() -> None:
    op.create_table('attempts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('origin', sa.String(length=16), nullable=False),
    sa.Column('phase', sa.String(length=32), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=True),
    sa.Column('started_at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('ended_at', spillway_api.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('first_step', sa.Integer(), nullable=True),
    sa.Column('last_step', sa.Integer(), nullable=True),
    sa.Column('last_loss', sa.Float(), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'number', name='uq_attempts_number')
    )
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempts_job_id'), ['job_id'], unique=False)
    op.create_table('evaluations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('tokens', sa.BigInteger(), nullable=True),
    sa.Column('at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('source_key', sa.String(length=128), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'source_key', name='uq_evaluations_source')
    )
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evaluations_job_id'), ['job_id'], unique=False)
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), server_default='0', nullable=False))
    for table in ('transitions', 'progress_points', 'cost_entries'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('attempt', sa.Integer(), nullable=True))
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('eval_loss', sa.Float(), nullable=True))

    # What was recorded before: one attempt per job that has a history.
    terminal = ", ".join(f"'{phase}'" for phase in TERMINAL)
    op.execute(
        "INSERT INTO attempts (job_id, number, origin, phase, reason, spec, started_at, ended_at, first_step, "
        "last_step, exit_code) "
        "SELECT j.id, 1, 'submit', j.phase, j.message, j.spec, j.created_at, "
        f"CASE WHEN j.phase IN ({terminal}) THEN j.updated_at END, "
        "(SELECT MIN(p.step) FROM progress_points p WHERE p.job_id = j.id), "
        "(SELECT MAX(p.step) FROM progress_points p WHERE p.job_id = j.id), j.exit_code "
        "FROM jobs j WHERE EXISTS (SELECT 1 FROM transitions t WHERE t.job_id = j.id)")
    op.execute("UPDATE jobs SET attempt = 1 WHERE id IN (SELECT job_id FROM attempts)")
    for table in ('transitions', 'progress_points', 'cost_entries'):
        op.execute(f"UPDATE {table} SET attempt = 1")


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('eval_loss')
    for table in ('cost_entries', 'progress_points', 'transitions'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('attempt')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('attempt')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempts_job_id'))
    op.drop_table('attempts')
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evaluations_job_id'))
    op.drop_table('evaluations')
