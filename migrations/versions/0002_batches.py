"""Batches (offline backfills): the batches table; jobs and webhook deliveries may belong to a batch.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 20:15:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('batches',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('api_key_id', sa.String(length=40), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('model', sa.String(length=100), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('webhook_url', sa.Text(), nullable=True),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('last_claimed_at', sa.DateTime(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('in_progress_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index('ix_batches_tenant_list', ['api_key_id', 'id'], unique=False)
        batch_op.create_index('ix_batches_status', ['status', 'last_claimed_at'], unique=False)

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('batch_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('custom_id', sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column('query_key', sa.String(length=32), nullable=True))
        batch_op.create_foreign_key('fk_jobs_batch_id', 'batches', ['batch_id'], ['id'], ondelete='CASCADE')
        batch_op.create_index('ix_jobs_batch_claim', ['batch_id', 'status', 'query_key', 'id'], unique=False)
        batch_op.create_index('ix_jobs_batch_results', ['batch_id', 'id'], unique=False)

    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.add_column(sa.Column('batch_id', sa.String(length=40), nullable=True))
        batch_op.create_foreign_key('fk_webhook_deliveries_batch_id', 'batches', ['batch_id'], ['id'],
                                    ondelete='CASCADE')
        batch_op.create_index(batch_op.f('ix_webhook_deliveries_batch_id'), ['batch_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhook_deliveries_batch_id'))
        batch_op.drop_constraint('fk_webhook_deliveries_batch_id', type_='foreignkey')
        batch_op.drop_column('batch_id')

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_batch_results')
        batch_op.drop_index('ix_jobs_batch_claim')
        batch_op.drop_constraint('fk_jobs_batch_id', type_='foreignkey')
        batch_op.drop_column('query_key')
        batch_op.drop_column('custom_id')
        batch_op.drop_column('batch_id')

    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_status')
        batch_op.drop_index('ix_batches_tenant_list')

    op.drop_table('batches')
