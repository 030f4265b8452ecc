"""The local read cache of remote arrays: ``<data_dir>/cache``, bounded, least recently
used out first.

Why a cache: a fit memory-maps its arrays (:meth:`ArrayStore.load
<service.storage.arrays.ArrayStore.load>`), and an object store has no ``mmap``; so a
reader downloads the array once, and later readers on the machine map that copy. A name
is its content (``<sha256>.npy``), so a copy is never stale. Without a bound the folder
only grows, by every array any fit on the machine ever read: :class:`ReadCache` keeps
the copies under ``max_bytes`` (``WELLTEMPERED_ARRAY_CACHE_BYTES``).

Threads and processes (a worker's fit processes, or processes given the same data
folder) share it through the file system alone, with no index to get out of step:

- *Fill*: a copy is downloaded to the temp folder (never into ``cache/``, so nothing
  half-written is ever in it) and, under the cache's lock (an exclusive ``flock`` of
  ``cache/.lock``), linked into place under its hash. ``os.link`` is atomic like a
  rename and never replaces a copy that another process put there first (a file
  system without hard links gets a rename, under the same lock).
- *Recency* is a copy's modification time, set to now on every hit, so every process
  sees one order.
- *Readers pin* a copy with a shared ``flock`` for as long as they read it: for a
  memory-mapped array, as long as the array lives (the mapping keeps a duplicate of the
  descriptor, and with it the lock; :func:`service.storage.arrays.read_npy`).
- *Eviction*, under the cache's lock before each fill: the least recently used copies
  go until the new one fits. A copy is unlinked only if its exclusive ``flock`` is
  taken without waiting, so a copy being read stays, and a reader that opened it just
  before sees it unlinked (no links left) and fills again.

After a fill the copies in ``cache/`` add up to at most ``max_bytes``. An array larger
than the budget, or that cannot fit because the other copies are all being read, is
read from its downloaded temp file, unlinked at once, and not kept: a miss each time.
On Linux an unlinked file stays readable by whoever has it open (or mapped), so no
eviction, nor a deleted dataset's copy being removed, ever breaks a reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: A copy's file name: the array's sha256 in lower-case hex, then ``.npy``.
_COPY_NAME = re.compile(r"^[0-9a-f]{64}\.npy$")
#: The file whose exclusive ``flock`` a fill (and its evictions) holds.
LOCK_NAME = ".lock"


@dataclass
class CacheStats:
    """What a :class:`ReadCache` did since it was made or last :meth:`~ReadCache.take_stats`.

    ``hits``: reads served by a copy in the cache; ``misses``: reads that downloaded the
    array; ``evictions``: copies this cache removed to make room.
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def empty(self) -> bool:
        return self.hits == self.misses == 0


@dataclass(frozen=True)
class _Copy:
    mtime_ns: int
    name: str
    path: Path
    size: int


class ReadCache:
    """Read copies of remote arrays in ``folder``, at most ``max_bytes`` (module docstring).

    Parameters
    ----------
    folder : Path
        The cache folder, ``<data_dir>/cache``: ``<sha[:2]>/<sha256>.npy`` copies.
    temp_path : callable (suffix) -> Path
        A new empty file in the same file system (``ArrayStore.temp_path``): downloads
        land there first.
    max_bytes : int, optional
        The budget of the copies on disk; None: no bound (nothing is ever evicted); 0:
        nothing is kept.

    Examples
    --------
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> def temp_path(suffix):
    ...     fd, name = tempfile.mkstemp(dir=root, suffix=suffix)
    ...     os.close(fd)
    ...     return Path(name)
    >>> cache = ReadCache(root / "cache", temp_path, max_bytes=12)
    >>> def fetch(dest):
    ...     dest.write_bytes(b"123456")
    >>> for sha in ("a" * 64, "b" * 64, "a" * 64, "c" * 64):  # c's fill evicts b
    ...     with cache.open(sha, fetch) as f:
    ...         assert f.read() == b"123456"
    >>> cache.take_stats(), cache.usage()
    (CacheStats(hits=1, misses=3, evictions=1), 12)
    >>> [cache.path(sha).exists() for sha in ("a" * 64, "b" * 64, "c" * 64)]
    [True, False, True]
    >>> import shutil; shutil.rmtree(root)
    """

    def __init__(
        self, folder: Path, temp_path: Callable[[str], Path], max_bytes: int | None = None
    ):
        if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes < 0):
            raise ValueError(f"max_bytes must be None or an int >= 0. Got {max_bytes!r}.")
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._temp_path = temp_path
        self._stats = CacheStats()
        self._stats_lock = threading.Lock()

    def path(self, sha256: str) -> Path:
        """Where the copy of ``sha256`` lives (it may not be there)."""
        return self.folder / sha256[:2] / f"{sha256}.npy"

    # -- reading --------------------------------------------------------------------

    @contextlib.contextmanager
    def open(self, sha256: str, fetch: Callable[[Path], None]) -> Iterator[IO[bytes]]:
        """The copy of ``sha256``, open for reading and pinned until closed.

        A hit opens the copy in the cache; a miss calls ``fetch(dest)`` to download the
        array into a new temp file ``dest``, then keeps it (evicting what must go) or,
        when it cannot fit, reads it from its unlinked temp file. A duplicate of the
        descriptor (a memory map) keeps the pin after the file is closed.
        """
        f = self._pin(self.path(sha256))
        if f is not None:
            self._count(hits=1)
        else:
            f = self._fill(sha256, fetch)
        with f:
            yield f

    def take_stats(self) -> CacheStats:
        """The counts since the last call (and start again from zero)."""
        with self._stats_lock:
            stats, self._stats = self._stats, CacheStats()
        return stats

    def usage(self) -> int:
        """Bytes of the copies in the folder now (``welltempered_array_cache_bytes``)."""
        return sum(copy.size for copy in self._copies())

    # -- internals ------------------------------------------------------------------

    def _count(self, hits: int = 0, misses: int = 0, evictions: int = 0) -> None:
        with self._stats_lock:
            s = self._stats
            self._stats = CacheStats(s.hits + hits, s.misses + misses, s.evictions + evictions)

    @staticmethod
    def _pin(path: Path) -> IO[bytes] | None:
        """``path`` open with a shared ``flock`` and marked used now; None if it is not
        there (or was evicted between the open and the lock)."""
        try:
            f = open(path, "rb")  # returned open: the caller closes it
        except FileNotFoundError:
            return None
        try:
            # Waits only while an eviction holds the copy, i.e. for one unlink.
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            if os.fstat(f.fileno()).st_nlink == 0:  # unlinked meanwhile: not in the cache
                f.close()
                return None
            now = time.time_ns()  # the clock, not the file system's coarser timestamps
            with contextlib.suppress(OSError):  # another user's copy: order unchanged
                os.utime(f.fileno(), ns=(now, now))
        except BaseException:
            f.close()
            raise
        return f

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The cache's lock: one fill (sizes, evictions, link) at a time, all processes."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new descriptor per call: threads exclude too
            yield
        finally:
            os.close(fd)  # releases the lock

    def _fill(self, sha256: str, fetch: Callable[[Path], None]) -> IO[bytes]:
        tmp = self._temp_path(".npy")
        try:
            fetch(tmp)
            f = open(tmp, "rb")  # returned open: the caller closes it
            try:
                os.fsync(f.fileno())  # whole on disk before its name is in the cache
                now = time.time_ns()
                os.utime(f.fileno(), ns=(now, now))  # used now, on the clock hits use
                size = os.fstat(f.fileno()).st_size
                final = self.path(sha256)
                with self._locked():
                    other = self._pin(final)  # another thread or process filled it meanwhile
                    if other is not None:
                        f.close()
                        self._count(misses=1)
                        return other
                    fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # pinned before it has a name
                    fits, evicted = self._make_room(size)
                    if fits:
                        final.parent.mkdir(parents=True, exist_ok=True)
                        try:
                            os.link(tmp, final)
                        except FileExistsError:  # put there without the lock: read ours
                            pass
                        except OSError:  # no hard links here: a rename, under the lock
                            os.replace(tmp, final)
            except BaseException:
                f.close()
                raise
            self._count(misses=1, evictions=evicted)
            return f
        finally:
            tmp.unlink(missing_ok=True)  # a kept copy lives on under its hash name

    def _make_room(self, size: int) -> tuple[bool, int]:
        """Evict, least recently used first, until ``size`` more bytes fit (the cache's
        lock is held). Returns whether the new copy fits (False: it is not kept) and how
        many copies were evicted."""
        if self.max_bytes is None:
            return True, 0
        if size > self.max_bytes:
            return False, 0  # would never fit: evicting for it would only empty the cache
        copies = list(self._copies())
        total = sum(copy.size for copy in copies)
        evicted = 0
        for copy in sorted(copies, key=lambda c: (c.mtime_ns, c.name)):
            if total + size <= self.max_bytes:
                break
            freed = self._evict(copy.path)
            if freed is not None:
                total -= copy.size
                evicted += freed
        return total + size <= self.max_bytes, evicted

    @staticmethod
    def _evict(path: Path) -> int | None:
        """Unlink ``path`` unless it is being read: 1 if this call removed it, 0 if it
        was already gone, None if it stays (a reader holds its shared lock)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            try:
                path.unlink()
            except FileNotFoundError:
                return 0
            return 1
        finally:
            os.close(fd)

    def _copies(self) -> Iterator[_Copy]:
        """The copies in the folder (other names are not counted); a copy removed while
        listing is skipped."""
        if not self.folder.is_dir():
            return
        for sub in os.scandir(self.folder):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if not _COPY_NAME.match(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield _Copy(st.st_mtime_ns, entry.name, Path(entry.path), st.st_size)
