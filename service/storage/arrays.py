"""Content-addressed array files: ``<data_dir>/arrays/<sha[:2]>/<sha256>.npy``.

Why files and not database blobs: a 100,000 x 1,000 float32 dataset is 400 MB;
as a file it is written once while hashing, read back with ``mmap`` by the fit
worker, and deduplicated by name, while a BYTEA/BLOB would be copied in full
through the driver on every read and bloat the database's WAL and backups.

Crash safety, in the order of :meth:`ArrayStore.put`: write to a temp file in
``<data_dir>/tmp`` (same file system), fsync it, ``os.replace`` it to its hash
name, fsync the directory; only then does the caller commit the row that names
the hash. A crash at any point leaves at most an orphan file (or a temp file),
never a row pointing at a missing or partial array; orphans are removed by the
sweep of :mod:`service.storage.array_refs`, which also decides when a file no row
refers to any more may go (this module only names, writes, reads and unlinks).

Where the arrays live (``WELLTEMPERED_ARRAY_STORE``): by default the folder
``<data_dir>/arrays``, which in a fleet is a volume every replica and worker mounts.
Or any URL fsspec opens (``s3://bucket/prefix``, ``gs://...``, ``local:///path``;
``pip install 'welltempered[object-store]'`` and the backend's own package): an
object appears whole when its upload ends, so the same order holds (upload, then
commit the row). Readers keep a content-addressed copy under ``<data_dir>/cache`` to
``mmap`` it (a name is its content: a cached copy is never stale), within a byte budget
(``WELLTEMPERED_ARRAY_CACHE_BYTES``), least recently used out first:
:mod:`service.storage.array_cache`. Temp files and that cache are always local to the
process's machine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from service.storage.array_cache import CacheStats, ReadCache

#: The file name of a stored array: its sha256 in lower-case hex, then ``.npy``.
_ARRAY_NAME = re.compile(r"^([0-9a-f]{64})\.npy$")


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


class _Counter:
    """Counts the bytes fed to it as a hasher is (:meth:`ArrayStore.write`)."""

    def __init__(self):
        self.size = 0

    def update(self, data) -> None:
        self.size += memoryview(data).nbytes

    def flush(self) -> None:
        pass


@dataclass(frozen=True)
class Staged:
    """A ``.npy`` file already written in the store's temp folder (:meth:`ArrayStore.temp_path`),
    with the sha256 and size of its bytes: an upload's member, hashed as it arrived.
    :meth:`ArrayStore.adopt` stores it as it is, without writing the array again."""

    path: Path
    sha256: str
    size: int


@dataclass(frozen=True)
class StoredFile:
    """An array file found on disk: its hash, path, size and last modification (Unix s)."""

    sha256: str
    path: Path
    size: int
    mtime: float


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform/file system
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
_OWNED = re.compile(r"^(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]+)-")


def _mtime(info: dict) -> float:
    """Last modification (Unix seconds) of an fsspec ``info`` (keys differ by backend);
    unknown: now, so the sweep's grace period keeps the file."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return time.time()


def _owner_alive(name: str) -> bool:
    """Whether a temp file's name says it belongs to a running process of this host."""
    match = _OWNED.match(name)
    if match is None or match.group("host") != _HOST:
        return False
    pid = int(match.group("pid"))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_folder(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def read_npy(f: IO[bytes], *, mmap: bool = True) -> np.ndarray:
    """The array of an open ``.npy`` file; with ``mmap``, mapped from that very file.

    ``np.load(path, mmap_mode="r")`` opens the path again; this maps the descriptor
    given, whose mapping keeps a duplicate of it, so a ``flock`` held on ``f`` (the read
    cache's pin) lasts as long as the array, and an unlinked file stays readable.
    Object arrays are refused, as ``np.load`` without pickle does.
    """
    if not mmap:
        return np.load(f, allow_pickle=False)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"an .npy file of format version 1.0 or 2.0 was expected. Got {version}.")
    if dtype.hasobject:
        raise ValueError(f"an array of Python objects cannot be memory-mapped. Got {dtype}.")
    order = "F" if fortran else "C"
    return np.memmap(f, dtype=dtype, mode="r", shape=shape, order=order, offset=f.tell())


class ArrayStore:
    """The arrays of every dataset, by sha256.

    Parameters
    ----------
    root : Path
        The process's local folder: ``tmp/`` (uploads being received), ``cache/``
        (read copies of remote arrays) and, without ``url``, ``arrays/``.
    url : str, optional
        Where the arrays live: a folder path or ``file://`` URL, or a URL fsspec opens.
    cache_bytes : int, optional
        With a URL, the budget of ``cache/`` (:class:`~service.storage.array_cache.ReadCache`;
        ``WELLTEMPERED_ARRAY_CACHE_BYTES``); None: no bound.
    """

    def __init__(self, root: Path, url: str | None = None, cache_bytes: int | None = None):
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.cache = self.root / "cache"
        self.read_cache = ReadCache(self.cache, self.temp_path, cache_bytes)
        self.url = url
        self._fs = None
        if url is None:
            self.arrays = self.root / "arrays"
        elif _is_folder(url):
            self.arrays = Path(url.removeprefix("file://"))
        else:
            try:
                import fsspec  # optional: only an object-store URL needs it
            except ImportError as exc:
                raise ValueError(
                    f"WELLTEMPERED_ARRAY_STORE={url!r} needs fsspec: pip install "
                    "'welltempered[object-store]' (and the backend, e.g. s3fs)."
                ) from exc
            self._fs, base = fsspec.core.url_to_fs(url)
            self.arrays = Path(base)

    def ensure(self) -> None:
        if self._fs is None:
            self.arrays.mkdir(parents=True, exist_ok=True)
        else:
            self._fs.makedirs(str(self.arrays), exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        """Where the array of ``sha256`` lives (in the object store, with a URL)."""
        return self.arrays / sha256[:2] / f"{sha256}.npy"

    def temp_path(self, suffix: str = "") -> Path:
        """A new empty file in the store's temp folder; the caller removes it.

        Its name starts with its owner, ``<host>-<pid>-``: :meth:`clean_tmp` never
        removes a file of a live process of this host, however old, whichever process
        sweeps (replicas and workers share the folder)."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix=f"{_HOST}-{os.getpid()}-", suffix=suffix)
        os.close(fd)
        return Path(name)

    def put(self, array: np.ndarray, also=(), sha256: str | None = None) -> str:
        """Store ``array`` as .npy under its sha256 (also fed to ``also``); return the hash.

        ``sha256``, when the caller has it (a file written again under its known name),
        names the file without hashing the bytes a second time. The file is written (a
        fresh inode, a fresh modification time) even when the name exists: a caller about
        to commit a row that names it must not depend on a file a concurrent release may
        be removing.
        """
        return self.write(array, also, sha256)[0]

    def write(
        self, array: np.ndarray, also=(), sha256: str | None = None
    ) -> tuple[str, int]:
        """:meth:`put`, returning the file's sha256 and size in bytes: with no
        ``sha256``, both come from the one pass that writes it (an upload's)."""
        own, counter = hashlib.sha256(), _Counter()
        tmp = self.temp_path(".npy")
        try:
            with open(tmp, "wb") as raw:
                hashers = [counter, *also] if sha256 is not None else [own, counter, *also]
                np.save(_HashingWriter(raw, hashers), array, allow_pickle=False)
                raw.flush()
                os.fsync(raw.fileno())
            sha = sha256 if sha256 is not None else own.hexdigest()
            self._place(tmp, sha)
            return sha, counter.size
        finally:
            tmp.unlink(missing_ok=True)

    def adopt(self, staged: Staged) -> tuple[str, int]:
        """Store a file written and hashed beforehand (:class:`Staged`): fsynced, then put
        under its hash as :meth:`write` puts the file it writes; returns its sha256 and
        size. The caller removes ``staged.path`` if it is still there (object stores copy
        it)."""
        fd = os.open(staged.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._place(staged.path, staged.sha256)
        return staged.sha256, staged.size

    def _place(self, tmp: Path, sha: str) -> None:
        """Move (or, to an object store, copy) the fsynced temp file ``tmp`` to its name."""
        final = self.path(sha)
        if self._fs is not None:  # an object appears whole once its upload ends
            self._fs.makedirs(str(final.parent), exist_ok=True)
            self._fs.put_file(str(tmp), str(final))
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)  # atomic; identical content may simply overwrite
        _fsync_dir(final.parent)

    def load(self, sha256: str, *, mmap: bool = True) -> np.ndarray:
        """The array of ``sha256``, memory-mapped read-only unless ``mmap`` is False.

        Behind a URL it is read from the local cache (downloaded on a miss), pinned there
        while the array lives (:mod:`service.storage.array_cache`).
        """
        if self._fs is not None:
            with self.read_cache.open(sha256, functools.partial(self._download, sha256)) as f:
                return read_npy(f, mmap=mmap)
        path = self.path(sha256)
        if not path.exists():
            raise FileNotFoundError(f"array {sha256} is missing from {self.arrays}")
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)

    def take_cache_stats(self) -> CacheStats:
        """Hits, misses and evictions of the read cache since the last call."""
        return self.read_cache.take_stats()

    def _download(self, sha256: str, dest: Path) -> None:
        remote = str(self.path(sha256))
        if not self._fs.exists(remote):
            raise FileNotFoundError(f"array {sha256} is missing from {self.url}")
        self._fs.get_file(remote, str(dest))

    def exists(self, sha256: str) -> bool:
        if self._fs is not None:
            return self._fs.isfile(str(self.path(sha256)))
        return self.path(sha256).is_file()

    def remove(self, sha256: str) -> int:
        """Unlink the file of ``sha256`` (the caller decided no row needs it); returns the
        bytes freed (0 if it was not there)."""
        if self._fs is not None:
            # A reader of the copy keeps reading it (an unlinked file stays readable).
            self.read_cache.path(sha256).unlink(missing_ok=True)
            remote = str(self.path(sha256))
            try:
                size = int(self._fs.info(remote)["size"])
                self._fs.rm_file(remote)
            except FileNotFoundError:
                return 0
            return size
        path = self.path(sha256)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        _fsync_dir(path.parent)
        return size

    def files(self) -> Iterator[StoredFile]:
        """Every array file on disk (names that are not a hash, e.g. foreign files, are
        skipped); a file removed while listing is skipped too."""
        if self._fs is not None:
            yield from self._remote_files()
            return
        if not self.arrays.exists():
            return
        for folder in sorted(self.arrays.iterdir()):
            if not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                match = _ARRAY_NAME.match(path.name)
                if match is None:
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                yield StoredFile(match.group(1), path, st.st_size, st.st_mtime)

    def _remote_files(self) -> Iterator[StoredFile]:
        base = str(self.arrays)
        if not self._fs.exists(base):
            return
        for name, info in sorted(self._fs.find(base, detail=True).items()):
            match = _ARRAY_NAME.match(name.rsplit("/", 1)[-1])
            if match is None:
                continue
            yield StoredFile(match.group(1), Path(name), int(info["size"]), _mtime(info))

    def clean_tmp(self, older_than_seconds: float = 0.0) -> int:
        """Remove temp files left by a crash, untouched for ``older_than_seconds``;
        returns how many were removed. A file whose owner (:meth:`temp_path`) is a live
        process of this host stays; another host's files go by age only."""
        removed = 0
        if not self.tmp.exists():
            return 0
        cutoff = time.time() - older_than_seconds
        for p in self.tmp.iterdir():
            if _owner_alive(p.name):
                continue
            with contextlib.suppress(OSError):
                if p.stat().st_mtime <= cutoff:
                    p.unlink()
                    removed += 1
        return removed
