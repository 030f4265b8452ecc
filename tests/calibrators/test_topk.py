"""Temperature scaling on top-k log-probabilities (calibrators.topk): the stated tail
models against an explicit full-vocabulary oracle, properties, ONNX parity and the
committed SmolLM2-135M fixture (tests/data/lm/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator
from scipy.optimize import minimize_scalar

from calibrators import topk
from calibrators.methods.temperature import TemperatureScaler
from calibrators.validation import CalibrationInputError, NotFittedError
from tests.calibrators.helpers import assert_order_kept, onnx_session
from tests.oracles import softmax
from tests.strategies import logits_and_labels

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "lm" / "smollm2_top20.npz"


def fixture() -> tuple[topk.TopK, np.ndarray, np.ndarray]:
    """The committed fixture: (top-k rows, labels, sequence ids)."""
    with np.load(FIXTURE) as npz:
        rows, labels = topk.from_arrays(npz)
        return rows, labels, npz["sequence_ids"]


def truncated(z: np.ndarray, k: int) -> tuple[topk.TopK, np.ndarray]:
    """The top-k of each row of logits ``z`` as the format holds them, and the rows'
    log-probabilities (N, V)."""
    lp = np.log(softmax(z))
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return topk.as_topk(ids, np.take_along_axis(lp, ids, axis=1), z.shape[1]), lp


def completed_uniform(rows: topk.TopK) -> tuple[np.ndarray, np.ndarray]:
    """The oracle of the uniform tail: each row as V log-probabilities (N, V), every
    token outside the top-k at log(T / (V - k)), and the column of each id."""
    n, v = rows.logprobs.shape[0], rows.vocab_size
    full = np.repeat(np.log(rows.tail_mass() / (v - rows.k))[:, None], v, axis=1)
    np.put_along_axis(full, rows.ids, rows.logprobs, axis=1)
    return full, np.arange(n)


def oracle_nll(full: np.ndarray, labels: np.ndarray, beta: float) -> float:
    p = softmax(beta * full)
    return float(-np.mean(np.log(p[np.arange(len(labels)), labels])))


def synthetic(n=400, v=30, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Logits (N, V) and labels drawn from softmax(0.6 z): a model to calibrate."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, v)) * 3.0
    p = softmax(0.6 * z)
    labels = (p.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    return z, labels


@pytest.mark.parametrize("tail", topk.TAILS)
@given(data=logits_and_labels(min_rows=2, min_classes=2, max_magnitude=30.0))
def test_with_k_equal_to_v_it_is_plain_temperature(tail, data):
    z, y = data
    # A finite optimum: some label clearly below its row's top (else the NLL falls for
    # ever, or over a range of beta no gradient test can resolve, and each fit stops
    # where its own test does).
    assume((z.max(axis=1) - z[np.arange(len(y)), y] > 1e-3).any())
    rows, _ = truncated(z, z.shape[1])
    cal = topk.TopKTemperature(tail=tail).fit(rows, y)
    plain = TemperatureScaler().fit(z, y)
    assume(plain.fit_info_["reason"] == "converged")
    # The same optimum: beta itself only as well as the NLL's curvature pins it down.
    assert cal.beta_ == pytest.approx(plain.beta_, rel=1e-5)
    assert topk.mean_nll(rows, y, cal.beta_, tail) == pytest.approx(
        topk.mean_nll(rows, y, plain.beta_, tail), rel=1e-12, abs=1e-14)
    probs, tail_mass = cal.predict(rows)
    np.testing.assert_allclose(probs, np.take_along_axis(softmax(cal.beta_ * z), rows.ids, 1),
                               rtol=1e-9, atol=1e-15)
    np.testing.assert_array_equal(tail_mass, 0.0)


@pytest.mark.parametrize("tail", topk.TAILS)
@given(data=logits_and_labels(min_rows=2, min_classes=3, max_classes=40, max_magnitude=30.0),
       k=st.integers(1, 39), shuffle=st.booleans())
def test_calibrated_top_k_and_tail_sum_to_one_in_the_input_order(tail, data, k, shuffle):
    z, y = data
    # Distinct scores at least 1/64 apart: a difference below float64's resolution of
    # beta * z is lost by any softmax (temperature scaling's included).
    z = np.round(z * 64) / 64
    rows, _ = truncated(z, min(k, z.shape[1] - 1))
    if shuffle:  # any order in: the same order out
        order = np.random.default_rng(k).permuted(np.tile(np.arange(rows.k), (len(y), 1)), axis=1)
        rows = topk.as_topk(np.take_along_axis(rows.ids, order, 1),
                            np.take_along_axis(rows.logprobs, order, 1), rows.vocab_size)
    cal = topk.TopKTemperature(tail=tail).fit(rows, y)
    probs, tail_mass = cal.predict(rows)
    np.testing.assert_allclose(probs.sum(axis=1) + tail_mass, 1.0, atol=1e-12)
    assert (tail_mass >= 0).all() and (probs >= 0).all()
    assert_order_kept(rows.logprobs, probs)


@pytest.mark.parametrize("k", [1, 5, 29])
def test_the_uniform_tail_fit_is_the_full_vocabulary_optimum_of_its_completion(k):
    z, y = synthetic()
    rows, _ = truncated(z, k)
    cal = topk.TopKTemperature(tail="uniform").fit(rows, y)
    full, _ = completed_uniform(rows)
    best = minimize_scalar(lambda t: oracle_nll(full, y, np.exp(t)), bounds=(-5, 5),
                           method="bounded", options={"xatol": 1e-10})
    assert cal.beta_ == pytest.approx(np.exp(best.x), rel=1e-6)
    # the fit's NLL is the completion's, labels in the tail scored as tail tokens
    assert cal.fit_info_["nll"] == pytest.approx(oracle_nll(full, y, cal.beta_), rel=1e-10)
    probs, tail_mass = cal.predict(rows)
    completed = softmax(cal.beta_ * full)
    np.testing.assert_allclose(probs, np.take_along_axis(completed, rows.ids, 1), atol=1e-12)
    np.testing.assert_allclose(tail_mass, 1 - np.take_along_axis(completed, rows.ids, 1).sum(1),
                               atol=1e-12)


@pytest.mark.parametrize("tail", topk.TAILS)
def test_the_nll_is_convex_in_beta_and_the_fit_its_minimum(tail):
    rows, labels, _ = fixture()
    cal = topk.TopKTemperature(tail=tail).fit(rows, labels)
    betas = cal.beta_ * np.linspace(0.25, 4, 61)
    nll = [topk.mean_nll(rows, labels, b, tail) for b in betas]
    assert (np.diff(nll, 2) >= -1e-12).all()
    assert cal.fit_info_["nll"] <= min(nll) + 1e-12
    assert cal.fit_info_["reason"] == "converged"


def test_the_fixture_is_the_format_with_labels_and_sequences():
    rows, labels, sequences = fixture()
    assert rows.k == 20 and rows.vocab_size == 49_152
    assert len(np.unique(sequences)) >= 10
    assert 0.5 < (rows.label_in_top_k(labels) >= 0).mean() < 1  # labels on both sides
    assert (np.diff(rows.logprobs, axis=1) <= 0).all()  # as the model gives them: sorted


@pytest.mark.parametrize("tail", topk.TAILS)
def test_onnx_matches_numpy_on_the_fixture(tail):
    rows, labels, _ = fixture()
    cal = topk.TopKTemperature(tail=tail).fit(rows, labels)
    x32 = rows.logprobs.astype(np.float32)
    want = cal.predict(topk.as_topk(rows.ids, x32, rows.vocab_size))
    model = cal.to_onnx()
    for runner, n in ((onnx_session(model), len(x32)), (ReferenceEvaluator(model), 200)):
        probs, tail_mass = runner.run(None, {topk.INPUT_NAME: x32[:n]})
        np.testing.assert_allclose(probs, want[0][:n], atol=1e-6)
        np.testing.assert_allclose(tail_mass, want[1][:n], atol=1e-6)


@pytest.mark.parametrize("tail", topk.TAILS)
@pytest.mark.parametrize("k", [1, 4, 6])
def test_onnx_matches_numpy_for_any_k_including_no_tail(tail, k):
    z, y = synthetic(n=60, v=6)
    rows, _ = truncated(z, k)
    cal = topk.TopKTemperature(tail=tail).fit(rows, y)
    x32 = rows.logprobs.astype(np.float32)
    probs, tail_mass = onnx_session(cal.to_onnx()).run(None, {topk.INPUT_NAME: x32})
    want = cal.predict(topk.as_topk(rows.ids, x32, 6))
    np.testing.assert_allclose(probs, want[0], atol=1e-6)
    np.testing.assert_allclose(tail_mass, want[1], atol=1e-6)


def test_params_round_trip():
    rows, labels, _ = fixture()
    cal = topk.TopKTemperature(tail="decay").fit(rows, labels)
    again = topk.TopKTemperature.from_params(cal.to_params())
    np.testing.assert_array_equal(again.predict(rows)[0], cal.predict(rows)[0])


@pytest.mark.parametrize(
    ("ids", "logprobs", "v", "match"),
    [
        ([[0, 1]], [[-0.1, 0.5]], 5, "finite and <= 0"),
        ([[0, 1]], [[-0.1, np.nan]], 5, "finite and <= 0"),
        ([[0, 1]], [[-0.1, -0.2]], 5, "sum to at most 1"),
        ([[0, 0]], [[-1.0, -2.0]], 5, "distinct"),
        ([[0, 5]], [[-1.0, -2.0]], 5, r"\[0, 5\)"),
        ([[0.0, 1.0]], [[-1.0, -2.0]], 5, "integers"),
        ([[0, 1, 2]], [[-1.0, -2.0, -3.0]], 2, "at most the vocabulary"),
        ([[0]], [[-1.0]], 1, "vocab_size"),
        ([0, 1], [-1.0, -2.0], 5, "2-D"),
    ],
)
def test_bad_rows_are_refused_saying_what_was_expected(ids, logprobs, v, match):
    with pytest.raises(CalibrationInputError, match=match):
        topk.as_topk(np.array(ids), np.array(logprobs), v)


def test_bad_labels_options_and_unfitted_use_are_refused():
    rows = topk.as_topk([[0, 1]], [[-1.0, -2.0]], 5)
    with pytest.raises(CalibrationInputError, match=r"\[0, 5\)"):
        topk.TopKTemperature().fit(rows, [5])
    with pytest.raises(CalibrationInputError, match="tail must be one of"):
        topk.TopKTemperature(tail="zipf").fit(rows, [0])
    with pytest.raises(NotFittedError):
        topk.TopKTemperature().predict(rows)


def chat_content(rows: topk.TopK, labels: np.ndarray, names) -> list[dict]:
    """The fixture's rows in the chat-completions ``logprobs.content`` shape."""
    return [
        {"token": names[y], "logprob": None,
         "top_logprobs": [{"token": names[i], "logprob": float(v)}
                          for i, v in zip(ids, lp, strict=True)]}
        for ids, lp, y in zip(rows.ids.tolist(), rows.logprobs, labels.tolist(), strict=True)
    ]


def test_the_chat_completions_shape_fits_as_the_arrays_do():
    rows, labels, _ = fixture()
    names = [f"<{i}>" for i in range(rows.vocab_size)]
    content = chat_content(rows, labels, names)
    interned, y, seen = topk.from_chat_logprobs(content, rows.vocab_size)
    # ids are renamed by first appearance; the names map them back
    np.testing.assert_array_equal(np.array(seen)[interned.ids], np.array(names)[rows.ids])
    np.testing.assert_array_equal(np.array(seen)[y], np.array(names)[labels])
    direct = topk.TopKTemperature().fit(rows, labels)
    assert topk.TopKTemperature().fit(interned, y).beta_ == direct.beta_
    by_vocabulary, y2, _ = topk.from_chat_logprobs(content, rows.vocab_size, names)
    np.testing.assert_array_equal(by_vocabulary.ids, rows.ids)
    np.testing.assert_array_equal(y2, labels)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ([], "non-empty list"),
        ([{"token": 3, "top_logprobs": []}], "string 'token'"),
        ([{"token": "a"}], "top_logprobs"),
        ([{"token": "a", "top_logprobs": [{"token": "a", "logprob": "x"}]}], "numeric"),
        ([{"token": "a", "top_logprobs": [{"token": "a", "logprob": -1.0}]},
          {"token": "a", "top_logprobs": [{"token": "a", "logprob": -1.0},
                                          {"token": "b", "logprob": -2.0}]}], "same number"),
        ([{"token": "a", "top_logprobs": [{"token": "b", "logprob": -1.0},
                                          {"token": "b", "logprob": -2.0}]}], "distinct"),
        ([{"token": "a", "top_logprobs": [{"token": "b", "logprob": -1.0},
                                          {"token": "c", "logprob": -2.0}]}], "vocabulary size"),
    ],
)
def test_bad_chat_completions_content_is_refused(content, match):
    with pytest.raises(CalibrationInputError, match=match):
        topk.from_chat_logprobs(content, 2)


@pytest.mark.parametrize("tail", topk.TAILS)
def test_a_tail_label_scores_the_tails_own_mean_log_probability(tail):
    """For a tail label, NLL(beta) = logsumexp(w + beta s) - beta tbar and log(tail mass)
    = logsumexp over the tail - logsumexp(w + beta s): their sum's derivative at beta = 1
    is the untempered tail's mean log-probability minus tbar, 0 when tbar is that mean."""
    rows, labels, _ = fixture()
    in_tail = np.flatnonzero(rows.label_in_top_k(labels) < 0)[:50]
    part = topk.as_topk(rows.ids[in_tail], rows.logprobs[in_tail], rows.vocab_size)
    params = topk.TopKTemperature(tail=tail).fit(part, labels[in_tail]).to_params()

    def both(beta: float) -> float:
        tail_mass = topk.TopKTemperature.from_params({**params, "beta": beta}).predict(part)[1]
        return topk.mean_nll(part, labels[in_tail], beta, tail) + np.log(tail_mass).mean()

    h = 1e-4
    assert abs(both(1 + h) - both(1 - h)) / (2 * h) < 1e-6
