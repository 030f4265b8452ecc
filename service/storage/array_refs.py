"""When an array file may be removed: the last dataset that names it is gone, and no
upload is about to name it again.

Array files are content-addressed and shared: datasets of any model, in any
namespace, with the same scores, labels or sequence ids name the same file. A file is written
before the row that names it commits (:mod:`service.storage.arrays`), so "no row
refers to it" alone does not make it garbage: an upload of the same content may have
just (re)written it and be about to commit. One row per file in ``array_files`` is
the lock that orders the two:

- an upload writes its files (always a fresh write, even for a name that exists),
  then in the transaction that inserts its dataset locks each file's row
  (:func:`hold`, an upsert, in hash order) and writes again any file that is missing
  by then, before it commits;
- a release (:func:`release` after a delete commits, and :func:`sweep` for orphans)
  locks the file's row in its own transaction, counts the datasets that name the
  file, and unlinks it only if there are none, while it holds the lock.

So a release that removed a file either committed before the upload locked the row
(the upload finds the file missing and writes it again) or waits for the upload to
commit (and then counts its row). PostgreSQL: the upsert holds the row lock to the
end of the transaction, and the count after it sees the other's commit (READ
COMMITTED). SQLite: the upsert takes the database's write lock. A release that
fails after its unlink leaves at most a row without a file, which the next sweep
deletes.

Orphans are files no dataset names: an upload killed between its write and its
commit, a refused upload, a release interrupted by a crash. :func:`sweep` removes
those older than a grace period (a younger one may belong to an upload in flight;
removing it would be safe, but would make that upload write its file again), temp
files older than the grace period, and rows of ``array_files`` without a file or a
dataset. It runs at start-up, periodically in each serve process and as
``welltempered gc``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from sqlalchemy import delete, exists, or_, select, union
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from service.storage.arrays import ArrayStore
from service.storage.db import ArrayFile, Dataset, utcnow

log = logging.getLogger("welltempered.storage")


@dataclass(frozen=True)
class Held:
    """A file an upload is about to name: its hash, size and the array (to write it
    again if a release removed it after :meth:`ArrayStore.put`)."""

    sha256: str
    n_bytes: int
    array: np.ndarray


def _lock(session: Session, sha256: str, n_bytes: int | None) -> None:
    # An upsert: the row lock (PostgreSQL) or the write lock (SQLite) until the end of
    # the transaction. ``n_bytes`` None keeps a stored size (a release does not know it).
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(ArrayFile).values(sha256=sha256, n_bytes=n_bytes or 0, created_at=utcnow())
    size = ArrayFile.n_bytes if n_bytes is None else stmt.excluded.n_bytes
    session.execute(
        stmt.on_conflict_do_update(index_elements=[ArrayFile.sha256], set_={"n_bytes": size})
    )


def hold(session: Session, store: ArrayStore, files: Iterable[Held]) -> None:
    """In the transaction that will insert rows naming ``files`` (the caller commits):
    lock each file's row, in hash order, and write again any file missing by now."""
    for f in sorted({f.sha256: f for f in files}.values(), key=lambda f: f.sha256):
        _lock(session, f.sha256, f.n_bytes)
        if not store.exists(f.sha256):
            log.info("array %s was released during the upload: writing it again", f.sha256)
            store.put(f.array, sha256=f.sha256)


def dataset_files(dataset) -> list[str]:
    """The hashes of the files a dataset (a row, or a row of its file columns) names."""
    files = [dataset.scores_sha256, dataset.labels_sha256, dataset.sequences_sha256,
             dataset.topk_ids_sha256]
    return [sha for sha in files if sha is not None]


def is_referenced(session: Session, sha256: str) -> bool:
    """Whether any dataset names the file ``sha256`` (scores, labels, sequence ids or
    top-k ids)."""
    return bool(
        session.scalar(
            select(
                exists().where(
                    or_(
                        Dataset.scores_sha256 == sha256,
                        Dataset.labels_sha256 == sha256,
                        Dataset.sequences_sha256 == sha256,
                        Dataset.topk_ids_sha256 == sha256,
                    )
                )
            )
        )
    )


def _release_one(session: Session, store: ArrayStore, sha256: str) -> int | None:
    # Its own transaction: lock, count, unlink while locked, forget the row, commit.
    # None: a dataset names the file (kept); else the bytes freed (0: no file was left).
    _lock(session, sha256, None)
    if is_referenced(session, sha256):
        session.rollback()
        return None
    freed = store.remove(sha256)
    session.execute(delete(ArrayFile).where(ArrayFile.sha256 == sha256))
    session.commit()
    return freed


def release(session: Session, store: ArrayStore, shas: Iterable[str]) -> int:
    """Remove each file of ``shas`` that no dataset names any more; returns the bytes
    freed. Call it after the transaction that deleted the rows has committed (each file
    gets a transaction of its own). A failure is logged, never raised: the rows are
    gone either way, and the sweep removes what is left."""
    session.rollback()  # no transaction of the caller's may hold locks during these
    freed = 0
    for sha in sorted(set(shas)):
        try:
            freed += _release_one(session, store, sha) or 0
        except Exception:
            session.rollback()
            log.warning("could not release array %s; the sweep will", sha, exc_info=True)
    return freed


@dataclass(frozen=True)
class Sweep:
    """What one :func:`sweep` did."""

    files_removed: int
    bytes_removed: int
    rows_removed: int
    tmp_removed: int
    young_kept: int


def referenced_hashes(session: Session) -> set[str]:
    """Every file hash some dataset names."""
    query = union(
        select(Dataset.scores_sha256),
        select(Dataset.labels_sha256).where(Dataset.labels_sha256.is_not(None)),
        select(Dataset.sequences_sha256).where(Dataset.sequences_sha256.is_not(None)),
        select(Dataset.topk_ids_sha256).where(Dataset.topk_ids_sha256.is_not(None)),
    )
    return set(session.scalars(query))


def sweep(
    sessions: sessionmaker, store: ArrayStore, grace_seconds: float, now: float | None = None
) -> Sweep:
    """Remove orphan array files (no dataset names them) last written more than
    ``grace_seconds`` ago, temp files as old, and rows of ``array_files`` that name
    neither a file nor a dataset. Safe while uploads and deletes run (module docstring);
    ``grace_seconds=0`` only when no upload can be in flight (start-up)."""
    now = time.time() if now is None else now
    cutoff = now - grace_seconds
    tmp_removed = store.clean_tmp(grace_seconds)
    with sessions() as session:
        referenced = referenced_hashes(session)
        rows = set(session.scalars(select(ArrayFile.sha256)))
    candidates: list[str] = []
    on_disk: set[str] = set()
    young = 0
    for f in store.files():
        on_disk.add(f.sha256)
        if f.sha256 in referenced:
            continue
        if f.mtime > cutoff:
            young += 1
            continue
        candidates.append(f.sha256)
    stale_rows = rows - referenced - on_disk
    files_removed = bytes_removed = rows_removed = 0
    with sessions() as session:
        for sha in [*candidates, *sorted(stale_rows)]:
            try:
                freed = _release_one(session, store, sha)
            except Exception:
                session.rollback()
                log.warning("sweep: could not release array %s", sha, exc_info=True)
                continue
            if freed is None:
                continue  # an upload named it meanwhile
            if sha in on_disk:
                files_removed += 1
                bytes_removed += freed
            else:
                rows_removed += 1
    result = Sweep(files_removed, bytes_removed, rows_removed, tmp_removed, young)
    if files_removed or rows_removed or tmp_removed:
        log.info("sweep: %s", result)
    return result
