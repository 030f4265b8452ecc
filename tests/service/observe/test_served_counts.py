"""service.observe.served: the served rows' predicted classes counted per version and
window, flushed from each process and added up across processes sharing a database."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.observe import served
from service.observe.monitoring import window_start
from service.storage import counts
from service.storage.db import ServedClass
from tests.service.helpers import create_model, logits_data, promote, upload


def test_kept_counts_are_exact_up_to_the_limit_and_bounded_above():
    rng = np.random.default_rng(0)
    small = rng.integers(0, 50, served.EXACT_CLASSES)
    assert served.kept_counts(small) == {i: int(c) for i, c in enumerate(small) if c}
    k = 5 * served.EXACT_CLASSES
    vector = rng.zipf(1.5, k) % 1000
    kept = served.kept_counts(vector)
    assert len(kept) == served.EXACT_CLASSES + 1
    assert sum(kept.values()) == vector.sum()
    tracked = np.array([c for c in kept if c != served.OTHER])
    # The kept classes are the largest counts: none left out counts more than the least kept.
    left_out = np.setdiff1d(np.arange(k), tracked)
    assert vector[left_out].max() <= vector[tracked].min()


def test_add_counts_sparse_and_dense_batches_alike():
    clock = iter([0.0, 1.0, 2.0, 61.0]).__next__
    counter = served.ServedCounts(60, clock=clock)
    big, small = (1, None), (2, None)
    counter.add(big, 10_000, [3, 3, 7])  # few rows for K: np.add.at
    counter.add(small, 4, [0, 1, 1, 3, 3, 3])  # many rows for K: bincount
    counter.add(small, 4, [2])
    counter.add(big, 10_000, [3])  # the next bucket
    drained = counter.drain()
    assert drained[(big, 0)][[3, 7]].tolist() == [2, 1] and drained[(big, 0)].sum() == 3
    assert drained[(small, 0)].tolist() == [1, 2, 1, 3]
    assert drained[(big, 60)][3] == 1 and drained[(big, 60)].sum() == 1
    assert counter.drain() == {}


def test_two_app_instances_sharing_a_database_add_up(settings):
    """Two serve processes (two apps, one database) serve the same version; after their
    flushes the window's counts are the sum of both, class by class."""
    logits, labels = logits_data(n=400, k=5, seed=3)
    expected = np.zeros(5, dtype=np.int64)
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        create_model(a, "m", k=5)
        version = promote(a, "m", upload(a, "m", logits, labels)["id"])["version"]
        for i, client in enumerate((a, b, a, b)):
            rows = logits[i * 50 : (i + 1) * 50 + i]
            r = client.post("/v1/models/m/predict", json={"logits": rows.tolist()})
            assert r.status_code == 200, r.text
            assert r.json()["version"] == version
            expected += np.bincount(r.json()["labels"], minlength=5)
        for client in (a, b):
            state = client.app.state.welltempered
            state.served_counts.flush(state.sessions)
        state = a.app.state.welltempered
        with state.sessions() as session:
            got = counts.window_counts(session, ServedClass, window_start(3600, 60))
    ((_, window),) = got.items()
    assert window == {c: int(n) for c, n in enumerate(expected) if n}


def test_counts_of_a_deleted_version_are_dropped_and_the_others_kept(client):
    logits, labels = logits_data(n=300, k=4, seed=1)
    create_model(client, "m", k=4)
    dataset = upload(client, "m", logits, labels)["id"]
    promote(client, "m", dataset)  # version 1: production
    promote(client, "m", dataset, seed=1)  # version 2: production now, 1 free to delete
    for version in (1, 2):
        r = client.post(
            "/v1/models/m/predict",
            params={"version": version},
            json={"logits": logits[:30].tolist()},
        )
        assert r.status_code == 200, r.text
    assert client.delete("/v1/models/m/calibrators/1").status_code == 200
    state = client.app.state.welltempered
    state.served_counts.flush(state.sessions)
    with state.sessions() as session:
        got = counts.window_counts(session, ServedClass, window_start(3600, 60))
    ((_, window),) = got.items()  # version 2's only
    assert sum(window.values()) == 30


def test_a_failed_flush_keeps_the_counts_for_the_next():
    counter = served.ServedCounts(60, clock=lambda: 0.0)
    counter.add((1, None), 3, [0, 2, 2])

    def broken():
        raise ConnectionError("the database is down")

    with pytest.raises(ConnectionError):
        counter.flush(broken)
    counter.add((1, None), 3, [1])
    assert counter.drain()[((1, None), 0)].tolist() == [1, 1, 2]


def test_batches_of_a_few_rows_are_kept_until_drained_then_counted_alike():
    """A batch of at most ``_FOLD_ROWS`` rows waits (one by one, counting costs a predict
    of one row more than the count); drained, the counts are those of counting each."""
    counter = served.ServedCounts(60, clock=lambda: 0.0)
    key = (1, None)
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, 9, rng.integers(1, served._FOLD_ROWS + 1)) for _ in range(40)]
    for batch in batches:
        counter.add(key, 9, batch)
    assert counter._counts == {}  # kept, not counted yet
    big = rng.integers(0, 9, served._FOLD_ROWS + 1)
    counter.add(key, 9, big)  # counted at once
    assert counter._counts[(key, 0)].sum() == big.size
    expected = np.bincount(np.concatenate([*batches, big]), minlength=9)
    assert counter.drain()[(key, 0)].tolist() == expected.tolist()


def test_kept_batches_are_counted_once_enough_wait_and_under_threads():
    import threading

    counter = served.ServedCounts(60, clock=lambda: 0.0)
    key = (1, None)
    for _ in range(served._FOLD_BATCHES - 1):
        counter.add(key, 3, [1])
    assert counter._counts == {}
    counter.add(key, 3, [2])  # the last one that fits: all counted
    assert counter._counts[(key, 0)].tolist() == [0, served._FOLD_BATCHES - 1, 1]
    assert not counter._pending

    def serve():  # adds and folds from several threads at once: nothing lost or doubled
        for i in range(3000):
            counter.add(key, 3, [0])
            if i % 500 == 0:
                counter.fold()

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.drain()[(key, 0)][0] == 4 * 3000

