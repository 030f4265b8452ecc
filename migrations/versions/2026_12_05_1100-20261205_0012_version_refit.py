"""``calibrator_versions.refit``: the chosen method fitted again on every row.

A fit request may ask for it (``refit``); every existing version was served as fitted
on its fit rows, so they all take false (the server default).

Revision ID: 20261205_0012
Revises: 20261205_0011
Create Date: 2026-12-05 11:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261205_0012"
down_revision: str | None = "20261205_0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("refit", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_column("refit")
