"""initial schema: projects, api_keys, files, batches, shards, requests

Revision ID: 0001
Revises: 
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('projects',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_projects')),
    sa.UniqueConstraint('name', name=op.f('uq_projects_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('key_hash', sa.String(length=128), nullable=False),
    sa.Column('key_prefix', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('last_used_at', sa.Float(), nullable=True),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_api_keys_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_project_id'), ['project_id'], unique=False)

    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('object_key', sa.String(length=1024), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('status_details', sa.Text(), nullable=True),
    sa.Column('line_count', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.Column('deleted_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_files_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_files'))
    )
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_files_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_files_project_id'), ['project_id'], unique=False)

    op.create_table('batches',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('input_file_id', sa.String(length=64), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('output_file_id', sa.String(length=64), nullable=True),
    sa.Column('error_file_id', sa.String(length=64), nullable=True),
    sa.Column('output_expires_after_seconds', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('in_progress_at', sa.Float(), nullable=True),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.Column('finalizing_at', sa.Float(), nullable=True),
    sa.Column('completed_at', sa.Float(), nullable=True),
    sa.Column('failed_at', sa.Float(), nullable=True),
    sa.Column('expired_at', sa.Float(), nullable=True),
    sa.Column('cancelling_at', sa.Float(), nullable=True),
    sa.Column('cancelled_at', sa.Float(), nullable=True),
    sa.Column('request_total', sa.Integer(), server_default='0', nullable=False),
    sa.Column('planned_prompt_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('planned_max_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('last_enqueued_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['input_file_id'], ['files.id'], name=op.f('fk_batches_input_file_id_files')),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_batches_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batches'))
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index('ix_batches_project_id_created_at', ['project_id', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_batches_status'), ['status'], unique=False)

    op.create_table('shards',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('num_requests', sa.Integer(), server_default='0', nullable=False),
    sa.Column('planned_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('lease_owner', sa.String(length=256), nullable=True),
    sa.Column('lease_token', sa.String(length=64), nullable=True),
    sa.Column('lease_expires_at', sa.Float(), nullable=True),
    sa.Column('heartbeat_at', sa.Float(), nullable=True),
    sa.Column('attempt', sa.Integer(), server_default='0', nullable=False),
    sa.Column('enqueued_at', sa.Float(), nullable=True),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('worker', sa.String(length=256), nullable=True),
    sa.Column('device', sa.String(length=64), nullable=True),
    sa.Column('completed_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('failed_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('prefix_hit_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('engine_seconds', sa.Float(), server_default='0', nullable=False),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_shards_batch_id_batches'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_shards')),
    sa.UniqueConstraint('batch_id', 'seq', name=op.f('uq_shards_batch_id_seq'))
    )
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.create_index('ix_shards_status_lease_expires_at', ['status', 'lease_expires_at'], unique=False)

    op.create_table('requests',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('shard_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.String(length=512), nullable=False),
    sa.Column('body', sa.JSON(), nullable=False),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=False),
    sa.Column('max_tokens', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('response_status_code', sa.Integer(), nullable=True),
    sa.Column('response_body', sa.JSON(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), server_default='0', nullable=False),
    sa.Column('cached_tokens', sa.Integer(), server_default='0', nullable=False),
    sa.Column('completion_tokens', sa.Integer(), server_default='0', nullable=False),
    sa.Column('engine_seconds', sa.Float(), server_default='0', nullable=False),
    sa.Column('worker', sa.String(length=256), nullable=True),
    sa.Column('device', sa.String(length=64), nullable=True),
    sa.Column('attempt', sa.Integer(), nullable=True),
    sa.Column('queued_at', sa.Float(), nullable=True),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('first_token_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_requests_batch_id_batches'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], name=op.f('fk_requests_shard_id_shards'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_requests')),
    sa.UniqueConstraint('batch_id', 'custom_id', name=op.f('uq_requests_batch_id_custom_id'))
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index('ix_requests_batch_id_line', ['batch_id', 'line'], unique=False)
        batch_op.create_index('ix_requests_shard_id_status', ['shard_id', 'status'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index('ix_requests_shard_id_status')
        batch_op.drop_index('ix_requests_batch_id_line')

    op.drop_table('requests')
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_index('ix_shards_status_lease_expires_at')

    op.drop_table('shards')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batches_status'))
        batch_op.drop_index('ix_batches_project_id_created_at')

    op.drop_table('batches')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_files_project_id'))
        batch_op.drop_index(batch_op.f('ix_files_created_at'))

    op.drop_table('files')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_project_id'))

    op.drop_table('api_keys')
    op.drop_table('projects')
