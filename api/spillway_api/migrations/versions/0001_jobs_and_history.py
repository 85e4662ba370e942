"""jobs and history

Revision ID: 0001
Revises:
Create Date: 2026-11-30 04:08:31.153398
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import spillway_api.models

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('namespace', sa.String(length=63), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('uid', sa.String(length=64), nullable=True),
    sa.Column('launcher', sa.String(length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('phase', sa.String(length=32), nullable=False),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('plan', sa.JSON(), nullable=True),
    sa.Column('progress', sa.JSON(), nullable=True),
    sa.Column('status', sa.JSON(), nullable=True),
    sa.Column('run_dir', sa.Text(), nullable=True),
    sa.Column('job_file', sa.Text(), nullable=True),
    sa.Column('owner_pid', sa.Integer(), nullable=True),
    sa.Column('events_read', sa.Integer(), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('resource_version', sa.String(length=32), nullable=True),
    sa.Column('created_at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('namespace', 'name', name='uq_jobs_namespace_name')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_namespace_phase', ['namespace', 'phase'], unique=False)

    op.create_table('watch_bookmarks',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('resource_version', sa.String(length=32), nullable=False),
    sa.Column('updated_at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('time', spillway_api.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('sha256', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'name', name='uq_checkpoints_name')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_job_id'), ['job_id'], unique=False)

    op.create_table('cost_entries',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('namespace', sa.String(length=63), nullable=False),
    sa.Column('at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('gpu_hours', sa.Float(), nullable=False),
    sa.Column('usd', sa.Float(), nullable=False),
    sa.Column('source_key', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'source_key', name='uq_cost_source')
    )
    with op.batch_alter_table('cost_entries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cost_entries_job_id'), ['job_id'], unique=False)
        batch_op.create_index('ix_cost_namespace_at', ['namespace', 'at'], unique=False)

    op.create_table('progress_points',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('learning_rate', sa.Float(), nullable=True),
    sa.Column('step_seconds', sa.Float(), nullable=True),
    sa.Column('tokens_per_second', sa.Float(), nullable=True),
    sa.Column('eta_seconds', sa.Float(), nullable=True),
    sa.Column('gpu_bytes', sa.BigInteger(), nullable=True),
    sa.Column('cpu_bytes', sa.BigInteger(), nullable=True),
    sa.Column('nvme_bytes', sa.BigInteger(), nullable=True),
    sa.Column('at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('source_key', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'source_key', name='uq_progress_source')
    )
    with op.batch_alter_table('progress_points', schema=None) as batch_op:
        batch_op.create_index('ix_progress_job_at', ['job_id', 'id'], unique=False)

    op.create_table('rollbacks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('checkpoint', sa.String(length=128), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('requested_by', sa.String(length=253), nullable=False),
    sa.Column('at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('origin', sa.String(length=16), nullable=False),
    sa.Column('from_step', sa.Integer(), nullable=True),
    sa.Column('to_step', sa.Integer(), nullable=True),
    sa.Column('completed_at', spillway_api.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('source_key', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'source_key', name='uq_rollbacks_source')
    )
    with op.batch_alter_table('rollbacks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rollbacks_job_id'), ['job_id'], unique=False)

    op.create_table('transitions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('from_phase', sa.String(length=32), nullable=True),
    sa.Column('to_phase', sa.String(length=32), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('at', spillway_api.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('source_key', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'source_key', name='uq_transitions_source')
    )
    with op.batch_alter_table('transitions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_transitions_job_id'), ['job_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('transitions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_transitions_job_id'))

    op.drop_table('transitions')
    with op.batch_alter_table('rollbacks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rollbacks_job_id'))

    op.drop_table('rollbacks')
    with op.batch_alter_table('progress_points', schema=None) as batch_op:
        batch_op.drop_index('ix_progress_job_at')

    op.drop_table('progress_points')
    with op.batch_alter_table('cost_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_cost_namespace_at')
        batch_op.drop_index(batch_op.f('ix_cost_entries_job_id'))

    op.drop_table('cost_entries')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_job_id'))

    op.drop_table('checkpoints')
    op.drop_table('watch_bookmarks')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_namespace_phase')

    op.drop_table('jobs')
