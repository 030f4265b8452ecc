"""``calibrator_versions.kind``: the kind of scores a version's params were fitted on.

Written by hand from what autogenerate proposed (a NOT NULL column needs the backfill
between its two steps), then checked with ``alembic check``. A version made by a fit
was fitted on its dataset's kind; a version from posted params was evaluated on its
dataset's kind, and the service serves such params (format 1, which did not record a
kind) as if fitted on it: so every existing row takes its dataset's kind. That keeps
every stored version serving what it served before for the kind it was fitted or
evaluated on (docs/design.md, "One answer per distribution"). On SQLite the last step
recreates the table (batch mode), to add NOT NULL and the CHECK.

Revision ID: 20261205_0011
Revises: 20261204_0010
Create Date: 2026-12-05 07:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261205_0011"
down_revision: str | None = "20261204_0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), nullable=True))
    op.execute(
        "UPDATE calibrator_versions SET kind = (SELECT datasets.kind FROM datasets "
        "WHERE datasets.id = calibrator_versions.dataset_id)"
    )
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.alter_column("kind", existing_type=sa.String(length=16), nullable=False)
        batch_op.create_check_constraint(
            op.f("ck_calibrator_versions_kind"), "kind IN ('logits', 'probabilities')"
        )


def downgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_calibrator_versions_kind"), type_="check")
        batch_op.drop_column("kind")
