"""Alembic, driven from code: ``welltempered migrate``, the startup check, /readyz.

The migration scripts (``migrations/`` in the repository) are installed as the
package ``service.migrations`` (pyproject.toml maps the directory), found through
:mod:`importlib.resources`: any install works (a wheel, ``pip install .``, editable),
from any working directory, with no ``alembic.ini``. That file, at the repository
root, is only for developers' ``alembic`` command (``revision --autogenerate``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from service.storage import retry


class NotMigrated(RuntimeError):
    """The database is not at the latest revision and will not be migrated implicitly."""


#: Tables of the job engine (PostgreSQL): created by our migrations from the pinned
#: Procrastinate release's SQL, described by no model of ours.
JOB_ENGINE_PREFIX = "procrastinate_"


def include_name(name: str | None, type_: str, parent_names: dict) -> bool:
    """Autogenerate's filter (``alembic check``): the job engine's tables are not ours
    to compare."""
    return not (type_ == "table" and name is not None and name.startswith(JOB_ENGINE_PREFIX))


def script_location() -> Path:
    """The installed migration environment: ``env.py``, ``script.py.mako``, ``versions/``."""
    location = resources.files("service.migrations")
    if not isinstance(location, Path):  # e.g. imported from a zip: Alembic needs files
        raise RuntimeError(
            f"Alembic needs the migration scripts as files on disk. Got {location!r}."
        )
    return location


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    # Ini options are %-interpolated: a '%' in the path must be doubled.
    cfg.set_main_option("script_location", str(script_location()).replace("%", "%%"))
    # Passed as an attribute, not an ini option: URLs may contain '%' (interpolation).
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def head_revision(database_url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_schema(engine: Engine, database_url: str, wait_seconds: float = 0.0) -> None:
    """SQLite: upgrade to head. Other databases: refuse to run on an old schema.

    ``wait_seconds``: how long to keep trying after a transient database failure
    (:func:`service.storage.retry.until_reachable`; a process starting, whose failed
    start-up would stop every uvicorn worker with it); 0: raise the first."""
    retry.until_reachable(
        _ensure_schema, engine, database_url, wait_seconds=wait_seconds,
        what="the schema check",
    )


def _ensure_schema(engine: Engine, database_url: str) -> None:
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
