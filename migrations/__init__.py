"""The Alembic environment of the registry, installed as ``service.migrations``."""
