"""A big dataset's metrics after its upload's answer (service.jobs.dataset_metrics,
service.storage.registry.fill_metrics): the answer has none, the dataset gets the same
figures as a small upload's answer shows; metrics that a stopped process left are
computed by the next one's look. On SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pytest

from service.jobs.dataset_metrics import MetricsFiller
from service.storage import registry
from service.storage.db import Dataset, Model
from tests.service.helpers import create_model, logits_data, upload


def metrics_of(client, model: str, dataset_id: int, timeout: float = 60.0) -> dict:
    """The dataset's metrics, once they are there."""
    deadline = time.monotonic() + timeout
    while True:
        got = client.get(f"/v1/models/{model}/datasets/{dataset_id}")
        assert got.status_code == 200, got.text
        if got.json()["metrics"] is not None:
            return got.json()["metrics"]
        assert time.monotonic() < deadline, "the metrics never came"
        time.sleep(0.02)


def test_a_big_upload_is_answered_first_and_its_metrics_follow(client, monkeypatch):
    logits, labels = logits_data(n=500, k=4)
    create_model(client, "inline")
    inline = upload(client, "inline", logits, labels)
    assert inline["metrics"] is not None  # small: in the answer, as always

    monkeypatch.setattr(registry, "INLINE_METRICS_SCORES", logits.size - 1)
    create_model(client, "big")
    big = upload(client, "big", logits, labels)
    assert big["metrics"] is None  # answered before its metrics
    assert metrics_of(client, "big", big["id"]) == inline["metrics"]


def test_metrics_a_stopped_process_left_are_computed_by_the_next_look(client, monkeypatch):
    state = client.app.state.welltempered
    logits, labels = logits_data(n=200, k=4, seed=1)
    create_model(client, "left")
    monkeypatch.setattr(registry, "INLINE_METRICS_SCORES", 0)
    with state.sessions() as session:  # an upload whose process stopped before them
        model = session.query(Model).filter_by(name="left").one()
        left, created = registry.add_dataset(session, model, state.arrays, logits, labels,
                                             "logits")
    assert created and metrics_of_row(state, left.id) is None

    filler = MetricsFiller(state.sessions, state.arrays, interval=0, grace=0).start()
    try:  # its first look, at start
        deadline = time.monotonic() + 60
        while metrics_of_row(state, left.id) is None:
            assert time.monotonic() < deadline, "the look never filled them"
            time.sleep(0.02)
    finally:
        filler.stop()
    monkeypatch.undo()
    create_model(client, "small")
    assert metrics_of_row(state, left.id) == upload(client, "small", logits, labels)["metrics"]
    # Filled: a second computation writes nothing, nor does one of a dataset that is gone.
    assert not registry.fill_metrics(state.sessions, state.arrays, left.id)
    assert not registry.fill_metrics(state.sessions, state.arrays, left.id + 1000)


@pytest.mark.parametrize("age, found", [(0.0, True), (3600.0, False)])
def test_the_look_leaves_young_datasets_to_their_upload(client, monkeypatch, age, found):
    state = client.app.state.welltempered
    logits, labels = logits_data(n=50, k=4, seed=2)
    create_model(client, "young")
    monkeypatch.setattr(registry, "INLINE_METRICS_SCORES", 0)
    with state.sessions() as session:
        model = session.query(Model).filter_by(name="young").one()
        dataset, _ = registry.add_dataset(session, model, state.arrays, logits, labels, "logits")
        assert (dataset.id in registry.datasets_without_metrics(session, age)) is found


def metrics_of_row(state, dataset_id: int):
    with state.sessions() as session:
        return session.get(Dataset, dataset_id).metrics


def test_the_documented_bound_is_the_code_s():
    from pathlib import Path

    from service.api.schemas import DatasetOut

    bound = f"{registry.INLINE_METRICS_SCORES:,}"
    assert bound in (Path(__file__).parents[3] / "docs" / "api.md").read_text()
    assert bound in DatasetOut.model_fields["metrics"].description


def test_a_big_upload_without_labels_gets_its_entropies_after_the_answer(client, monkeypatch):
    logits, _ = logits_data(n=300, k=4, seed=3)
    body = {"logits": logits.tolist()}
    create_model(client, "inline")
    inline = client.post("/v1/models/inline/datasets", json=body)
    assert inline.status_code == 201 and inline.json()["metrics"] is not None, inline.text

    monkeypatch.setattr(registry, "INLINE_METRICS_SCORES", logits.size - 1)
    create_model(client, "big")
    big = client.post("/v1/models/big/datasets", json=body).json()
    assert big["metrics"] is None
    assert metrics_of(client, "big", big["id"]) == inline.json()["metrics"]
