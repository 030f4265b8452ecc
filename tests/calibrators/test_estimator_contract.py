"""Every registered method keeps the scikit-learn estimator contract and one option
vocabulary: rows parametrised from ``calibrators.METHODS``, never a copied list."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calibrators
from calibrators import CALIBRATORS, METHODS, CalibrationInputError
from calibrators.base import Calibrator
from calibrators.options import Integer
from tests.calibrators.helpers import FIT_OPTIONS, assert_estimator_contract, labelled_logits
from tests.strategies import JSON_VALUES, calibrator_params


def test_every_method_has_one_row_of_test_options():
    assert set(FIT_OPTIONS) == set(METHODS)


def test_the_registry_is_built_from_the_classes():
    assert METHODS == tuple(CALIBRATORS)
    for method, cls in CALIBRATORS.items():
        assert issubclass(cls, Calibrator) and cls.method == method


@pytest.mark.parametrize("method", METHODS)
def test_estimator_contract(method):
    z, y = labelled_logits(n=60, k=4)
    assert_estimator_contract(CALIBRATORS[method], FIT_OPTIONS[method], z, y)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=20)
@given(data=st.data())
def test_any_valid_params_round_trip_and_predict_distributions(method, data):
    params = data.draw(calibrator_params(CALIBRATORS[method]))
    cal = calibrators.from_params(params)
    again = cal.to_params()
    assert {key: again[key] for key in params} == params
    k = params["n_classes"]
    z = np.random.default_rng(k).normal(size=(k + 2, k)) * 5  # N != K
    p = cal.predict_proba(z)
    assert p.shape == z.shape and np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    if cal.preserves_argmax:
        np.testing.assert_array_equal(p.argmax(axis=1), z.argmax(axis=1))


#: What else a Python caller may hand over where params belong.
PYTHON_VALUES = st.sampled_from(
    [(1.0, 2.0), {1.0}, b"\x00\x01", np.float32(2.0), np.zeros((2, 2)), np.array(["a"]),
     np.array([1, 2], dtype=np.int8), object(), float("nan"), float("inf"), 10**400, 1j]
)


@st.composite
def malformed_params(draw, cls):
    """Valid params of ``cls`` with one to three fields (top level, or one option) replaced
    by any JSON value or odd Python object; the fields include unknown and absent ones."""
    params = draw(calibrator_params(cls, min_classes=2, max_classes=5))
    params["options"] = cls().checked_options()
    params["fit_info"] = {"converged": True}
    keys = st.sampled_from(sorted({*params, "format", "extra"}))
    for _ in range(draw(st.integers(1, 3))):
        value = draw(JSON_VALUES | PYTHON_VALUES)
        if isinstance(params["options"], dict) and params["options"] and draw(st.booleans()):
            name = draw(st.sampled_from(sorted(params["options"])))
            params["options"] = {**params["options"], name: value}
        else:
            params[draw(keys)] = value
    return params


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_malformed_params_raise_calibration_input_error_only(method, data):
    """from_params takes what to_params gave or raises CalibrationInputError (a 422 in
    the service), never a bare TypeError, ValueError, OverflowError..."""
    params = data.draw(malformed_params(CALIBRATORS[method]))
    try:
        cal = calibrators.from_params(params)
    except CalibrationInputError as exc:
        assert str(exc).rstrip().endswith(".")
        return
    again = cal.to_params()
    assert calibrators.from_params(again).to_params() == again


@pytest.mark.parametrize(
    ("fit_info", "message"),
    [
        ([1, 2], "fit_info must be an object"),
        ("ab", "fit_info must be an object"),
        (3.5, "fit_info must be an object"),
        (False, "fit_info must be an object"),
        ([["converged", True]], "fit_info must be an object"),  # dict() would take it
        ({1: "a"}, "string keys"),
    ],
)
def test_malformed_fit_info_is_refused(fit_info, message):
    params = {"method": "temperature", "n_classes": 3, "weight": 1.5, "fit_info": fit_info}
    with pytest.raises(CalibrationInputError, match=message) as info:
        calibrators.from_params(params)
    assert str(info.value).endswith(f"Got {fit_info!r}.")


@pytest.mark.parametrize("fit_info", [None, {}, {"nll": 0.5, "passes": [1, 2]}])
def test_fit_info_may_be_absent_null_or_an_object(fit_info):
    params = {"method": "temperature", "n_classes": 3, "weight": 1.5}
    if fit_info is not None:
        params["fit_info"] = fit_info
    assert calibrators.from_params(params).fit_info_ == (fit_info or {})


@pytest.mark.parametrize(
    "weight",
    [["1.5", "2", "1"], [True, False, True], [None, 1, 1], [10**400, 1, 1], 10**400,
     [[1, 2], [3]], [1, 1j, 1], "abc", {"a": 1}],
)
def test_fitted_arrays_must_be_real_numbers(weight):
    """numpy would read strings and booleans as numbers; ragged lists and integers beyond
    float64 not at all (ValueError, OverflowError): all are the same refusal."""
    params = {"method": "vector", "n_classes": 3, "weight": weight, "bias": [0.0, 0.0, 0.0]}
    with pytest.raises(CalibrationInputError, match="params weight for vector must be numbers"):
        calibrators.from_params(params)


@pytest.mark.parametrize("method", METHODS)
def test_create_names_the_method_and_lists_its_options_for_an_unknown_one(method):
    valid = ", ".join(CALIBRATORS[method].option_checks)
    with pytest.raises(CalibrationInputError) as info:
        calibrators.create(method, **{"lambda": 1.0})
    assert str(info.value) == (
        f"options of {method} must be among {valid}. Got unknown 'lambda'."
    )
    with pytest.raises(CalibrationInputError, match=f"options of {method} must be among"):
        calibrators.check_options(method, {"lambda": 1.0, 3: "x"})


@pytest.mark.parametrize("method", METHODS)
def test_check_options_gives_what_to_params_stores(method):
    z, y = labelled_logits(n=60, k=4)
    options = FIT_OPTIONS[method]
    canonical = calibrators.check_options(method, options)
    assert list(canonical) == list(CALIBRATORS[method].option_checks)  # defaults included
    cal = calibrators.create(method, **options).fit(z, y)
    assert cal.to_params()["options"] == canonical
    assert json.loads(json.dumps(canonical, allow_nan=False)) == canonical
    again = calibrators.from_params(json.loads(json.dumps(cal.to_params())))
    assert again.checked_options() == canonical


@pytest.mark.parametrize("bad", [None, [("tol", 1.0)], "tol=1"])
def test_check_options_wants_a_mapping(bad):
    with pytest.raises(CalibrationInputError, match="must be a mapping") as info:
        calibrators.check_options(METHODS[0], bad)
    assert str(info.value).endswith(f"Got {bad!r}.")


def test_unknown_method_is_refused_everywhere():
    for call in (
        lambda: calibrators.create("platt"),
        lambda: calibrators.check_options("platt", {}),
        lambda: calibrators.from_params({"method": "platt", "n_classes": 3}),
    ):
        with pytest.raises(CalibrationInputError, match="method must be one of") as info:
            call()
        assert str(info.value).endswith("Got 'platt'.")


def test_an_option_shared_by_methods_is_checked_the_same_way():
    """The same bad value of the same option name gets the same message in every method."""
    bad_values = (True, -1, 0, float("nan"), "1", None, 2.5)
    by_name: dict[str, list[str]] = {}
    for cls in CALIBRATORS.values():
        for name, check in cls.option_checks.items():
            by_name.setdefault(name, []).append(repr(check))
    shared = {name: checks for name, checks in by_name.items() if len(checks) > 1}
    assert "tol" in shared  # temperature and the ODIR scalers share at least this one
    for name in shared:
        messages = set()
        for value in bad_values:
            per_method = set()
            for method, cls in CALIBRATORS.items():
                if name not in cls.option_checks:
                    continue
                try:
                    calibrators.check_options(method, {name: value})
                    per_method.add("accepted")
                except CalibrationInputError as exc:
                    per_method.add(str(exc))
            assert len(per_method) == 1, (name, value, per_method)
            messages |= per_method
        assert len(messages) > 1  # the bad values were not all accepted


#: (method, option) of every integer option, from the registry.
INTEGER_OPTIONS = [
    (method, name)
    for method, cls in CALIBRATORS.items()
    for name, check in cls.option_checks.items()
    if isinstance(check, Integer)
]


def test_every_integer_option_has_a_bounded_range():
    assert {name for _, name in INTEGER_OPTIONS} >= {"max_iter", "max_passes", "n_folds"}
    for method, name in INTEGER_OPTIONS:
        check = CALIBRATORS[method].option_checks[name]
        assert check.minimum is not None and check.maximum is not None, (method, name)
        assert -(2**63) <= check.minimum < check.maximum < 2**63, (method, name)


@pytest.mark.parametrize(("method", "name"), INTEGER_OPTIONS)
def test_integer_options_outside_their_range_are_refused_with_the_range(method, name):
    check = CALIBRATORS[method].option_checks[name]
    expected = f"{name} must be an integer >= {check.minimum} and <= {check.maximum}. Got "
    for bad, shown in [
        (check.maximum + 1, repr(check.maximum + 1)),
        (check.minimum - 1, repr(check.minimum - 1)),
        (10**400, "an integer of 401 digits"),
        (-(10**5000), "an integer of 5001 digits"),  # past Python's 4,300-digit repr
    ]:
        for call, options in (
            (lambda options: calibrators.create(method, **options), {name: bad}),
            (lambda options: calibrators.check_options(method, options), {name: bad}),
        ):
            with pytest.raises(CalibrationInputError) as info:
                call(options)
            assert str(info.value) == f"{expected}{shown}."
    assert calibrators.check_options(method, {name: check.maximum})[name] == check.maximum


def test_params_with_an_integer_option_out_of_range_are_refused():
    z, y = labelled_logits(n=60, k=4)
    params = calibrators.create("vector").fit(z, y).to_params()
    params["options"]["max_iter"] = 10**400
    with pytest.raises(CalibrationInputError, match=r"^max_iter must be an integer >= 1 and <= "):
        calibrators.from_params(params)


# -- the ODIR options -----------------------------------------------------------------


@pytest.mark.parametrize("method", [m for m in METHODS if "grid" in CALIBRATORS[m].option_checks])
def test_grid_is_stored_sorted_strongest_first_without_repeats(method):
    cal = calibrators.create(method, grid=[1, 100.0, 10, 100])
    assert cal.grid == [1, 100.0, 10, 100]  # __init__ keeps it as given
    assert cal.checked_options()["grid"] == [100.0, 10.0, 1.0]


@pytest.mark.parametrize(
    ("bad", "got"),
    [
        ([], "Got []."),
        ([1.0, -1.0], "Got -1.0."),
        ([1.0, True], "Got True."),
        ([float("inf")], "Got inf."),
        ("10", "Got '10'."),
        (5.0, "Got 5.0."),
        (None, "Got None."),
    ],
)
def test_bad_grids_are_refused(bad, got):
    with pytest.raises(CalibrationInputError, match=r"^grid") as info:
        calibrators.create("matrix", grid=bad)
    assert str(info.value).endswith(got)


def test_negative_seed_is_refused_only_when_the_penalties_are_searched():
    with pytest.raises(CalibrationInputError, match="seed must be an integer >= 0 when"):
        calibrators.create("dirichlet", seed=-1)
    with pytest.raises(CalibrationInputError, match="seed must be an integer >= 0 when"):
        calibrators.create("vector", reg_lambda=1.0, seed=-1)  # vector searches mu
    # explicit penalties: the seed is unused, and such params were stored before
    calibrators.create("matrix", reg_lambda=1.0, reg_mu=0.0, seed=-1)


def test_zero_penalties_are_allowed_and_negative_ones_are_not():
    calibrators.create("matrix", reg_lambda=0, reg_mu=0.0)
    with pytest.raises(CalibrationInputError) as info:
        calibrators.create("matrix", reg_lambda=-1.0)
    assert str(info.value) == "reg_lambda must be None or a finite number >= 0. Got -1.0."
