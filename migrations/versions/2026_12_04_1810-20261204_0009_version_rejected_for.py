"""``calibrator_versions.rejected_for``: the machine-readable reasons of a rejection.

Written from autogenerate, then read. A version is now also rejected when its held-out
NLL is worse than the uncalibrated scores' (service.jobs.evaluation); the codes of
service.vocabulary.REJECTION_REASONS say which reason applies. Existing rows keep
NULL: a version rejected before this revision was rejected by the argmax policy (the
only reason then), which readers assume for a rejected version without codes. No
table is recreated on SQLite (ADD COLUMN only).

Revision ID: 20261204_0009
Revises: 20261204_0008
Create Date: 2026-12-04 18:10:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261204_0009"
down_revision: str | None = "20261204_0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rejected_for", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_column("rejected_for")
