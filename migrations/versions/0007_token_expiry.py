"""api tokens: an optional expiry

Revision ID: 0007_token_expiry
Revises: 0006_token_issued_with_auth
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_token_expiry"
down_revision = "0006_token_issued_with_auth"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_at")
