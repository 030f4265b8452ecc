"""The compare route of service.api (issue 22, item 4): two datasets of a model, the
scores of two models on the same positions, answered with
calibrators.evaluation.pair.temperature_explains; bad requests are problems. On SQLite
and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest

from calibrators.evaluation.pair import temperature_explains
from tests.oracles import softmax
from tests.service.helpers import assert_problem, create_model, logits_data, upload


def scores(client, model: str, logits, kind: str = "logits") -> int:
    r = client.post(f"/v1/models/{model}/datasets", json={kind: np.asarray(logits).tolist()})
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def compare(client, a: int, b: int, **extra):
    return client.post("/v1/models/m/compare", json={"a": a, "b": b, **extra})


def test_b_as_a_tempered_is_all_temperature(client):
    z, _ = logits_data(300, k=6, seed=1)
    create_model(client, k=6)
    a = scores(client, "m", z)
    b = scores(client, "m", softmax(0.4 * z), kind="probabilities")
    r = compare(client, a, b, top_k=4)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["beta"] == pytest.approx(0.4, rel=1e-6)
    assert out["explained"] == pytest.approx(1.0, abs=1e-6)
    assert out["top1_agreement"] == 1.0 and out["discordance"]["p95"] == 0.0
    assert out["n"] == 300 and out["top_k"] == 4 and (out["a"], out["b"]) == (a, b)


def test_b_with_other_ranks_is_not_temperature_and_the_answer_is_the_librarys(client):
    z, labels = logits_data(200, k=5, seed=2)
    permuted = z[:, np.random.default_rng(3).permutation(5)]
    create_model(client, k=5)
    a = upload(client, "m", z, labels)["id"]  # labelled or not: the scores are compared
    b = scores(client, "m", permuted)
    out = compare(client, a, b, top_k=5).json()
    expected = temperature_explains(z, permuted, top_k=5)
    assert out["explained_beyond_flat"] < 0.5 and out["discordance"]["median"] > 0
    for key in ("beta", "explained", "explained_beyond_flat", "top1_agreement"):
        assert out[key] == pytest.approx(expected[key], rel=1e-12), key
    for key in ("kl_before", "kl_after", "discordance"):
        assert out[key] == pytest.approx(expected[key], rel=1e-12), key


def test_bad_comparisons_are_problems(client):
    z, _ = logits_data(50, k=4)
    create_model(client, k=4)
    create_model(client, name="other", k=4)
    a, short = scores(client, "m", z), scores(client, "m", z[:40])
    elsewhere = scores(client, "other", z)
    assert_problem(compare(client, a, short), 422, "same number of rows", "50", "40")
    assert_problem(compare(client, a, a, top_k=5), 422, "top_k", "4 classes")
    assert_problem(compare(client, a, a, top_k=1), 422)
    assert_problem(compare(client, a, elsewhere), 404, "no dataset")
    assert_problem(compare(client, a, 10**6), 404)
    r = client.post("/v1/models/m/compare", content=b"a=1", headers={"Content-Type": "text/plain"})
    assert_problem(r, 415)
