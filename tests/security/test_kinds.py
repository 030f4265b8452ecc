"""No silent wrong answer: probabilities sent as logits, scores of the wrong dtype, labels
that are not integers, empty query values.

Probabilities calibrated as logits give answers off by up to 0.976 (issue 12): a body
that says logits (the default for .npy, the key ``logits`` in JSON, the array
``logits`` in a .npz) but whose every row is a probability distribution is a 422 that
names the fix, unless ``?kind=logits`` says they really are logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from calibrators.validation import CalibrationInputError, as_labels, as_scores
from service.api.codecs import rules
from tests.oracles import softmax
from tests.security import payloads as pl
from tests.service.helpers import assert_problem

PREDICT = "/v1/models/m/predict"
DATASETS = "/v1/models/m/datasets"
FEEDBACK = "/v1/models/m/feedback"
NPY = {"content-type": "application/x-npy"}
OCTET = {"content-type": "application/octet-stream"}
K = 4


def probabilities(n: int = 20, seed: int = 0) -> np.ndarray:
    z = np.random.default_rng(seed).normal(size=(n, K)) * 3
    return softmax(z)


def labelled_npz(name: str, scores: np.ndarray) -> bytes:
    return pl.npz({f"{name}.npy": pl.array_npy(scores),
                   "labels.npy": pl.array_npy(np.arange(len(scores)) % K)})


def test_predict_json_probabilities_under_logits(served):
    p = probabilities().tolist()
    body = assert_problem(served.post(PREDICT, json={"logits": p}), 422, "'probabilities'")
    assert "?kind=logits" in body["detail"] and body["fix"]
    assert served.post(f"{PREDICT}?kind=logits", json={"logits": p}).status_code == 200
    assert served.post(PREDICT, json={"probabilities": p}).status_code == 200
    r = served.post(f"{PREDICT}?kind=probabilities", json={"probabilities": p})
    assert r.status_code == 200, r.text
    assert_problem(served.post(f"{PREDICT}?kind=probabilities", json={"logits": p}), 422,
                   "contradicts")


def test_predict_npy_probabilities_without_kind(served):
    p = pl.array_npy(probabilities())
    assert_problem(served.post(PREDICT, content=p, headers=NPY), 422, "?kind=probabilities")
    ok = served.post(f"{PREDICT}?kind=probabilities", content=p, headers=NPY)
    assert ok.status_code == 200, ok.text
    assert served.post(f"{PREDICT}?kind=logits", content=p, headers=NPY).status_code == 200
    # float32 probabilities (rows sum to 1 within float32 rounding) are caught too
    p32 = pl.array_npy(probabilities().astype(np.float32))
    assert_problem(served.post(PREDICT, content=p32, headers=NPY), 422, "probability")


def test_one_logit_row_off_the_simplex_is_enough(served):
    p = probabilities()
    p[-1] = [3.0, -1.0, 0.5, 0.2]
    assert served.post(PREDICT, content=pl.array_npy(p), headers=NPY).status_code == 200


@pytest.mark.parametrize("url", [DATASETS, FEEDBACK])
def test_labelled_probabilities_under_logits(served, url):
    p = probabilities(300)
    y = (np.arange(300) % K).tolist()
    assert_problem(served.post(url, json={"logits": p.tolist(), "labels": y}), 422,
                   "'probabilities'")
    assert_problem(served.post(url, content=labelled_npz("logits", p), headers=OCTET), 422,
                   "Name the array 'probabilities'")
    for body in ({"json": {"probabilities": p.tolist(), "labels": y}},
                 {"content": labelled_npz("predictions", p), "headers": OCTET},
                 {"content": labelled_npz("logits", p), "headers": OCTET,
                  "params": {"kind": "logits"}}):
        r = served.post(url, **body)
        assert r.status_code in (200, 201), r.text
    r = served.post(url, content=labelled_npz("logits", p), headers=OCTET,
                    params={"kind": "probabilities"})
    assert_problem(r, 422, "contradicts")


# -- dtypes: the core's rule, so the library and the service agree ----------------------

REFUSED_SCORES = [
    np.zeros((2, K), bool),
    np.zeros((2, K), "m8[s]"),
    np.zeros((2, K), "M8[s]"),
    np.zeros((2, K), complex),
    np.full((2, K), 2**53 + 1, np.uint64),
    np.full((2, K), -(2**60), np.int64),
    np.array([["1", "2", "3", "4"]] * 2),
]


@pytest.mark.parametrize("arr", REFUSED_SCORES, ids=lambda a: str(a.dtype))
def test_library_refuses_scores_dtype(arr):
    with pytest.raises(CalibrationInputError):
        as_scores(arr)


@pytest.mark.parametrize("arr", [np.full((2, K), 2**53, np.uint64), np.ones((2, K), np.int8),
                                 np.ones((2, K), np.float16), np.ones((2, K), ">f4")],
                         ids=lambda a: str(a.dtype))
def test_library_accepts_real_scores(arr):
    assert as_scores(arr).dtype in (np.float32, np.float64)


@pytest.mark.parametrize("labels,ok", [
    (np.array([0, 3]), True), (np.array([0.0, 3.0]), True), (np.array([0, 3], np.uint64), True),
    (np.array([0.0, 3.5]), False), (np.array([0.0, np.nan]), False),
    (np.array([False, True]), False), (np.array([0, 3], "m8[s]"), False),
    (np.array([0, 3], complex), False), (np.array([0, 2**63], np.uint64), False),
])
def test_library_labels(labels, ok):
    if ok:
        assert as_labels(labels, 2, K).tolist() == [0, 3]
    else:
        with pytest.raises(CalibrationInputError):
            as_labels(labels, 2, K)


@pytest.mark.parametrize("descr", ["|b1", "<m8[s]", "<M8[s]", "<c16", "<f16", "|O"])
def test_service_refuses_the_same_dtypes_from_the_header(served, descr):
    assert_problem(served.post(PREDICT, content=pl.npy((2, K), descr), headers=NPY), 422, "dtype")


def test_uint64_beyond_float64_refused(served):
    big = pl.array_npy(np.full((2, K), 2**60, np.uint64))
    assert_problem(served.post(PREDICT, content=big, headers=NPY), 422, "2**53")
    ok = pl.array_npy(np.array([[1, 2, 3, 40]] * 2, np.uint64))
    assert served.post(PREDICT, content=ok, headers=NPY).status_code == 200


def test_every_row_a_distribution_is_chunked(monkeypatch):
    from calibrators import numerics

    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 8)  # 2 rows per chunk
    p = probabilities(9)
    assert rules.every_row_a_distribution(p)
    p[7] = [0.5, 0.5, 0.5, -0.5]
    assert not rules.every_row_a_distribution(p)


# -- empty query values -------------------------------------------------------------------

EMPTY_QUERIES = [
    ("post", PREDICT, "alias="), ("post", PREDICT, "version="), ("post", PREDICT, "kind="),
    ("post", DATASETS, "kind="), ("post", FEEDBACK, "version="), ("post", FEEDBACK, "kind="),
    ("get", "/v1/models/m/monitoring", "window="), ("get", "/v1/models/m/monitoring", "version="),
    ("get", "/v1/models/m/monitoring/reliability.svg", "window="),
]


@pytest.mark.parametrize("method,url,query", EMPTY_QUERIES, ids=lambda x: str(x))
def test_empty_query_values_are_422(served, method, url, query):
    kwargs = {"json": {"logits": [[1, 0, 0, 2]], "labels": [0]}} if method == "post" else {}
    if url == PREDICT:
        kwargs = {"json": {"logits": [[1, 0, 0, 2]]}}
    r = getattr(served, method)(f"{url}?{query}", **kwargs)
    assert_problem(r, 422)


def test_assume_finite_skips_only_the_finiteness_of_logits():
    """``as_scores(..., assume_finite=True)`` is for callers that know their values are
    finite (JSON): logits are not scanned, probabilities still are (signs and sums)."""
    nan = np.array([[0.5, np.nan]])
    with pytest.raises(CalibrationInputError, match="finite"):
        as_scores(nan, "logits")
    assert np.isnan(as_scores(nan, "logits", assume_finite=True)[0, 1])
    with pytest.raises(CalibrationInputError, match="non-negative"):
        as_scores(np.array([[1.5, -0.5]]), "probabilities", assume_finite=True)
