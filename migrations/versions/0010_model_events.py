"""model events: every registration of a tracked model, with the reason when it loosens the matrix

Revision ID: 0010_model_events
Revises: 0009_engine_names
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_model_events"
down_revision = "0009_engine_names"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("checkpoint", sa.Text(), nullable=False),
        sa.Column("matrix", sa.JSON(), nullable=False),
        sa.Column("gates", sa.JSON(), nullable=False),
        sa.Column("override_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_model_events_model", "model_events", ["model"])


def downgrade() -> None:
    op.drop_index("ix_model_events_model", table_name="model_events")
    op.drop_table("model_events")
