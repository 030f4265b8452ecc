"""``datasets.metrics`` may be NULL: a big dataset's metrics are computed after its
upload's answer (service/jobs/dataset_metrics.py), and are NULL until then.

Revision ID: 20261206_0018
Revises: 20261205_0013
Create Date: 2026-12-06 14:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261206_0018"
down_revision: str | None = "20261205_0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column("metrics", existing_type=sa.JSON(), nullable=True)


def downgrade() -> None:
    # Metrics not computed yet become an empty report: the column is NOT NULL again.
    op.execute("UPDATE datasets SET metrics = '{}' WHERE metrics IS NULL")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column("metrics", existing_type=sa.JSON(), nullable=False)
