"""Structured vector and matrix scaling (``svs``, ``sms``): the preprocessing of the
paper, the exact optimum, the penalty search, ONNX parity, the params round trip,
bad input, and held-out NLL on the shared CIFAR outputs against our vector and
matrix scaling. Synthetic sets keep K >= 3 and N != K."""

from __future__ import annotations

import gc
import json
import tracemalloc

import numpy as np
import pytest
from scipy.optimize import minimize
from sklearn.base import clone

import calibrators
from calibrators import CalibrationInputError, numerics
from calibrators.methods import _structured as structured
from calibrators.methods._structured import structured_features
from calibrators.numerics import log_softmax, softmax
from tests.calibrators.helpers import labelled_logits, onnx_outputs
from tests.helpers import load_shared

METHODS = ("svs", "sms")
FIXED = {"reg_off_diagonal": 0.5, "reg_diagonal": 2.0, "reg_intercept": 1.0}


def confused_logits(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Over-confident logits (N, K) whose classes 0 and 1 are confused one way."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    z = 3.0 * rng.normal(size=(n, k))
    seen = np.where((y == 1) & (rng.uniform(size=n) < 0.4), 0, y)
    z[np.arange(n), seen] += 5.0
    return z, y


def fitted(method: str, n=240, k=5, seed=0, **options):
    z, y = confused_logits(n, k, seed)
    return calibrators.create(method, **options).fit(z, y), z, y


# -- the preprocessing ----------------------------------------------------------
def test_features_are_the_papers_uniform_mixture_of_the_tempered_probabilities():
    """exp(x) = (1 - eps) softmax(beta z) + eps / K with eps = 1 / (N + 1) when c = 1 / (N K)."""
    rng = np.random.default_rng(1)
    n_fit, k = 500, 7
    z = rng.normal(size=(30, k)) * 20
    z[0, 0] = 1e4  # extreme logits: every feature stays finite and above log(eps / K)
    eps = 1.0 / (n_fit + 1)
    x = structured_features(z, 0.7, 1.0 / (n_fit * k))
    want = (1 - eps) * softmax(0.7 * z) + eps / k
    np.testing.assert_allclose(np.exp(x), want, rtol=1e-12)
    assert np.isfinite(x).all() and x.min() >= np.log(eps / k) - 1e-12


@pytest.mark.parametrize("method", METHODS)
def test_fit_sets_the_preprocessing_from_temperature_scaling_and_n(method):
    cal, z, y = fitted(method, **FIXED)
    n, k = z.shape
    beta = calibrators.create("temperature").fit(z, y).beta_
    assert cal.beta_ == beta
    assert cal.smoothing_ == 1.0 / (n * k)
    assert cal.fit_info_["temperature"] == 1.0 / beta


# -- the exact optimum --------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_fit_reaches_the_optimum_of_the_papers_objective(method):
    """An independent oracle: scipy's L-BFGS-B on the objective written out here."""
    cal, z, y = fitted(method, n=300, k=4, seed=2, **FIXED, tol=1e-12)
    n, k = z.shape
    x = structured_features(z, cal.beta_, cal.smoothing_)
    full = method == "sms"
    c_off, c_diag, c_bias = 0.5 * k * (k - 1) / n, 2.0 * k / n, 1.0 * k / n
    info = cal.fit_info_["penalties"]
    assert info["diagonal"] == pytest.approx(c_diag) and info["intercept"] == pytest.approx(c_bias)
    assert info["off_diagonal"] == (pytest.approx(c_off) if full else None)

    def objective(theta):
        w = theta[: k * k].reshape(k, k) if full else theta[:k]
        b = theta[-k:]
        u = (x @ w.T if full else x * w) + b
        nll = -log_softmax(u)[np.arange(n), y].mean()
        d = (np.diag(w) if full else w) - 1.0
        off = (w * ~np.eye(k, dtype=bool)) if full else np.zeros(1)
        return nll + c_off * np.sum(off**2) + c_diag * d @ d + c_bias * b @ b

    start = np.concatenate([np.eye(k).ravel() if full else np.ones(k), np.zeros(k)])
    oracle = minimize(objective, start, method="L-BFGS-B",
                      options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 20000, "maxfun": 100000})
    ours = np.concatenate([cal.weight_.ravel(), cal.bias_])
    assert objective(ours) <= oracle.fun + 1e-10
    np.testing.assert_allclose(ours, oracle.x, atol=2e-4)
    assert cal.fit_info_["converged"]


@pytest.mark.parametrize("method", METHODS)
def test_strong_penalties_give_temperature_scaling_of_the_smoothed_probabilities(method):
    cal, z, _ = fitted(method, reg_off_diagonal=1e9, reg_diagonal=1e9, reg_intercept=1e9)
    k = z.shape[1]
    eye = np.eye(k) if method == "sms" else np.ones(k)
    np.testing.assert_allclose(cal.weight_, eye, atol=1e-6)
    np.testing.assert_allclose(cal.bias_, 0.0, atol=1e-6)
    want = softmax(structured_features(z, cal.beta_, cal.smoothing_))
    np.testing.assert_allclose(cal.predict_proba(z), want, atol=1e-5)


# -- the penalty search ---------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_search_walks_the_grid_strongest_first_and_is_deterministic(method):
    """The path starts at infinite penalties (None: the identity, temperature scaling
    of the smoothed probabilities), then the grid, strongest first."""
    a, z, y = fitted(method, n=400, k=4, seed=3, grid=[0.01, 1.0, 0.1, 10.0, 1.0])
    b = calibrators.create(method, grid=[0.01, 1.0, 0.1, 10.0, 1.0]).fit(z, y)
    cv = a.fit_info_["cross_validation"]
    tried = [c["multiplier"] for c in cv["candidates"]]
    assert tried == [None, 10.0, 1.0, 0.1, 0.01][: len(tried)] and len(tried) >= 3
    scores = [c["cv_nll"] for c in cv["candidates"]]
    best = tried[int(np.argmin(scores))]
    assert set(a.fit_info_["multipliers"].values()) == {best}  # one multiplier for all parts
    assert cv["n_folds"] == 4
    np.testing.assert_array_equal(a.weight_, b.weight_)
    np.testing.assert_array_equal(a.bias_, b.bias_)


def test_given_multipliers_are_kept_and_only_the_others_are_searched():
    cal, _, _ = fitted("sms", n=300, k=4, reg_off_diagonal=0.3, grid=[4.0, 1.0])
    got = cal.fit_info_["multipliers"]
    assert got["reg_off_diagonal"] == 0.3
    assert got["reg_diagonal"] == got["reg_intercept"] in (4.0, 1.0)
    fixed, _, _ = fitted("sms", n=300, k=4, **FIXED)
    assert fixed.fit_info_["cross_validation"] is None
    assert fixed.fit_info_["multipliers"] == FIXED
    svs, _, _ = fitted("svs", n=300, k=4, **FIXED)
    assert set(svs.fit_info_["multipliers"]) == {"reg_diagonal", "reg_intercept"}


def test_a_search_on_a_tiny_set_asks_for_explicit_penalties():
    z, y = labelled_logits(n=7, k=3)
    with pytest.raises(CalibrationInputError, match="at least 8 rows") as info:
        calibrators.create("sms").fit(z, y)
    assert "reg_off_diagonal, reg_diagonal, reg_intercept explicitly" in str(info.value)
    assert str(info.value).endswith("Got 7 rows.")
    calibrators.create("sms", **FIXED).fit(z, y)  # explicit penalties: any N


# -- the map: invariances, ONNX, params --------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_per_row_shifts_and_probabilities_give_the_same_output(method):
    cal, z, _ = fitted(method, **FIXED)
    test = np.random.default_rng(4).normal(size=(13, z.shape[1])) * 6  # N != K
    p = cal.predict_proba(test)
    np.testing.assert_allclose(cal.predict_proba(test + 50.0 * np.arange(13)[:, None]), p,
                               atol=1e-12)
    q = cal.predict_proba(np.exp(log_softmax(test)), kind="probabilities")
    np.testing.assert_allclose(q, p, atol=1e-10)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [3, 9])
def test_onnx_matches_numpy(method, k):
    cal, _, _ = fitted(method, n=150, k=k, seed=k, **FIXED)
    rng = np.random.default_rng(k)
    z32 = (rng.normal(size=(37, k)) * 8).astype(np.float32)
    z32[0, :] = 0.0  # a tied row
    z32[2, 1] = 80.0
    z32[1, 0] = -200.0  # exp underflows in float32: a zero probability
    probs32 = np.exp(log_softmax(z32.astype(np.float64))).astype(np.float32)
    assert probs32[1, 0] == 0.0
    with np.errstate(divide="ignore"):
        logs32 = np.log(probs32)  # -inf where the probability is 0: ONNX's floor, as numpy's
    model = cal.to_onnx()
    for scores, fed, kind in ((z32, z32, "logits"), (probs32, logs32, "probabilities")):
        check_outputs(onnx_outputs(model, fed), cal.predict_proba(scores, kind=kind))


def check_outputs(out: dict, want: np.ndarray) -> None:
    """The four outputs of an ONNX model against numpy's probabilities, within 1e-6."""
    np.testing.assert_allclose(out["probabilities"], want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["confidence"], want.max(axis=1), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out["label"], want.argmax(axis=1))
    entropy = -(want * np.log(np.maximum(want, 1e-300))).sum(axis=1)
    np.testing.assert_allclose(out["entropy"], entropy, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_params_round_trip_through_json_and_clone(method):
    cal, z, y = fitted(method, **FIXED)
    params = json.loads(json.dumps(cal.to_params(), allow_nan=False))
    assert set(params) == {"format", "method", "n_classes", "kind", "options", "beta", "smoothing",
                           "weight", "bias", "fit_info"}
    again = calibrators.from_params(params)
    assert type(again) is type(cal)
    np.testing.assert_array_equal(again.predict_proba(z), cal.predict_proba(z))
    assert again.to_onnx() == cal.to_onnx()
    twin = clone(cal)
    assert twin.get_params() == cal.get_params() and not hasattr(twin, "weight_")
    np.testing.assert_array_equal(twin.fit(z, y).weight_, cal.weight_)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"smoothing": 0.0}, "smoothing must be > 0. Got 0.0."),
        ({"smoothing": -1e-3}, "smoothing must be > 0. Got -0.001."),
        ({"beta": -1.0}, "beta must be > 0. Got -1.0."),
        ({"beta": None}, "beta for"),
        ({"bias": [0.0, 1.0]}, "bias for"),
        ({"weight": "x"}, "must be numbers"),
    ],
)
def test_bad_params_are_refused(method, change, message):
    cal, _, _ = fitted(method, **FIXED)
    params = {**cal.to_params(), **change}
    with pytest.raises(CalibrationInputError, match="params") as info:
        calibrators.from_params(params)
    assert message in str(info.value)


@pytest.mark.parametrize("method", METHODS)
def test_bad_input_is_refused(method):
    z, y = labelled_logits(n=40, k=4)
    cal = calibrators.create(method, **FIXED)
    bad_z = z.copy()
    bad_z[3, 1] = np.nan
    for scores, labels in ((bad_z, y), (z, y[:-1]), (z, np.where(y == 0, 4, y)), (z[:, :1], y)):
        with pytest.raises(CalibrationInputError):
            clone(cal).fit(scores, labels)
    for options in ({"reg_diagonal": -1.0}, {"n_folds": 1}, {"grid": []}, {"tol": 0.0}):
        with pytest.raises(CalibrationInputError):
            calibrators.create(method, **options)
    cal.fit(z, y)
    with pytest.raises(CalibrationInputError):
        cal.predict_proba(z[:, :3])  # K differs from the fit


# -- the cost model ----------------------------------------------------------------
def _measured_peak(method: str, options: dict, n: int, k: int) -> int:
    z, y = confused_logits(n, k, seed=k)
    z = z.astype(np.float32)
    gc.collect()
    tracemalloc.start()
    try:
        calibrators.create(method, **options).fit(z, y)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("method", "options", "small", "large"),
    [("svs", {"grid": [4.0, 1.0]}, (8_000, 100), (16_000, 100)),
     ("sms", FIXED, (4_000, 100), (4_000, 200))],
)
def test_the_cost_model_bounds_and_follows_the_measured_peaks(method, options, small, large):
    """As tests/calibrators/test_cost.py checks every other model: an upper bound within
    4x of the tracemalloc peak at two sizes, whose ratio follows the measured one."""
    measured = [_measured_peak(method, options, *size) for size in (small, large)]
    estimated = [calibrators.estimate_cost(method, *size, options).bytes
                 for size in (small, large)]
    for got, bound in zip(measured, estimated, strict=True):
        assert got <= bound <= 4 * got, (got, bound)
    ratio = (estimated[1] / estimated[0]) / (measured[1] / measured[0])
    assert 0.5 <= ratio <= 2.0, (measured, estimated)


# -- held-out NLL on the shared CIFAR outputs ----------------------------------------------
#: Tolerance of "close to or below": two standard errors of the mean per-row NLL
#: difference on the same 5,000 held-out rows. A smaller gap is within the noise of
#: the evaluation set, not evidence that the method is worse.
STANDARD_ERRORS = 2.0


def _held_out(method: str, stem: str) -> np.ndarray:
    data = load_shared(stem)
    cal = calibrators.create(method).fit(*data.fit, kind="probabilities")
    probs, labels = data.test
    p = cal.predict_proba(probs, kind="probabilities")
    return -np.log(np.maximum(p[np.arange(len(labels)), labels], 1e-300))


def _close_to_or_below(ours: np.ndarray, baseline: np.ndarray) -> None:
    diff = ours - baseline
    tolerance = STANDARD_ERRORS * diff.std(ddof=1) / np.sqrt(len(diff))
    assert diff.mean() <= tolerance, (ours.mean(), baseline.mean(), tolerance)


@pytest.mark.parametrize("stem", ["lenet-5-cifar-10", "wideresnet-16-4-cifar-100"])
def test_svs_is_close_to_or_below_vector_scaling_on_shared_data(stem):
    _close_to_or_below(_held_out("svs", stem), _held_out("vector", stem))


def test_sms_is_close_to_or_below_matrix_scaling_on_lenet():
    _close_to_or_below(_held_out("sms", "lenet-5-cifar-10"),
                       _held_out("matrix", "lenet-5-cifar-10"))


@pytest.mark.slow  # our matrix scaling's penalty search at K = 100 takes several seconds
def test_sms_is_close_to_or_below_matrix_scaling_on_cifar_100():
    stem = "wideresnet-16-4-cifar-100"
    _close_to_or_below(_held_out("sms", stem), _held_out("matrix", stem))


# -- language-model vocabularies: SVS on chunked features ---------------------------------
@pytest.mark.parametrize("options", [dict(FIXED, tol=1e-12), {"grid": [4.0, 1.0, 0.25, 1 / 16]}],
                         ids=["fixed", "searched"])
def test_chunked_svs_fit_equals_the_held_one(options, monkeypatch):
    z, y = confused_logits(600, 7, seed=5)
    held = calibrators.create("svs", **options).fit(z, y)
    monkeypatch.setattr(structured, "HELD_ELEMENTS", 0)
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 64)  # 9 rows a chunk: 67 chunks
    chunked = calibrators.create("svs", **options).fit(z, y)
    assert (held.fit_info_["features"], chunked.fit_info_["features"]) == ("held", "chunked")
    # The search runs in float32, whose sums round differently in chunks: its CV NLL
    # agree to float32 rounding, the final float64 fits to 1e-10 from nearby starts.
    cv = [held.fit_info_["cross_validation"], chunked.fit_info_["cross_validation"]]
    if cv[0] is not None:
        assert [c["multiplier"] for c in cv[0]["candidates"]] == [
            c["multiplier"] for c in cv[1]["candidates"]]
        np.testing.assert_allclose([c["cv_nll"] for c in cv[0]["candidates"]],
                                   [c["cv_nll"] for c in cv[1]["candidates"]], rtol=1e-6)
    assert held.fit_info_["multipliers"] == chunked.fit_info_["multipliers"]
    np.testing.assert_allclose(chunked.weight_, held.weight_, rtol=0, atol=1e-10)
    np.testing.assert_allclose(chunked.bias_, held.bias_, rtol=0, atol=1e-10)
    assert chunked.fit_info_["loss"] == pytest.approx(held.fit_info_["loss"], rel=1e-12)


def _svs_peak(n: int, k: int, options: dict) -> int:
    z, y = confused_logits(n, k, seed=k)
    gc.collect()
    tracemalloc.start()
    try:
        calibrators.create("svs", **options).fit(z, y)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("options", [FIXED, {"grid": [1.0, 0.25]}], ids=["fixed", "searched"])
def test_chunked_svs_memory_does_not_grow_with_the_rows(options, monkeypatch):
    """Eight times the rows: the held fit's peak grows by float64 copies of the
    extra rows, the chunked fit's by per-row vectors (labels, folds) only. On one
    thread: the chunks in work at once (one scratch pair of temperature scaling's
    passes per thread, 1 MiB) depend on how many chunks there are to overlap, a
    constant that is not growth with the rows but exceeds this test's bound."""
    monkeypatch.setattr(numerics, "n_threads", lambda: 1)
    monkeypatch.setattr(structured, "n_threads", lambda: 1)
    k, small, large = 256, 500, 4_000
    extra = 8 * (large - small) * k  # one float64 copy of the extra rows
    held = _svs_peak(large, k, options) - _svs_peak(small, k, options)
    monkeypatch.setattr(structured, "HELD_ELEMENTS", 0)
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 32 * k)  # 32 rows a chunk: 16 to 125
    grown = _svs_peak(large, k, options) - _svs_peak(small, k, options)
    assert held > extra  # what the check would see if the features were held
    assert grown < extra / 8, (grown, extra)


def test_svs_cost_at_language_model_scale_is_independent_of_the_rows():
    k = 262_144
    small, large = (calibrators.estimate_cost("svs", n, k) for n in (2_000, 200_000))
    assert small.bytes < small.input_bytes  # below the 1.95 GiB of float32 scores
    assert large.bytes - small.bytes < 8 * 16 * (200_000 - 2_000)  # per-row vectors only
    sms = calibrators.estimate_cost("sms", 2_000, k)
    assert sms.bytes > 8 * k * k  # its K**2 weights: no chunking makes that fit


@pytest.mark.parametrize("structure", ["diagonal", "full"])
def test_the_split_evaluation_equals_the_whole_problem(structure, monkeypatch):
    """The final fit's loss and gradient on parts of the rows (on threads) are the
    whole problem's, penalty included; the parts do not depend on the thread count."""
    monkeypatch.setattr(structured, "SPLIT_ELEMENTS", 100)
    z, y = confused_logits(503, 6, seed=7)
    x = structured_features(z, 0.8, 1e-4)
    options = {"off": 0.01, "diag": 0.02, "bias": 0.03}
    whole = structured.PenalisedSoftmax(x, y, structure, **options)
    split = structured._RowSplit(x, y, structure, **options)
    assert [round(w * 503) for _, w in split.parts] == [125, 126, 126, 126]
    theta = whole.initial() + np.random.default_rng(0).normal(size=whole.initial().shape) * 0.1
    (a, ga), (b, gb) = whole(theta), split(theta)
    assert b == pytest.approx(a, rel=1e-13)
    np.testing.assert_allclose(gb, ga, rtol=0, atol=1e-14)
    monkeypatch.setattr(numerics, "n_threads", lambda: 1)
    monkeypatch.setattr(structured, "n_threads", lambda: 1)
    assert split(theta)[0] == b  # the same sums, one thread


@pytest.mark.parametrize(("method", "scored"), [("svs", 4), ("sms", 2)])
def test_the_search_scores_all_folds_for_svs_and_two_for_sms(method, scored, monkeypatch):
    fits = []
    original = structured.cross_validate_path

    def spy(make_problem, feats, y, fold_of, candidates, warm, *args, **kwargs):
        fits.append((len(warm), int(fold_of.max()) + 1))
        return original(make_problem, feats, y, fold_of, candidates, warm, *args, **kwargs)

    monkeypatch.setattr(structured, "cross_validate_path", spy)
    cal, _, _ = fitted(method, n=400, k=4, grid=[1.0, 0.1])
    assert fits == [(scored, 4)]  # scored folds of 4: each fit on 3/4 of the rows
    assert cal.fit_info_["cross_validation"]["scored_folds"] == scored


@pytest.mark.parametrize("method", METHODS)
def test_the_search_hands_each_fold_its_last_evaluation(method, monkeypatch):
    """A fold's next candidate starts where its last fit ended, with the NLL there known:
    one evaluation fewer per warm-started fit, the same CV NLL and choice as a fresh
    evaluation at that point."""
    grid = [4.0, 1.0, 0.25, 1 / 16]
    handed, _, _ = fitted(method, n=400, k=4, seed=3, grid=grid)
    original = structured._Problem.retarget
    monkeypatch.setattr(structured._Problem, "retarget",
                        lambda self, keep_start, **c: original(self, False, **c))
    fresh, _, _ = fitted(method, n=400, k=4, seed=3, grid=grid)
    cv = [c.fit_info_["cross_validation"] for c in (handed, fresh)]
    tried = len(cv[0]["candidates"])
    assert tried == len(cv[1]["candidates"]) >= 2
    np.testing.assert_allclose([c["cv_nll"] for c in cv[0]["candidates"]],
                               [c["cv_nll"] for c in cv[1]["candidates"]], rtol=1e-6)
    assert handed.fit_info_["multipliers"] == fresh.fit_info_["multipliers"]
    saved = fresh.fit_info_["evaluations"] - handed.fit_info_["evaluations"]
    # the first candidate (infinite penalties) is not solved, but its NLL and gradient at
    # the centre are evaluated and handed to the second
    assert saved == (tried - 1) * cv[0]["scored_folds"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_svs_search_by_block_newton_steps_ranks_like_lbfgs(seed, monkeypatch):
    """svs's search fits each fold by two block Newton steps (``SEARCH_STEPS``), the
    last not evaluated, from where the fold's previous fit last evaluated: the CV NLL
    of every candidate within 2e-3 of an L-BFGS search's (to ``CV_TOL``), the same
    choice, and one evaluation per fold and candidate, where L-BFGS takes up to two."""
    grid = [4.0, 1.0, 0.25, 1 / 16, 1 / 64]
    searched = []
    walk = structured.cross_validate_path

    def walk_spy(*args, **kwargs):
        scores, solutions, evaluations = walk(*args, **kwargs)
        searched.append(evaluations)
        return scores, solutions, evaluations

    monkeypatch.setattr(structured, "cross_validate_path", walk_spy)
    newton, _, _ = fitted("svs", n=600, k=6, seed=seed, grid=grid)
    monkeypatch.setattr(structured, "SEARCH_STEPS", None)
    lbfgs, _, _ = fitted("svs", n=600, k=6, seed=seed, grid=grid)
    cv = [c.fit_info_["cross_validation"]["candidates"] for c in (newton, lbfgs)]
    tried = min(len(cv[0]), len(cv[1]))
    assert tried >= 3
    np.testing.assert_allclose([c["cv_nll"] for c in cv[0][:tried]],
                               [c["cv_nll"] for c in cv[1][:tried]], rtol=2e-3)
    assert newton.fit_info_["multipliers"] == lbfgs.fit_info_["multipliers"]
    # 4 folds, every finite candidate: one evaluation each (no step halved here);
    # L-BFGS two for most (some converge after one at K = 6)
    assert searched[0] == 4 * (len(cv[0]) - 1)
    assert searched[1] >= 1.5 * 4 * (len(cv[1]) - 1)


@pytest.mark.parametrize("structure", ["diagonal", "full"])
@pytest.mark.parametrize("spread", [0.1, 30.0], ids=["bounded", "shifted"])
def test_the_lean_loss_equals_the_shared_one(structure, spread):
    """structured._Problem's loss and gradient are linear.PenalisedSoftmax's, with and
    without the row-maximum shift (a spread of 30 puts the logits' bound above
    EXP_BOUND), in float64 to rounding and in float32 to float32's."""
    z, y = confused_logits(301, 5, seed=11)
    x = structured_features(z, 0.9, 1.0 / (301 * 5))
    options = {"off": 0.01, "diag": 0.02, "bias": 0.03}
    shared = structured.PenalisedSoftmax(x, y, structure, **options)
    theta = shared.initial() + spread * np.random.default_rng(1).normal(
        size=shared.initial().shape)
    w, b = shared.unpack(theta)
    bound = np.abs(b) + (np.abs(w).sum(axis=1) if structure == "full" else np.abs(w)) * (
        -x.min())
    assert (bound.max() < structured.EXP_BOUND) == (spread < 1)
    want, grad = shared(theta)
    for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        lean = structured._Problem(x.astype(dtype), y, structure, **options)
        got, got_grad = lean(theta)
        assert got == pytest.approx(want, rel=rtol)
        np.testing.assert_allclose(got_grad, grad, rtol=rtol, atol=rtol * np.abs(grad).max())


@pytest.mark.parametrize("spread", [0.1, 30.0], ids=["bounded", "shifted"])
def test_the_lean_held_out_nll_and_whitening_of_svs_equal_the_shared_ones(spread):
    """A diagonal W's per-row held-out NLL and 2 x 2 curvature blocks
    (structured._Problem, the bias folded into products with K-vectors while the
    logits are bounded) are PenalisedSoftmax's, on other rows too."""
    z, y = confused_logits(401, 5, seed=12)
    x = structured_features(z, 0.9, 1.0 / (401 * 5))
    options = {"diag": 0.02, "bias": 0.03, "block_rows": 50}
    shared = structured.PenalisedSoftmax(x[:300], y[:300], "diagonal", **options)
    theta = shared.initial() + spread * np.random.default_rng(2).normal(size=10)
    want_nll = shared.row_nll(theta, x[300:], y[300:])
    want_blocks = shared.diagonal_blocks(theta)
    for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        lean = structured._Problem(x[:300].astype(dtype), y[:300], "diagonal", **options)
        np.testing.assert_allclose(lean.row_nll(theta, x[300:].astype(dtype), y[300:]),
                                   want_nll, rtol=rtol, atol=rtol * np.abs(want_nll).max())
        np.testing.assert_allclose(lean.diagonal_blocks(theta), want_blocks, rtol=rtol,
                                   atol=rtol * np.abs(want_blocks).max())


def test_svs_blocks_at_a_retargeted_start_are_kept_not_recomputed(monkeypatch):
    """At the point where the last blocks were computed, a retargeted problem (the
    next candidate of the search) adds its own penalty to the kept data part: the
    blocks of a fresh problem with that penalty, without computing a softmax."""
    z, y = confused_logits(401, 5, seed=12)
    x = structured_features(z, 0.9, 1.0 / (401 * 5))
    first = structured._Problem(x, y, "diagonal", diag=0.5, bias=0.25, block_rows=50)
    theta = first.initial() + 0.3 * np.random.default_rng(2).normal(size=10)
    first.diagonal_blocks(theta)
    second = first.retarget(True, diag=0.02, bias=0.03)
    fresh = structured._Problem(x, y, "diagonal", diag=0.02, bias=0.03, block_rows=50)
    want = fresh.diagonal_blocks(theta)
    computed = []
    original = structured._Problem.diagonal_exp
    monkeypatch.setattr(structured._Problem, "diagonal_exp",
                        lambda self, *a: computed.append(1) or original(self, *a))
    np.testing.assert_allclose(second.diagonal_blocks(theta.copy()), want, rtol=1e-15)
    assert computed == []
    np.testing.assert_allclose(first.diagonal_blocks(theta), want + np.array(
        [[0.96, 0], [0, 0.44]]), rtol=1e-15)  # (2 x the penalties' difference)
    assert computed == []
    other = theta + 0.1
    np.testing.assert_allclose(second.diagonal_blocks(other), fresh.diagonal_blocks(other),
                               rtol=1e-15)
    assert computed  # elsewhere the blocks are computed


def test_sms_float32_first_stage_ends_at_the_float64_optimum(monkeypatch):
    cal, z, y = fitted("sms", n=300, k=4, seed=2, **FIXED, tol=1e-12)
    monkeypatch.setattr(structured, "PRESOLVE_TOL", None)
    plain = calibrators.create("sms", **FIXED, tol=1e-12).fit(z, y)
    assert cal.fit_info_["float32_iterations"] > 0
    assert plain.fit_info_["float32_iterations"] is None
    assert cal.fit_info_["loss"] == pytest.approx(plain.fit_info_["loss"], rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(cal.weight_, plain.weight_, atol=1e-4)
