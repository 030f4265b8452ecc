"""Revisions, one file each, dated (see ``file_template`` in alembic.ini)."""
