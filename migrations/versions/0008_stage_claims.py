"""stage claims: one producer per stage output across workers

Revision ID: 0008_stage_claims
Revises: 0007_token_expiry
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_stage_claims"
down_revision = "0007_token_expiry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stage_claims",
        sa.Column("key", sa.String(71), primary_key=True),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stage_claims")
