"""api tokens: whether a token was issued while tokens were required

Tokens minted while auth was off (when anyone could mint an admin token) are never honoured. Rows from before
this revision cannot tell, so they start as not honoured: an admin issues them again (the bootstrap token is
marked again from the environment when the API starts).

Revision ID: 0006_token_issued_with_auth
Revises: 0006_stage_outputs_leases
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_token_issued_with_auth"
down_revision = "0006_stage_outputs_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("issued_with_auth", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("issued_with_auth")
