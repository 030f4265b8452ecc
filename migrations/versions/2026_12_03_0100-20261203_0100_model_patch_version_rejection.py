"""lifecycle: models.description, updated_at; calibrator_versions.rejection, source.

``models.description`` and ``models.updated_at`` (PATCH of a model),
``calibrator_versions.rejection`` (why the argmax policy rejected a version) and
``calibrator_versions.source`` (``fit``, or ``params`` for posted parameters).

Written from autogenerate, then read. Four nullable (or defaulted) columns added:
no table is recreated, existing rows keep their values (``source`` 'fit', the rest
NULL: rejections before this revision carry their argmax report only).

Revision ID: 20261203_0100
Revises: 20261203_0007
Create Date: 2026-12-03 01:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261203_0100"
down_revision: str | None = "20261203_0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.add_column(sa.Column("description", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rejection", sa.JSON(), nullable=True))
        batch_op.add_column(
            sa.Column("source", sa.String(length=16), server_default="fit", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_column("source")
        batch_op.drop_column("rejection")
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_column("updated_at")
        batch_op.drop_column("description")
