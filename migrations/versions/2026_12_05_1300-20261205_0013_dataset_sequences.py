"""``datasets.sequences_sha256`` and ``datasets.n_sequences``: the sequence id of each row.

A dataset whose rows are the tokens of texts names a third array file, the sequence
(text) of each row; its hold-out splits are then by sequence. Every existing dataset
has none (NULL): its rows stay independent, and its content hash is unchanged.

Revision ID: 20261205_0013
Revises: 20261205_0012
Create Date: 2026-12-05 13:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261205_0013"
down_revision: str | None = "20261205_0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sequences_sha256", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("n_sequences", sa.Integer(), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_datasets_sequences_sha256"), ["sequences_sha256"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_datasets_sequences_sha256"))
        batch_op.drop_column("n_sequences")
        batch_op.drop_column("sequences_sha256")
