"""The sequence ids of a dataset are a third array file of service.storage: counted in
the dataset's bytes, named by its content hash, kept by the sweep while a dataset names
it and released with the last one; on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import time

import numpy as np

from service.storage import array_refs, registry
from service.storage.db import Dataset
from service.vocabulary import DEFAULT_NAMESPACE
from tests.service.helpers import create_model, logits_data


def upload_with_ids(client, model: str, logits, labels, ids) -> int:
    body = {"logits": logits.tolist(), "labels": labels.tolist(), "sequence_ids": ids}
    r = client.post(f"/v1/models/{model}/datasets", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def row(client, model: str, dataset_id: int) -> Dataset:
    state = client.app.state.welltempered
    with state.sessions() as s:
        found = registry.find_model(s, model, DEFAULT_NAMESPACE)
        return registry.find_dataset(s, found, dataset_id)


def on_disk(client) -> set[str]:
    return {f.sha256 for f in client.app.state.welltempered.arrays.files()}


def test_the_ids_file_is_stored_counted_swept_and_released(client):
    z, y = logits_data(60)
    ids = [f"t{i // 6}" for i in range(60)]
    create_model(client, "a")
    create_model(client, "b")
    first = row(client, "a", upload_with_ids(client, "a", z, y, ids))
    state = client.app.state.welltempered
    stored = state.arrays.load(first.sequences_sha256)
    assert stored.tolist() == ids and first.n_sequences == 10
    sizes = {f.sha256: f.size for f in state.arrays.files()}
    assert first.n_bytes == sum(sizes[sha] for sha in array_refs.dataset_files(first))
    # Another model's dataset with the same ids shares the file.
    second = row(client, "b", upload_with_ids(client, "b", z, y, ids))
    assert second.sequences_sha256 == first.sequences_sha256
    old = time.time() - 120
    for sha in on_disk(client):
        path = state.arrays.path(sha)
        os.utime(path, (old, old))
    done = array_refs.sweep(state.sessions, state.arrays, grace_seconds=60)
    assert done.files_removed == 0 and first.sequences_sha256 in on_disk(client)
    assert client.delete(f"/v1/models/a/datasets/{first.id}").status_code == 200
    assert first.sequences_sha256 in on_disk(client)  # the other dataset names it
    assert client.delete("/v1/models/b").status_code == 200
    assert not set(array_refs.dataset_files(first)) & on_disk(client)


def test_a_dataset_without_ids_names_no_third_file(client):
    z, y = logits_data(60)
    create_model(client, "a")
    r = client.post("/v1/models/a/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    plain = row(client, "a", r.json()["id"])
    assert plain.sequences_sha256 is None and plain.n_sequences is None
    assert len(array_refs.dataset_files(plain)) == 2
    ints = row(client, "a", upload_with_ids(client, "a", z, y, np.arange(60).tolist()))
    assert ints.sha256 != plain.sha256
    assert ints.scores_sha256 == plain.scores_sha256  # the scores' file is shared
