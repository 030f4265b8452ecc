"""Persistence: the SQL tables, every query of the registry, the array files,
and schema migrations."""
