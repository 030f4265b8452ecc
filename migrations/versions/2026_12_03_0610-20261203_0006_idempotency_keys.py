"""idempotency keys: ``idempotency_keys`` (a feedback post's key and its answer).

Written from autogenerate, then read. A new table only, empty at first; its rows
expire (``WELLTEMPERED_IDEMPOTENCY_KEY_SECONDS``), hence the index on
``created_at``. Deleting a model deletes its keys.

Revision ID: 20261203_0006
Revises: 20261203_0005
Create Date: 2026-12-03 06:10:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261203_0006"
down_revision: str | None = "20261203_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("namespace", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_idempotency_keys_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("namespace", "key", name=op.f("pk_idempotency_keys")),
    )
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_idempotency_keys_created_at"), ["created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_idempotency_keys_created_at"))
    op.drop_table("idempotency_keys")
