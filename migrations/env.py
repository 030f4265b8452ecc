"""Alembic environment: the URL comes from the service, batch mode on SQLite."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from service.settings import Settings
from service.storage.db import Base, make_engine
from service.storage.migrate import include_name

config = context.config
# Only the `alembic` command reads alembic.ini; service.storage.migrate builds its Config in code
# and leaves logging to the caller (`welltempered migrate` sets it up).
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.attributes.get("database_url") or Settings().database_url


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    dialect = connection.dialect.name if connection is not None else url.split(":", 1)[0]
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: batch mode recreates the table.
        render_as_batch=dialect.startswith("sqlite"),
        compare_type=True,
        compare_server_default=True,
        include_name=include_name,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    _configure(url=database_url())
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    """Run the migrations; on SQLite with foreign keys off while they run.

    Batch mode recreates a table as CREATE new, copy, DROP old, rename. With
    ``PRAGMA foreign_keys=ON`` (every connection of :func:`make_engine`), SQLite runs
    the DROP as a DELETE of every row first, which cascades (``ON DELETE CASCADE``):
    recreating ``models`` would delete every dataset, version and alias. The pragma
    is a no-op inside a transaction, so it is set before the migration's transaction
    begins; the foreign keys are checked once the migrations are done.
    """
    sqlite_db = connection.dialect.name == "sqlite"
    if sqlite_db:
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    _configure(connection)
    try:
        with context.begin_transaction():
            context.run_migrations()
            if sqlite_db:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"the migration broke foreign keys: {broken[:10]}")
    finally:
        if sqlite_db:
            if connection.in_transaction():
                connection.commit()
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            connection.commit()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
