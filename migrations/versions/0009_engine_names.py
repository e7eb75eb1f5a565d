"""engine names: one engine named in several repositories

Revision ID: 0009_engine_names
Revises: 0008_stage_claims
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_engine_names"
down_revision = "0008_stage_claims"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engine_names",
        sa.Column("repository", sa.String(255), primary_key=True),
        sa.Column("digest", sa.String(71), sa.ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_engine_names_digest", "engine_names", ["digest"])


def downgrade() -> None:
    op.drop_index("ix_engine_names_digest", table_name="engine_names")
    op.drop_table("engine_names")
