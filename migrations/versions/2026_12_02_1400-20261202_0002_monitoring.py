"""monitoring: feedback_bins, time-bucketed reliability sums of labelled feedback.

Written from autogenerate, then read: one row per (calibrator version, bucket
start in Unix seconds, confidence bin); writers add to the sums with
``INSERT ... ON CONFLICT DO UPDATE``, so the primary key is the conflict target.

Revision ID: 20261202_0002
Revises: 363b6878baec
Create Date: 2026-12-02 14:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261202_0002"
down_revision: str | None = "363b6878baec"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "feedback_bins",
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("bin_index", sa.Integer(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("correct_count", sa.BigInteger(), nullable=False),
        sa.Column("confidence_sum", sa.Float(), nullable=False),
        sa.Column("nll_sum", sa.Float(), nullable=False),
        sa.Column("entropy_sum", sa.Float(), nullable=False),
        sa.Column("brier_sum", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["calibrator_versions.id"],
            name=op.f("fk_feedback_bins_version_id_calibrator_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "version_id", "bucket_start", "bin_index", name=op.f("pk_feedback_bins")
        ),
    )
    with op.batch_alter_table("feedback_bins", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_feedback_bins_bucket_start"), ["bucket_start"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("feedback_bins", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_feedback_bins_bucket_start"))
    op.drop_table("feedback_bins")
