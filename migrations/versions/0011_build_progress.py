"""build progress: what a running build's stage is doing now (kiln/progress.py), for GET /v1/builds and the dashboard

Revision ID: 0011_build_progress
Revises: 0010_model_events
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_build_progress"
down_revision = "0010_model_events"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("builds", sa.Column("progress", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("builds") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("progress")
