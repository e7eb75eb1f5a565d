"""stage outputs in the blob store (key → tar digest) and blob leases (GC safe while builds publish)

Revision ID: 0006_stage_outputs_leases
Revises: 0005_lookup_indexes
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_stage_outputs_leases"
down_revision = "0005_lookup_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stage_outputs",
        sa.Column("key", sa.String(71), primary_key=True),
        sa.Column("stage", sa.String(16), nullable=False),
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_stage_outputs_digest", "stage_outputs", ["digest"])
    op.create_index("ix_stage_outputs_last_used_at", "stage_outputs", ["last_used_at"])
    op.create_table(
        "blob_leases",
        sa.Column("digest", sa.String(71), primary_key=True),
        sa.Column("holder", sa.String(64), primary_key=True),
        sa.Column("purpose", sa.String(8), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_blob_leases_expires_at", "blob_leases", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_blob_leases_expires_at", table_name="blob_leases")
    op.drop_table("blob_leases")
    op.drop_index("ix_stage_outputs_last_used_at", table_name="stage_outputs")
    op.drop_index("ix_stage_outputs_digest", table_name="stage_outputs")
    op.drop_table("stage_outputs")
