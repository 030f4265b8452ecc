"""api keys: the ``metrics`` scope (``GET /metrics``, the scraper's key).

The CHECK constraint ``ck_api_keys_scope`` names the scopes of
``service.vocabulary.SCOPES``; it gains ``metrics``. The lists are spelt out
here, as they were when this revision was written: a later change of the
vocabulary needs its own revision. Batch mode recreates ``api_keys`` on SQLite
(which cannot alter a constraint); PostgreSQL drops and adds the constraint.
Downgrading refuses (the CHECK fails) while a metrics key exists: revoke and
delete those rows first.

Revision ID: 20261203_0005
Revises: 20261203_0004
Create Date: 2026-12-03 06:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "20261203_0005"
down_revision: str | None = "20261203_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = "scope IN ('predict', 'write', 'admin')"
_AFTER = "scope IN ('predict', 'write', 'admin', 'metrics')"


def _check(condition: str) -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_api_keys_scope"), type_="check")
        batch_op.create_check_constraint(batch_op.f("ck_api_keys_scope"), condition)


def upgrade() -> None:
    _check(_AFTER)


def downgrade() -> None:
    _check(_BEFORE)
