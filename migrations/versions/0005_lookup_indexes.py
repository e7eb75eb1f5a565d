"""indexes for the hot reads: resolve's variant lookup, and an engine's producing build

Revision ID: 0005_lookup_indexes
Revises: 0004_api_tokens
"""

from alembic import op

revision = "0005_lookup_indexes"
down_revision = "0004_api_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_artifacts_variant", "artifacts", ["repository", "precision", "target", "profile", "backend"])
    op.create_index("ix_builds_digest", "builds", ["digest"])


def downgrade() -> None:
    op.drop_index("ix_builds_digest", table_name="builds")
    op.drop_index("ix_artifacts_variant", table_name="artifacts")
