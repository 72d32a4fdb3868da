"""engine hosts (the engine workers alive, the models each serves and whether it could load
them) and, on shards, the model-load failure a shard waits on

Revision ID: 0005
Revises: 0004
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('engine_hosts',
    sa.Column('worker', sa.String(length=256), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('model', sa.String(length=1024), nullable=False),
    sa.Column('names', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('failures', sa.Integer(), server_default='0', nullable=False),
    sa.Column('retry_at', sa.Float(), nullable=True),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('heartbeat_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('worker', 'kind', name=op.f('pk_engine_hosts'))
    )
    op.create_index('ix_engine_hosts_kind_heartbeat_at', 'engine_hosts', ['kind', 'heartbeat_at'], unique=False)
    with op.batch_alter_table('shards') as batch_op:
        batch_op.add_column(sa.Column('load_error', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('unavailable_since', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('shards') as batch_op:
        batch_op.drop_column('unavailable_since')
        batch_op.drop_column('load_error')
    op.drop_index('ix_engine_hosts_kind_heartbeat_at', table_name='engine_hosts')
    op.drop_table('engine_hosts')
