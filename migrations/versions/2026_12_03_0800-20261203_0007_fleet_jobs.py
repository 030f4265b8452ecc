"""fit jobs for a fleet: attempts, worker and job id on a version; status ``cancelled``;
on PostgreSQL the job engine's tables (Procrastinate).

- ``calibrator_versions`` gains ``attempts`` (0 for existing rows), ``worker`` and
  ``job_id``; the CHECK ``ck_calibrator_versions_status`` gains ``cancelled`` (the
  lists are spelt out as they were when this revision was written).
- PostgreSQL only: the schema of the pinned Procrastinate release (pyproject.toml),
  created in the first schema of the search_path, like our own tables. A later
  Procrastinate release ships SQL deltas (``procrastinate/sql/migrations``): each one
  is applied by its own revision here, never by ``procrastinate schema --apply``.
  Fits queued before this revision (none are: the old server marked them failed at
  stop) would have no job; SQLite keeps running fits in the serve process.

Downgrade refuses (the CHECK fails) while a cancelled version exists, and drops the
job engine's tables with every job in them.

Revision ID: 20261203_0007
Revises: 20261203_0006
Create Date: 2026-12-03 08:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261203_0007"
down_revision: str | None = "20261203_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = "status IN ('queued', 'running', 'succeeded', 'rejected', 'failed')"
_AFTER = "status IN ('queued', 'running', 'succeeded', 'rejected', 'failed', 'cancelled')"


def _check(condition: str) -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_calibrator_versions_status"), type_="check")
        batch_op.create_check_constraint(batch_op.f("ck_calibrator_versions_status"), condition)


def _driver_connection():
    # The schema is one script with dollar-quoted functions and literal '%' signs: it
    # goes to psycopg as is, with no parameters (no placeholder parsing), in the
    # migration's transaction.
    return op.get_bind().connection.driver_connection


def upgrade() -> None:
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempts", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("worker", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("job_id", sa.BigInteger(), nullable=True))
    _check(_AFTER)
    if op.get_bind().dialect.name == "postgresql":
        from procrastinate.schema import SchemaManager

        _driver_connection().execute(SchemaManager.get_schema())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        conn = _driver_connection()
        conn.execute(
            "DROP TABLE IF EXISTS procrastinate_events, procrastinate_periodic_defers, "
            "procrastinate_jobs, procrastinate_workers CASCADE"
        )
        functions = conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n "
            "ON n.oid = p.pronamespace WHERE n.nspname = current_schema() "
            "AND p.proname LIKE 'procrastinate%'"
        ).fetchall()
        for (signature,) in functions:
            conn.execute(f"DROP FUNCTION IF EXISTS {signature} CASCADE")
        conn.execute(
            "DROP TYPE IF EXISTS procrastinate_job_to_defer_v1, procrastinate_job_status, "
            "procrastinate_job_event_type CASCADE"
        )
    _check(_BEFORE)
    with op.batch_alter_table("calibrator_versions", schema=None) as batch_op:
        batch_op.drop_column("job_id")
        batch_op.drop_column("worker")
        batch_op.drop_column("attempts")
