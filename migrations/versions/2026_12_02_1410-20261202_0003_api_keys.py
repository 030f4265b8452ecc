"""api keys and namespaces: ``api_keys``; ``models.namespace``, names unique per namespace.

Written from autogenerate, then read. Existing models move to the namespace
``default`` (the server default of the new column); the global unique name
becomes unique per (namespace, name). Batch mode on SQLite recreates ``models``
(constraint names come from the naming convention, so they can be dropped).

Revision ID: 20261202_0003
Revises: 20261202_0002
Create Date: 2026-12-02 14:10:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261202_0003"
down_revision: str | None = "20261202_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_sha256", sa.String(length=64), nullable=False),
        sa.Column("namespace", sa.String(length=64), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("description", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "scope IN ('predict', 'write', 'admin')", name=op.f("ck_api_keys_scope")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_sha256", name=op.f("uq_api_keys_key_sha256")),
    )
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("namespace", sa.String(length=64), server_default="default", nullable=False)
        )
        batch_op.drop_constraint(batch_op.f("uq_models_name"), type_="unique")
        batch_op.create_unique_constraint(
            batch_op.f("uq_models_namespace_name"), ["namespace", "name"]
        )


def downgrade() -> None:
    # Refuses (unique violation) if two namespaces hold models of the same name.
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_models_namespace_name"), type_="unique")
        batch_op.create_unique_constraint(batch_op.f("uq_models_name"), ["name"])
        batch_op.drop_column("namespace")
    op.drop_table("api_keys")
