"""replicas: where an engine was pushed in other registries (kiln push, KILN_REPLICATE_TO), for admission and resolve

Revision ID: 0012_replicas
Revises: 0011_build_progress
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_replicas"
down_revision = "0011_build_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("digest", sa.String(71), sa.ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True),
        sa.Column("host", sa.String(255), primary_key=True),
        sa.Column("repository", sa.String(255), primary_key=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("tag", sa.String(128), nullable=True),
        sa.Column("pushed_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_replicas_place", "replicas", ["host", "repository"])


def downgrade() -> None:
    op.drop_index("ix_replicas_place", table_name="replicas")
    op.drop_table("replicas")
