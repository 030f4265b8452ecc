"""``datasets.top_k`` and ``datasets.topk_ids_sha256``: datasets of top-k log-probabilities.

A hosted language model gives the k largest log-probabilities of each token, never the
whole vocabulary (``calibrators.topk``). Such a dataset keeps its log-probabilities
(N, k) in ``scores_sha256`` and their token ids (N, k) in a second file,
``topk_ids_sha256``; ``top_k`` is k and ``n_classes`` the vocabulary size. Existing
datasets hold full scores: both columns NULL.

Revision ID: 20261207_0019
Revises: 20261206_0015
Create Date: 2026-12-07 10:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261207_0019"
down_revision: str | None = "20261206_0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("top_k", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("topk_ids_sha256", sa.String(length=64), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_datasets_topk_ids_sha256"), ["topk_ids_sha256"], unique=False
        )


def downgrade() -> None:
    # A top-k dataset has no place in a schema without these columns: refuse rather than
    # turn its rows into something they are not (delete those datasets first).
    topk = op.get_bind().scalar(sa.text("SELECT count(*) FROM datasets WHERE top_k IS NOT NULL"))
    if topk:
        raise RuntimeError(
            f"{topk} dataset(s) hold top-k log-probabilities, which revision 20261206_0015 "
            "cannot hold: delete them (and their versions) before downgrading."
        )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_datasets_topk_ids_sha256"))
        batch_op.drop_column("topk_ids_sha256")
        batch_op.drop_column("top_k")
