"""console sessions: a browser's login to the web console, made from an API key

Revision ID: 0006
Revises: 0005
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('console_sessions',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('api_key_id', sa.String(length=64), nullable=False),
    sa.Column('csrf_token', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_console_sessions_api_key_id_api_keys'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('token_hash', name=op.f('pk_console_sessions'))
    )
    op.create_index(op.f('ix_console_sessions_api_key_id'), 'console_sessions', ['api_key_id'], unique=False)
    op.create_index(op.f('ix_console_sessions_expires_at'), 'console_sessions', ['expires_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_console_sessions_expires_at'), table_name='console_sessions')
    op.drop_index(op.f('ix_console_sessions_api_key_id'), table_name='console_sessions')
    op.drop_table('console_sessions')
