"""api tokens (hashed) with scopes

Revision ID: 0004_api_tokens
Revises: 0003_registry
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_api_tokens"
down_revision = "0003_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_api_tokens_token_sha256", "api_tokens", ["token_sha256"], unique=True)


def downgrade() -> None:
    op.drop_table("api_tokens")
