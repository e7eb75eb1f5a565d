"""registry: referrers, tags and their history, tracked models

Revision ID: 0003_registry
Revises: 0002_builds_workers
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_registry"
down_revision = "0002_builds_workers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("status_reason", sa.Text(), nullable=True))
    op.create_table(
        "referrers",
        sa.Column("digest", sa.String(71), primary_key=True),
        sa.Column("subject", sa.String(71), nullable=False),
        sa.Column("repository", sa.String(255), nullable=False),
        sa.Column("artifact_type", sa.String(255), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("annotations", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_referrers_subject", "referrers", ["subject"])
    op.create_table(
        "tags",
        sa.Column("repository", sa.String(255), primary_key=True),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "tag_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("repository", sa.String(255), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("old_digest", sa.String(71), nullable=True),
        sa.Column("new_digest", sa.String(71), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_tag_events_repository", "tag_events", ["repository"])
    op.create_table(
        "models",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("checkpoint", sa.Text(), nullable=False),
        sa.Column("hf_repo", sa.String(255), nullable=True),
        sa.Column("branch", sa.String(255), nullable=True),
        sa.Column("head_sha", sa.String(64), nullable=True),
        sa.Column("matrix", sa.JSON(), nullable=False),
        sa.Column("gates", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_models_hf_repo", "models", ["hf_repo"])


def downgrade() -> None:
    op.drop_table("models")
    op.drop_table("tag_events")
    op.drop_table("tags")
    op.drop_table("referrers")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("status_reason")
