"""Content-addressed array files: ``<data_dir>/arrays/<sha[:2]>/<sha256>.npy``.

Why files and not database blobs: a 100,000 x 1,000 float32 dataset is 400 MB;
as a file it is written once while hashing, read back with ``mmap`` by the fit
worker, and deduplicated by name, while a BYTEA/BLOB would be copied in full
through the driver on every read and bloat the database's WAL and backups.

Crash safety, in the order of :meth:`ArrayStore.put`: write to a temp file in
``<data_dir>/tmp`` (same file system), fsync it, ``os.replace`` it to its hash
name, fsync the directory; only then does the caller commit the row that names
the hash. A crash at any point leaves at most an orphan file (or a temp file,
removed on the next start), never a row pointing at a missing or partial array.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import IO

import numpy as np


class _HashingWriter:
    """A write-only file wrapper that feeds every byte to some hashers.

    ``np.save`` writes to non-file objects in chunks of ~16 MiB, so a big
    array is never duplicated in memory.
    """

    def __init__(self, raw: IO[bytes], hashers):
        self.raw = raw
        self.hashers = hashers

    def write(self, data) -> int:
        view = memoryview(data)
        for h in self.hashers:
            h.update(view)
        return self.raw.write(view)

    def flush(self) -> None:
        self.raw.flush()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform/file system
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ArrayStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.arrays = self.root / "arrays"
        self.tmp = self.root / "tmp"

    def ensure(self) -> None:
        self.arrays.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.arrays / sha256[:2] / f"{sha256}.npy"

    def temp_path(self, suffix: str = "") -> Path:
        """A new empty file in the store's temp folder; the caller removes it."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.tmp, suffix=suffix)
        os.close(fd)
        return Path(name)

    def put(self, array: np.ndarray, also=()) -> str:
        """Store ``array`` as .npy under its sha256 (also fed to ``also``); return the hash."""
        own = hashlib.sha256()
        tmp = self.temp_path(".npy")
        try:
            with open(tmp, "wb") as raw:
                np.save(_HashingWriter(raw, [own, *also]), array, allow_pickle=False)
                raw.flush()
                os.fsync(raw.fileno())
            sha = own.hexdigest()
            final = self.path(sha)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)  # atomic; identical content may simply overwrite
            _fsync_dir(final.parent)
            return sha
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, sha256: str, *, mmap: bool = True) -> np.ndarray:
        path = self.path(sha256)
        if not path.exists():
            raise FileNotFoundError(f"array {sha256} is missing from {self.arrays}")
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)

    def clean_tmp(self, older_than_seconds: float = 0.0) -> int:
        """Remove temp files left by a crash; returns how many were removed."""
        removed = 0
        if not self.tmp.exists():
            return 0
        cutoff = time.time() - older_than_seconds
        for p in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                if p.stat().st_mtime <= cutoff:
                    p.unlink()
                    removed += 1
        return removed
