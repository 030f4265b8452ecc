"""``datasets.labels_sha256`` nullable: a dataset of scores without labels.

A label-free fit (an entropy target: temperature with ``target_entropy``,
``row-entropy``) needs scores only, so a dataset may name no labels file (NULL). Every
existing dataset names one and keeps it, and its content hash.

Revision ID: 20261206_0015
Revises: 20261206_0016
Create Date: 2026-12-06 00:15:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261206_0015"
down_revision: str | None = "20261206_0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column(
            "labels_sha256", existing_type=sa.String(length=64), nullable=True
        )


def downgrade() -> None:
    # A dataset without labels has no place in a schema that requires them: refuse
    # rather than delete a user's data (delete those datasets first, then downgrade).
    unlabelled = op.get_bind().scalar(
        sa.text("SELECT count(*) FROM datasets WHERE labels_sha256 IS NULL")
    )
    if unlabelled:
        raise RuntimeError(
            f"{unlabelled} dataset(s) have no labels, which revision 20261205_0013 cannot "
            "hold: delete them (and their versions) before downgrading."
        )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column(
            "labels_sha256", existing_type=sa.String(length=64), nullable=False
        )
