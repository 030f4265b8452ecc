"""idempotency fingerprints: an ``idempotency_keys`` row says what request it was made
for, whether it is still in flight, and its whole answer.

- New columns: ``route`` (method and route template), ``fingerprint`` (sha256 of the
  request: route, path and query parameters, body digest), ``state`` (``in_flight`` or
  ``done``, with a CHECK), ``attempt`` (the token of the request holding an in-flight
  key), ``status_code`` and ``headers`` of the answer; ``response`` becomes nullable
  (no answer while in flight).
- Existing rows are feedback posts, done, answered 200: they get that route, state and
  status, and no fingerprint (``NULL``: judged by route and model, as they were).

Downgrade deletes the rows the old schema cannot tell apart from a feedback answer (any
other route, and in-flight keys) and drops the columns.

Revision ID: 20261204_0010
Revises: 20261204_0009
Create Date: 2026-12-04 18:20:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261204_0010"
down_revision: str | None = "20261204_0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The route of every key written before this revision (the lists as they were).
_FEEDBACK = "POST /v1/models/{model}/feedback"
_STATES = "state IN ('in_flight', 'done')"

_keys = sa.table(
    "idempotency_keys",
    sa.column("route", sa.String),
    sa.column("state", sa.String),
    sa.column("status_code", sa.Integer),
)


def upgrade() -> None:
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("route", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("fingerprint", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("state", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("attempt", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("status_code", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("headers", sa.JSON(), nullable=True))
        batch_op.alter_column("response", existing_type=sa.JSON(), nullable=True)
    op.execute(_keys.update().values(route=_FEEDBACK, state="done", status_code=200))
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.alter_column("route", existing_type=sa.String(length=255), nullable=False)
        batch_op.alter_column("state", existing_type=sa.String(length=16), nullable=False)
        batch_op.create_check_constraint(batch_op.f("ck_idempotency_keys_state"), _STATES)


def downgrade() -> None:
    op.execute(
        _keys.delete().where(
            sa.or_(
                _keys.c.route != _FEEDBACK,
                _keys.c.state != "done",
                _keys.c.status_code != 200,
            )
        )
    )
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_idempotency_keys_state"), type_="check")
        batch_op.alter_column("response", existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column("headers")
        batch_op.drop_column("status_code")
        batch_op.drop_column("attempt")
        batch_op.drop_column("state")
        batch_op.drop_column("fingerprint")
        batch_op.drop_column("route")
