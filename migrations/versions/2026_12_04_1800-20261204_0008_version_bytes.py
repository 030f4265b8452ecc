"""``calibrator_versions.n_bytes``: a version's params count against its namespace's
stored-bytes quota.

Written from autogenerate, then read. New versions get the size of their params as
stored (posted params at creation, a fit's at its outcome); existing rows get the
size of their stored JSON text here (``octet_length`` on PostgreSQL, the length of the
text as a blob on SQLite: UTF-8 bytes on both), 0 for a version without params. No
table is recreated on SQLite (ADD COLUMN only).

Revision ID: 20261204_0008
Revises: 20261203_0100
Create Date: 2026-12-04 18:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261204_0008"
down_revision: str | None = "20261203_0100"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("n_bytes", sa.BigInteger(), server_default="0", nullable=False)
        )
    if op.get_bind().dialect.name == "postgresql":
        size = "octet_length(CAST(params AS TEXT))"
    else:
        size = "length(CAST(params AS BLOB))"
    op.execute(
        f"UPDATE calibrator_versions SET n_bytes = {size} "
        "WHERE params IS NOT NULL AND CAST(params AS TEXT) <> 'null'"
    )


def downgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_column("n_bytes")
