"""artifacts: the index of published engine images

Revision ID: 0001_artifacts
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001_artifacts"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("digest", sa.String(71), primary_key=True),
        sa.Column("build_key", sa.String(71), nullable=False),
        sa.Column("repository", sa.String(255), nullable=False),
        sa.Column("tag", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("precision", sa.String(16), nullable=False),
        sa.Column("target", sa.String(16), nullable=False),
        sa.Column("profile", sa.String(64), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("checkpoint_ref", sa.Text(), nullable=False),
        sa.Column("checkpoint_digest", sa.String(71), nullable=False),
        sa.Column("checkpoint_revision", sa.String(64), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("provenance", sa.JSON(), nullable=False),
        sa.Column("validation", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_artifacts_build_key", "artifacts", ["build_key"], unique=True)
    op.create_index("ix_artifacts_repository", "artifacts", ["repository"])
    op.create_index("ix_artifacts_status", "artifacts", ["status"])
    op.create_index("ix_artifacts_checkpoint_digest", "artifacts", ["checkpoint_digest"])


def downgrade() -> None:
    op.drop_table("artifacts")
