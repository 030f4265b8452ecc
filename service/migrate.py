"""Alembic, driven from code: ``welltempered migrate``, the startup check, /readyz."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

ROOT = Path(__file__).resolve().parents[1]


class NotMigrated(RuntimeError):
    """The database is not at the latest revision and will not be migrated implicitly."""


def alembic_config(database_url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    # Passed as an attribute, not an ini option: URLs may contain '%' (interpolation).
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head", *, verbose: bool = False) -> None:
    cfg = alembic_config(database_url)
    cfg.attributes["configure_logging"] = verbose  # the service keeps its own logging
    command.upgrade(cfg, revision)


def head_revision(database_url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_schema(engine: Engine, database_url: str) -> None:
    """SQLite: upgrade to head. Other databases: refuse to run on an old schema."""
    if database_url.startswith("sqlite"):
        upgrade(database_url)
        return
    current, head = current_revision(engine), head_revision(database_url)
    if current != head:
        raise NotMigrated(
            f"The database {engine.url.render_as_string(hide_password=True)} is at revision "
            f"{current or 'none (empty)'}, not at the latest {head}: run `welltempered migrate` "
            "(with the same WELLTEMPERED_DATABASE_URL) first."
        )
