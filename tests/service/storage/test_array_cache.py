"""The bounded read cache of remote arrays (service/storage/array_cache.py): least
recently used out first, the budget after every fill, threads and processes sharing one
folder, and readers never broken by an eviction."""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.storage.array_cache import ReadCache
from service.storage.arrays import ArrayStore

pytest.importorskip("fsspec")


#: float32 entries of array ``i``: its .npy file is 128 + 4 * (64 + 16 * i) bytes.
def entries(i: int) -> int:
    return 64 + 16 * i


def array(i: int) -> np.ndarray:
    return np.full(entries(i), i, dtype=np.float32)


def npy_size(i: int) -> int:
    buf = io.BytesIO()
    np.save(buf, array(i), allow_pickle=False)
    return buf.tell()


def remote_store(root: Path, remote: Path, cache_bytes: int | None) -> ArrayStore:
    """A store behind ``local://`` (an object store's stand-in that several processes
    share), its cache and temp files under ``root``."""
    store = ArrayStore(root, f"local://{remote}", cache_bytes=cache_bytes)
    store.ensure()
    return store


def put_arrays(store: ArrayStore, n: int) -> list[str]:
    return [store.put(array(i)) for i in range(n)]


def cached(store: ArrayStore, shas: list[str]) -> set[int]:
    return {i for i, sha in enumerate(shas) if store.read_cache.path(sha).exists()}


def read(store: ArrayStore, shas: list[str], i: int) -> None:
    a = store.load(shas[i])
    assert a.shape == (entries(i),) and float(a.min()) == float(a.max()) == i


def usage_locked(store: ArrayStore) -> int:
    """The bytes in the cache, counted under the fills' lock (a count taken while another
    process evicts and links could see a copy that is gone and its replacement)."""
    with store.read_cache._locked():
        return store.read_cache.usage()


# ---------------------------------------------------------------------------
# one reader


def test_least_recently_used_goes_first(tmp_path):
    sizes = [npy_size(i) for i in range(4)]  # increasing
    store = remote_store(tmp_path / "local", tmp_path / "remote", sum(sizes[1:]))
    shas = put_arrays(store, 4)
    for i in (0, 1, 2):
        read(store, shas, i)
    assert cached(store, shas) == {0, 1, 2}
    read(store, shas, 0)  # a hit: 0 is now the most recently used, 1 the least
    read(store, shas, 3)  # needs room: 1 goes, and that is enough
    assert cached(store, shas) == {0, 2, 3}
    stats = store.take_cache_stats()
    assert (stats.hits, stats.misses, stats.evictions) == (1, 4, 1)
    assert store.read_cache.usage() == sizes[0] + sizes[2] + sizes[3]
    read(store, shas, 1)  # back: 2 is now the least recently used
    assert cached(store, shas) == {0, 1, 3}
    assert store.read_cache.usage() <= store.read_cache.max_bytes
    assert list(store.tmp.iterdir()) == []  # every download was linked or removed


def test_an_array_larger_than_the_budget_is_read_but_not_kept(tmp_path):
    store = remote_store(tmp_path / "local", tmp_path / "remote", npy_size(3))
    shas = put_arrays(store, 5)
    read(store, shas, 0)
    read(store, shas, 4)  # too large for the whole budget: the cache stays as it was
    assert cached(store, shas) == {0}
    read(store, shas, 4)
    stats = store.take_cache_stats()
    assert (stats.hits, stats.misses, stats.evictions) == (0, 3, 0)
    assert list(store.tmp.iterdir()) == []
    nothing = remote_store(tmp_path / "none", tmp_path / "remote", 0)  # 0: keeps nothing
    read(nothing, shas, 0)
    read(nothing, shas, 0)
    assert nothing.read_cache.usage() == 0 and nothing.take_cache_stats().misses == 2


def test_a_missing_array_is_an_error_and_leaves_nothing(tmp_path):
    store = remote_store(tmp_path / "local", tmp_path / "remote", 10_000)
    with pytest.raises(FileNotFoundError, match="missing"):
        store.load("0" * 64)
    assert list(store.tmp.iterdir()) == [] and store.read_cache.usage() == 0


@pytest.fixture(scope="module")
def ten_remote(tmp_path_factory) -> tuple[Path, list[str]]:
    """A remote folder with arrays 0..9, shared by the examples below."""
    remote = tmp_path_factory.mktemp("remote")
    store = remote_store(tmp_path_factory.mktemp("writer"), remote, None)
    return remote, put_arrays(store, 10)


@given(
    budget=st.integers(0, 6000),
    reads=st.lists(st.integers(0, 9), min_size=1, max_size=30),
)
def test_the_budget_holds_after_every_fill_and_the_order_is_lru(ten_remote, budget, reads):
    """Against a model of an LRU cache: after every read the copies on disk are exactly
    the model's, and add up to at most the budget."""
    remote, shas = ten_remote
    sizes = [npy_size(i) for i in range(10)]  # 384 to 960 bytes
    with tempfile.TemporaryDirectory() as tmp:
        store = remote_store(Path(tmp), remote, budget)
        model: OrderedDict[int, int] = OrderedDict()
        for i in reads:
            read(store, shas, i)
            if i in model:
                model.move_to_end(i)
            elif sizes[i] <= budget:
                while sum(model.values()) + sizes[i] > budget:
                    model.popitem(last=False)
                model[i] = sizes[i]
            assert cached(store, shas) == set(model)
            assert store.read_cache.usage() == sum(model.values()) <= budget


# ---------------------------------------------------------------------------
# readers that hold what they read


def test_a_copy_being_read_is_never_evicted(tmp_path):
    """An array that lives (memory-mapped) pins its copy: fills that need its room read
    their arrays uncached instead, and the budget still holds; once dropped it can go."""
    size = npy_size(0)
    store = remote_store(tmp_path / "local", tmp_path / "remote", size)
    shas = [store.put(np.full(entries(0), i, dtype=np.float32)) for i in range(2)]
    held = store.load(shas[0])
    assert isinstance(held, np.memmap)
    other = store.load(shas[1])  # no room, and the only copy is being read
    assert float(other[0]) == 1.0
    assert store.read_cache.path(shas[0]).exists() and not store.read_cache.path(shas[1]).exists()
    assert store.read_cache.usage() <= size
    assert store.take_cache_stats().evictions == 0
    assert float(held.sum()) == 0.0 and held.shape == (entries(0),)
    view = held[10:]  # a view keeps the mapping, so the pin, alive
    del held, other
    store.load(shas[1])
    assert store.read_cache.path(shas[0]).exists()
    del view
    store.load(shas[1])  # unpinned now: evicted for the other one
    assert not store.read_cache.path(shas[0]).exists()
    assert store.read_cache.path(shas[1]).exists()
    assert store.take_cache_stats().evictions == 1


def test_an_unlinked_copy_stays_readable(tmp_path):
    """A mapped array whose copy is unlinked under it (its dataset deleted, the folder
    cleared by hand) reads the same bytes: Linux keeps an unlinked inode while it is open
    or mapped."""
    store = remote_store(tmp_path / "local", tmp_path / "remote", 10_000)
    shas = put_arrays(store, 3)
    held = store.load(shas[2])
    assert store.remove(shas[2]) > 0  # the remote object and the local copy
    assert not store.read_cache.path(shas[2]).exists()
    for copy in store.cache.rglob("*.npy"):
        copy.unlink()
    np.testing.assert_array_equal(held, array(2))
    with pytest.raises(FileNotFoundError):
        store.load(shas[2])


def _open_by(path: Path) -> bool:
    """Whether this process has ``path`` open."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def test_a_reader_that_opened_a_copy_being_evicted_reads_it_again(tmp_path):
    """The race: a reader opens a copy just as an eviction takes it (exclusive lock), then
    waits for its shared lock; it gets it once the copy is unlinked, sees no link left,
    and downloads the array again: it reads the right bytes either way."""
    import fcntl

    store = remote_store(tmp_path / "local", tmp_path / "remote", 10_000)
    shas = put_arrays(store, 2)
    read(store, shas, 1)
    copy = store.read_cache.path(shas[1])
    store.take_cache_stats()
    fd = os.open(copy, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what an eviction holds while it unlinks
        result = {}

        def reader():
            a = store.load(shas[1])
            result["sum"] = float(a.sum())

        t = threading.Thread(target=reader)
        t.start()
        deadline = time.monotonic() + 10
        while not _open_by(copy):  # the reader opened it and waits for its lock
            assert time.monotonic() < deadline
            time.sleep(0.005)
        copy.unlink()
    finally:
        os.close(fd)
    t.join(10)
    assert result["sum"] == float(array(1).sum())
    stats = store.take_cache_stats()
    assert (stats.hits, stats.misses) == (0, 1)  # the evicted copy did not count as a hit
    assert copy.exists()  # filled again


# ---------------------------------------------------------------------------
# many readers


def test_threads_share_one_cache(tmp_path):
    sizes = [npy_size(i) for i in range(8)]
    budget = sum(sizes[-3:])
    store = remote_store(tmp_path / "local", tmp_path / "remote", budget)
    shas = put_arrays(store, 8)
    over = []

    def work(seed: int) -> int:
        rng = random.Random(seed)
        held = []
        for _ in range(40):
            i = rng.randrange(8)
            a = store.load(shas[i])
            assert float(a[0]) == float(a[-1]) == i
            held = [*held[-1:], a]  # keep one earlier array mapped: some copies are pinned
            used = usage_locked(store)
            if used > budget:
                over.append(used)
        return len(held)

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(work, range(6))) == [2] * 6
    assert over == []
    stats = store.take_cache_stats()
    assert stats.hits + stats.misses == 240 and stats.hits > 0 and stats.evictions > 0
    assert list(store.tmp.iterdir()) == []


def _process_reader(root: str, remote: str, budget: int, shas: list[str], seed: int) -> tuple:
    """Runs in another process: reads at random, checking each array and the budget."""
    store = ArrayStore(Path(root), f"local://{remote}", cache_bytes=budget)
    rng = random.Random(seed)
    held = None
    over = 0
    for _ in range(40):
        i = rng.randrange(len(shas))
        a = store.load(shas[i])
        if not float(a[0]) == float(a[-1]) == i or a.shape != (entries(i),):
            raise AssertionError(f"array {i} read wrong: {a[:3]}")
        held = a  # the previous one is dropped, this one pinned for the next read
        over += usage_locked(store) > budget
    del held
    stats = store.take_cache_stats()
    return stats.hits, stats.misses, stats.evictions, over


@pytest.mark.process
def test_processes_share_one_cache_folder(tmp_path):
    """Three processes with the same data folder (a worker's fit processes do this), a
    budget of three arrays out of eight: every read right, the budget never exceeded."""
    sizes = [npy_size(i) for i in range(8)]
    budget = sum(sizes[-3:])
    store = remote_store(tmp_path / "local", tmp_path / "remote", budget)
    shas = put_arrays(store, 8)
    ctx = multiprocessing.get_context("forkserver")
    args = [(str(tmp_path / "local"), str(tmp_path / "remote"), budget, shas, s) for s in range(3)]
    with ctx.Pool(3) as pool:
        results = pool.starmap(_process_reader, args)
    hits, misses, evictions, over = (sum(r[k] for r in results) for k in range(4))
    assert over == 0
    assert hits + misses == 120 and hits > 0 and evictions > 0
    assert store.read_cache.usage() <= budget
    assert list(store.tmp.iterdir()) == []
    print(f"\n3 processes, 120 reads: {hits} hits, {misses} misses, {evictions} evictions")


def test_a_file_system_without_hard_links_gets_a_rename(tmp_path, monkeypatch):
    store = remote_store(tmp_path / "local", tmp_path / "remote", 10_000)
    shas = put_arrays(store, 2)

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted", str(src))

    monkeypatch.setattr(os, "link", no_links)
    read(store, shas, 1)
    read(store, shas, 1)
    assert cached(store, shas) == {1} and list(store.tmp.iterdir()) == []
    stats = store.take_cache_stats()
    assert (stats.hits, stats.misses) == (1, 1)


def test_the_cache_refuses_a_negative_budget(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        ReadCache(tmp_path, lambda suffix: tmp_path / "x", -1)
