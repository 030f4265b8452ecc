"""Persistence: every SQL query of the service lives in this package.

:mod:`~service.storage.db` (the tables and the engine), :mod:`~service.storage.registry`
(models, datasets, calibrator versions, aliases), :mod:`~service.storage.keys` (API
keys), :mod:`~service.storage.fits` (fit jobs), :mod:`~service.storage.quality`
(feedback sums and the registry figures of /metrics), :mod:`~service.storage.arrays`
(content-addressed array files) and :mod:`~service.storage.migrate` (Alembic).
Lookups raise :mod:`service.errors`; nothing here knows about HTTP.
"""
