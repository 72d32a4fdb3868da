"""a finalize lease on batches (a live finalize is not re-sent) and a count of ingest attempts
(an ingest that keeps failing fails the batch instead of looping)

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches') as batch_op:
        batch_op.add_column(sa.Column('finalize_lease_expires_at', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('ingest_attempts', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('ingest_attempts')
        batch_op.drop_column('finalize_lease_expires_at')
