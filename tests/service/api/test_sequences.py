"""Datasets whose rows are tokens of texts (issue 22, item 1): a sequence id per row in
JSON and .npz uploads (service.api.codecs), validated and bounded; every hold-out split
of such a dataset by sequence (fits, imports, refits); the reports per sequence. On
SQLite and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest

from calibrators.evaluation.holdout import split_indices
from service.api.codecs.rules import MAX_SEQUENCE_ID_CHARS
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    import_params,
    logits_data,
    npz,
)


def texts(seed: int = 0, n_texts: int = 40) -> np.ndarray:
    """String ids of texts of 1 to 30 tokens, the tokens of different texts interleaved
    (as rows of a batch are): a split by rows would put most texts on both sides."""
    rng = np.random.default_rng(seed)
    ids = np.repeat([f"doc-{i:03d}" for i in range(n_texts)], rng.integers(1, 31, n_texts))
    return ids[rng.permutation(ids.size)]


def post(client, model: str, **body):
    return client.post(f"/v1/models/{model}/datasets", json=body)


def upload_texts(client, model: str, logits, labels, ids) -> dict:
    r = post(client, model, logits=logits.tolist(), labels=labels.tolist(),
             sequence_ids=np.asarray(ids).tolist())
    assert r.status_code in (200, 201), r.text
    return r.json()


def by_sequence(logits, labels, ids) -> dict:
    """The expected per-token and per-sequence NLL figures, by a loop over the texts."""
    probs = softmax(np.asarray(logits, dtype=np.float64))
    nll = -np.log(probs[np.arange(len(labels)), labels])
    names = sorted(set(ids.tolist()))
    per = np.array([nll[ids == name].mean() for name in names])
    return {
        "tokens": {"mean": nll.mean(), "median": np.median(nll),
                   "p95": np.percentile(nll, 95), "count": nll.size},
        "sequences": {"mean": per.mean(), "median": np.median(per),
                      "p95": np.percentile(per, 95), "count": len(names)},
    }


def assert_summary(got: dict, expected: dict) -> None:
    for part in ("tokens", "sequences"):
        assert got[part]["count"] == expected[part]["count"], part
        for stat in ("mean", "median", "p95"):
            assert got[part][stat] == pytest.approx(expected[part][stat], rel=1e-9), (part, stat)


def test_a_dataset_with_sequence_ids_reports_per_sequence(client):
    ids = texts()
    logits, labels = logits_data(ids.size)
    create_model(client)
    out = upload_texts(client, "m", logits, labels, ids)
    assert out["n_sequences"] == len(set(ids.tolist()))
    assert_summary(out["metrics"]["sequences"], by_sequence(logits, labels, ids))
    plain = post(client, "m", logits=logits.tolist(), labels=labels.tolist()).json()
    assert plain["n_sequences"] is None and "sequences" not in plain["metrics"]
    assert plain["id"] != out["id"]


def test_other_sequence_ids_make_another_dataset_and_equal_ones_the_same(client):
    ids = texts()
    logits, labels = logits_data(ids.size)
    create_model(client)
    first = upload_texts(client, "m", logits, labels, ids)
    again = post(client, "m", logits=logits.tolist(), labels=labels.tolist(),
                 sequence_ids=ids.tolist())
    assert again.status_code == 200 and again.json()["id"] == first["id"]
    other = upload_texts(client, "m", logits, labels, np.roll(ids, 1))
    assert other["id"] != first["id"] and other["sha256"] != first["sha256"]
    # The same ids from a .npz (numpy's str array, wider than needed) are the same dataset.
    body = npz(logits=logits, labels=labels, sequence_ids=ids.astype("<U40"))
    r = client.post("/v1/models/m/datasets", content=body,
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["id"] == first["id"], r.text


def test_integer_ids_from_json_and_npz_are_one_dataset(client):
    ids = np.repeat(np.arange(20) * 1000 - 7, 15)
    logits, labels = logits_data(ids.size)
    create_model(client)
    r = post(client, "m", logits=logits.tolist(), labels=labels.tolist(),
             sequence_ids=ids.tolist())
    assert r.status_code == 201 and r.json()["n_sequences"] == 20, r.text
    body = npz(logits=logits, labels=labels, sequence_ids=ids.astype(np.int32))
    again = client.post("/v1/models/m/datasets", content=body,
                        headers={"content-type": "application/octet-stream"})
    assert again.status_code == 200 and again.json()["id"] == r.json()["id"], again.text


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        (["a", "b"], ["sequence_ids", "one per row"]),
        ([1, "a"] * 5, ["sequence_ids", "int, str"]),
        ([1.0, 2.0] * 5, ["sequence_ids", "floats are not ids"]),
        ([True, False] * 5, ["sequence_ids", "bool"]),
        ([2**63] * 10, ["sequence_ids", "int64"]),
        (["x" * (MAX_SEQUENCE_ID_CHARS + 1)] * 10, ["sequence_ids", "characters"]),
        ("abcdefghij", ["sequence_ids"]),
    ],
)
def test_bad_json_sequence_ids_are_422(client, ids, words):
    logits, labels = logits_data(10)
    create_model(client)
    r = post(client, "m", logits=logits.tolist(), labels=labels.tolist(), sequence_ids=ids)
    assert_problem(r, 422, *words)


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        (np.arange(9), ["sequence_ids", "one entry per row"]),
        (np.arange(10, dtype=np.float64), ["sequence_ids", "integers or unicode strings"]),
        (np.array([b"a"] * 10), ["sequence_ids", "integers or unicode strings"]),
        (np.full(10, 2**63, dtype=np.uint64), ["sequence_ids", "int64"]),
        (np.array(["y" * (MAX_SEQUENCE_ID_CHARS + 1)] * 10), ["sequence_ids", "characters"]),
    ],
)
def test_bad_npz_sequence_ids_are_422(client, ids, words):
    logits, labels = logits_data(10)
    create_model(client)
    r = client.post("/v1/models/m/datasets", content=npz(logits=logits, labels=labels,
                                                          sequence_ids=ids),
                    headers={"content-type": "application/octet-stream"})
    assert_problem(r, 422, *words)


def test_string_ids_count_against_the_request_bytes(tmp_path, database_url):
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from tests.service.helpers import make_settings

    logits, labels = logits_data(100, k=2)
    arrays = logits.nbytes + labels.nbytes
    # Room for the scores and labels, not for 100 ids of 200 characters (80 kB as <U200).
    settings = make_settings(database_url, tmp_path, max_body_bytes=2 * arrays + 40_000)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        create_model(c, k=2)
        ids = np.array([f"{i:0200d}" for i in range(100)])
        body = npz(logits=logits, labels=labels, sequence_ids=ids)
        r = c.post("/v1/models/m/datasets", content=body,
                   headers={"content-type": "application/octet-stream"})
        assert_problem(r, 413, "bytes")
        short = np.array([f"{i:03d}" for i in range(100)])
        r = c.post("/v1/models/m/datasets", content=npz(logits=logits, labels=labels,
                                                        sequence_ids=short),
                   headers={"content-type": "application/octet-stream"})
        assert r.status_code == 201, r.text


def held_out(ids: np.ndarray, holdout: float, seed: int) -> np.ndarray:
    _, held = split_indices(ids.size, holdout, seed, groups=ids)
    return held


@pytest.mark.parametrize("refit", [False, True])
def test_a_fit_holds_out_whole_sequences(client, refit):
    ids = texts(seed=1)
    logits, labels = logits_data(ids.size, seed=1)
    create_model(client)
    dataset = upload_texts(client, "m", logits, labels, ids)
    version = fit(client, "m", dataset["id"], holdout=0.3, seed=4, refit=refit)
    assert version["status"] == "succeeded", version
    held = held_out(ids, 0.3, 4)
    by_rows = split_indices(ids.size, 0.3, 4)[1]
    assert set(ids[by_rows]) & set(ids[np.setdiff1d(np.arange(ids.size), by_rows)])
    fitted = np.setdiff1d(np.arange(ids.size), held)
    assert not set(ids[held]) & set(ids[fitted])  # no text on both sides
    before = version["metrics"]["before"]
    assert before["n"] == held.size
    assert_summary(before["sequences"], by_sequence(logits[held], labels[held], ids[held]))
    after = version["metrics"]["after"]["sequences"]
    assert after["sequences"]["count"] == len(set(ids[held].tolist()))
    assert after["tokens"]["mean"] == pytest.approx(version["metrics"]["after"]["nll"])


def test_imported_params_are_evaluated_on_the_same_sequences(client):
    ids = texts(seed=2)
    logits, labels = logits_data(ids.size, seed=2)
    create_model(client)
    dataset = upload_texts(client, "m", logits, labels, ids)
    fitted = fit(client, "m", dataset["id"], holdout=0.25, seed=3)
    imported = import_params(client, "m", dataset["id"], fitted["params"], holdout=0.25, seed=3)
    assert imported["status"] == "succeeded", imported
    held = held_out(ids, 0.25, 3)
    assert_summary(imported["metrics"]["before"]["sequences"],
                   by_sequence(logits[held], labels[held], ids[held]))
    assert imported["metrics"]["after"]["sequences"] == fitted["metrics"]["after"]["sequences"]


def test_one_sequence_is_accepted_but_cannot_be_split(client):
    logits, labels = logits_data(50)
    create_model(client)
    dataset = upload_texts(client, "m", logits, labels, ["only"] * 50)
    assert dataset["n_sequences"] == 1
    r = client.post("/v1/models/m/calibrators",
                    json={"dataset_id": dataset["id"], "method": "temperature"})
    assert_problem(r, 422, "sequence")
    params = fit(client, "m", upload_texts(client, "m", logits, labels, np.arange(50) % 5)["id"])
    r = client.post("/v1/models/m/calibrators/import",
                    json={"dataset_id": dataset["id"], "params": params["params"]})
    assert_problem(r, 422, "sequence")


@pytest.mark.parametrize("as_strings", [False, True])
def test_a_large_json_body_reads_its_ids_without_a_python_float_per_score(as_strings):
    """Bodies over a MiB take the parser's fast path (service.api.codecs.json_body
    .plain_object): the ids are read as they are, not as float64 like the scores."""
    import orjson

    from service.api.codecs import json_body
    from service.api.codecs.rules import SEQUENCE_KEY, Bounds

    logits, labels = logits_data(20_000)
    ids = [f'doc "{i // 7}", [x]' if as_strings else i // 7 - 5 for i in range(20_000)]
    body = orjson.dumps({"logits": logits.tolist(), "labels": labels.tolist(),
                         SEQUENCE_KEY: ids})
    assert len(body) > 1 << 20
    bounds = Bounds(4, "m", 100_000, 1 << 30, "dataset", sequences=True)
    fast = json_body.plain_object(body, {"logits", "labels", SEQUENCE_KEY}, bounds)
    assert fast is not None and fast[SEQUENCE_KEY] == ids
    data, _ = json_body.labelled_from_json(body, bounds)
    assert data.sequences.tolist() == ids
    assert data.sequences.dtype.kind == ("U" if as_strings else "i")
