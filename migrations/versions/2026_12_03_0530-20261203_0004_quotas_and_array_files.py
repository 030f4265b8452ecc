"""quotas and array lifecycle: ``namespaces``, ``array_files``, ``datasets.n_bytes``.

Written from autogenerate, then read. ``namespaces`` holds the row a quota check
locks; ``array_files`` the row that guards the removal of an array file; both
start empty (a namespace's row is created by its first quota check, a file's by the
next upload that refers to it or by the sweep). ``datasets.n_bytes`` is what a
dataset counts against its namespace's stored-bytes quota: new rows get the exact
size of their two .npy files; existing rows are estimated here from their shape
(a 128-byte header per file, the scores' itemsize, int64 labels), as the files are
not reachable from a migration. The two hash columns get indexes: "does any dataset
still refer to this file" is asked on every delete. No table is recreated on SQLite
(ADD COLUMN and CREATE INDEX only).

Revision ID: 20261203_0004
Revises: 20261202_0003
Create Date: 2026-12-03 05:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261203_0004"
down_revision: str | None = "20261202_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "array_files",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("n_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_array_files")),
    )
    op.create_table(
        "namespaces",
        sa.Column("namespace", sa.String(length=64), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("namespace", name=op.f("pk_namespaces")),
    )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("n_bytes", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.create_index(
            batch_op.f("ix_datasets_labels_sha256"), ["labels_sha256"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_datasets_scores_sha256"), ["scores_sha256"], unique=False
        )
    op.execute(
        "UPDATE datasets SET n_bytes = 256 + n_rows * 8 + n_rows * n_classes * "
        "(CASE dtype WHEN 'float16' THEN 2 WHEN 'float32' THEN 4 ELSE 8 END)"
    )


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_datasets_scores_sha256"))
        batch_op.drop_index(batch_op.f("ix_datasets_labels_sha256"))
        batch_op.drop_column("n_bytes")
    op.drop_table("namespaces")
    op.drop_table("array_files")
