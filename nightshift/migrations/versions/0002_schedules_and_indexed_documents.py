"""schedules, schedule runs (unique run key per due time) and indexed documents

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 14:51:46.836581
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('schedules',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('cron', sa.String(length=120), nullable=False),
    sa.Column('timezone', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('source', sa.JSON(), nullable=False),
    sa.Column('prompt_template', sa.JSON(), nullable=True),
    sa.Column('index_prefix', sa.String(length=1024), nullable=True),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('fire_after', sa.Float(), nullable=False),
    sa.Column('next_due_at', sa.Float(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_schedules_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedules')),
    sa.UniqueConstraint('project_id', 'name', name=op.f('uq_schedules_project_id_name'))
    )
    op.create_index('ix_schedules_status_next_due_at', 'schedules', ['status', 'next_due_at'], unique=False)
    op.create_table('indexed_documents',
    sa.Column('schedule_id', sa.String(length=64), nullable=False),
    sa.Column('doc_key', sa.String(length=1024), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('output_key', sa.String(length=1024), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('indexed_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], name=op.f('fk_indexed_documents_schedule_id_schedules'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('schedule_id', 'doc_key', name=op.f('pk_indexed_documents'))
    )
    op.create_table('schedule_runs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('schedule_id', sa.String(length=64), nullable=False),
    sa.Column('due_at', sa.Float(), nullable=False),
    sa.Column('fired_at', sa.Float(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=True),
    sa.Column('input_file_id', sa.String(length=64), nullable=True),
    sa.Column('documents_total', sa.Integer(), nullable=False),
    sa.Column('documents_selected', sa.Integer(), nullable=False),
    sa.Column('documents_indexed', sa.Integer(), nullable=False),
    sa.Column('documents_failed', sa.Integer(), nullable=False),
    sa.Column('documents_removed', sa.Integer(), nullable=False),
    sa.Column('selection', sa.JSON(), nullable=True),
    sa.Column('removed', sa.JSON(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_schedule_runs_batch_id_batches'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], name=op.f('fk_schedule_runs_schedule_id_schedules'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedule_runs')),
    sa.UniqueConstraint('schedule_id', 'due_at', name=op.f('uq_schedule_runs_schedule_id_due_at'))
    )
    op.create_index(op.f('ix_schedule_runs_batch_id'), 'schedule_runs', ['batch_id'], unique=False)
    op.create_index('ix_schedule_runs_status_fired_at', 'schedule_runs', ['status', 'fired_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_schedule_runs_status_fired_at', table_name='schedule_runs')
    op.drop_index(op.f('ix_schedule_runs_batch_id'), table_name='schedule_runs')
    op.drop_table('schedule_runs')
    op.drop_table('indexed_documents')
    op.drop_index('ix_schedules_status_next_due_at', table_name='schedules')
    op.drop_table('schedules')
