"""builds, build events and workers; artifacts.request_key

Revision ID: 0002_builds_workers
Revises: 0001_artifacts
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_builds_workers"
down_revision = "0001_artifacts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("request_key", sa.String(71), nullable=True))
        batch.create_index("ix_artifacts_request_key", ["request_key"])
    op.create_table(
        "builds",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("request_key", sa.String(71), nullable=False),
        sa.Column("active_key", sa.String(71), nullable=True),
        sa.Column("build_key", sa.String(71), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("queue", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("stage", sa.String(16), nullable=True),
        sa.Column("stages", sa.JSON(), nullable=False),
        sa.Column("digest", sa.String(71), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("active_key", name="uq_builds_active_key"),
    )
    op.create_index("ix_builds_request_key", "builds", ["request_key"])
    op.create_index("ix_builds_status", "builds", ["status"])
    op.create_index("ix_builds_created_at", "builds", ["created_at"])
    op.create_table(
        "build_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("build_id", sa.String(32), sa.ForeignKey("builds.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_build_events_build_id", "build_events", ["build_id"])
    op.create_table(
        "workers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("capabilities", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workers_last_heartbeat", "workers", ["last_heartbeat"])


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("build_events")
    op.drop_table("builds")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_index("ix_artifacts_request_key")
        batch.drop_column("request_key")
