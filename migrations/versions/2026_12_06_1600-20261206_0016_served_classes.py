"""``served_classes`` and ``feedback_nll_bins``: what label shift and token-NLL quantiles
need from a window.

``served_classes`` counts the served rows per predicted class, per version and time
bucket (class -1 holds the rows of the classes a flush did not keep, above 1,000
classes); ``feedback_nll_bins`` counts the labelled feedback rows per bin of a fixed
log-spaced histogram of their NLL. Both are sums added by upserts, like
``feedback_bins``, so several processes and replicas add up; both start empty.

Revision ID: 20261206_0016
Revises: 20261206_0017
Create Date: 2026-12-06 01:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261206_0016"
down_revision: str | None = "20261206_0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: (table, its third key column)
_TABLES = (("served_classes", "class_index"), ("feedback_nll_bins", "bin_index"))


def upgrade() -> None:
    for table, key in _TABLES:
        op.create_table(
            table,
            sa.Column("version_id", sa.Integer(), nullable=False),
            sa.Column("bucket_start", sa.BigInteger(), nullable=False),
            sa.Column(key, sa.Integer(), nullable=False),
            sa.Column("count", sa.BigInteger(), nullable=False),
            sa.ForeignKeyConstraint(
                ["version_id"],
                ["calibrator_versions.id"],
                name=op.f(f"fk_{table}_version_id_calibrator_versions"),
                ondelete="CASCADE",
            ),
            sa.PrimaryKeyConstraint("version_id", "bucket_start", key, name=op.f(f"pk_{table}")),
        )
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_index(
                batch_op.f(f"ix_{table}_bucket_start"), ["bucket_start"], unique=False
            )


def downgrade() -> None:
    for table, _ in reversed(_TABLES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f"ix_{table}_bucket_start"))
        op.drop_table(table)
