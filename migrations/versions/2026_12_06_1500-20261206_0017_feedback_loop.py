"""The recalibration loop: ``feedback_loops``, ``feedback_batches``, ``loop_runs`` and
``loop_events``.

A model opts in with a ``feedback_loops`` row; no existing model has one, so nothing
is kept and no run starts until its owner asks.

Revision ID: 20261206_0017
Revises: 20261206_0018
Create Date: 2026-12-06 00:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261206_0017"
down_revision: str | None = "20261206_0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = "kind IN ('logits', 'probabilities')"
TRIGGERS = "trigger IN ('request', 'drift')"
STATES = "state IN ('fitting', 'promoted', 'waiting', 'not-promoted', 'failed')"
STEPS = (
    "step IN ('started', 'candidate-fitted', 'evaluated', 'promoted', 'not-promoted', "
    "'failed')"
)


def upgrade() -> None:
    op.create_table(
        "feedback_loops",
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("keep_feedback", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.Column("retention_rows", sa.BigInteger(), server_default="50000", nullable=False),
        sa.Column("retention_days", sa.Integer(), server_default="30", nullable=False),
        sa.Column("holdout", sa.Float(), server_default="0.3", nullable=False),
        sa.Column("margin", sa.Float(), server_default="0.01", nullable=False),
        sa.Column("auto_promote", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("on_drift", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("retention_rows >= 1", name=op.f("ck_feedback_loops_retention_rows")),
        sa.CheckConstraint("retention_days >= 1", name=op.f("ck_feedback_loops_retention_days")),
        sa.CheckConstraint("holdout > 0 AND holdout < 1", name=op.f("ck_feedback_loops_holdout")),
        sa.CheckConstraint("margin >= 0", name=op.f("ck_feedback_loops_margin")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_feedback_loops_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_id", name=op.f("pk_feedback_loops")),
    )
    op.create_table(
        "feedback_batches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("n_rows", sa.Integer(), nullable=False),
        sa.Column("scores", sa.LargeBinary(), nullable=False),
        sa.Column("labels", sa.LargeBinary(), nullable=False),
        sa.Column("n_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(KINDS, name=op.f("ck_feedback_batches_kind")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_feedback_batches_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback_batches")),
    )
    with op.batch_alter_table("feedback_batches", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_feedback_batches_created_at"), ["created_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_feedback_batches_model_id"), ["model_id"], unique=False
        )
    op.create_table(
        "loop_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("production_id", sa.Integer(), nullable=True),
        sa.Column("production_version", sa.Integer(), nullable=False),
        sa.Column("candidate_id", sa.Integer(), nullable=True),
        sa.Column("candidate_version", sa.Integer(), nullable=False),
        sa.Column("margin", sa.Float(), nullable=False),
        sa.Column("auto_promote", sa.Boolean(), nullable=False),
        sa.Column("comparison", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(TRIGGERS, name=op.f("ck_loop_runs_trigger")),
        sa.CheckConstraint(STATES, name=op.f("ck_loop_runs_state")),
        sa.ForeignKeyConstraint(
            ["candidate_id"], ["calibrator_versions.id"],
            name=op.f("fk_loop_runs_candidate_id_calibrator_versions"), ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_loop_runs_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["production_id"], ["calibrator_versions.id"],
            name=op.f("fk_loop_runs_production_id_calibrator_versions"), ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_loop_runs")),
    )
    with op.batch_alter_table("loop_runs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_loop_runs_candidate_id"), ["candidate_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_loop_runs_model_id"), ["model_id"], unique=False)
    op.create_table(
        "loop_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(STEPS, name=op.f("ck_loop_events_step")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_loop_events_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["loop_runs.id"], name=op.f("fk_loop_events_run_id_loop_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_loop_events")),
    )
    with op.batch_alter_table("loop_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_loop_events_model_id"), ["model_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_loop_events_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_table("loop_events")
    op.drop_table("loop_runs")
    op.drop_table("feedback_batches")
    op.drop_table("feedback_loops")
