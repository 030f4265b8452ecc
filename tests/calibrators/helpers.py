"""Helpers shared by the calibrator tests (never import one test module from another).

* :data:`FIT_OPTIONS`: per method, options that make a fit quick and deterministic;
  one row per method of :data:`calibrators.METHODS` (a test checks that).
* :func:`onnx_outputs`: the four outputs of an ONNX model on ONNX Runtime's CPU provider.
* :func:`from_arrays`, :func:`random_calibrator`, :func:`perturbed`: fitted calibrators
  without a fit.
* :func:`assert_estimator_contract`: the scikit-learn contract every calibrator keeps,
  run on every registered method and on the extension calibrator of
  ``test_extension.py``.
"""

from __future__ import annotations

import inspect

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from sklearn.base import clone

import calibrators
from calibrators import CALIBRATORS, CalibrationInputError, NotFittedError
from calibrators.base import Calibrator
from calibrators.linear_softmax import LinearSoftmax
from calibrators.onnx_export import INPUT_NAME, OUTPUT_NAMES
from calibrators.options import Integer, Positive

#: Quick fits with non-default options (explicit penalties skip the cross-validated
#: search; the grid is deliberately unsorted, with a repeat).
FIT_OPTIONS: dict[str, dict] = {
    "temperature": {"tol": 1e-9, "max_passes": 40},
    "vector": {"reg_lambda": 1.0, "reg_mu": 1.0, "grid": [1.0, 10.0, 1.0]},
    "matrix": {"reg_lambda": 1.0, "reg_mu": 1.0, "grid": [1.0, 10.0, 1.0]},
    "dirichlet": {"reg_lambda": 1.0, "reg_mu": 1.0, "grid": [1.0, 10.0, 1.0]},
    "svs": {"reg_diagonal": 1.0, "reg_intercept": 0.5, "grid": [1.0, 4.0, 1.0]},
    "sms": {"reg_off_diagonal": 1.0, "reg_diagonal": 1.0, "reg_intercept": 0.5,
            "grid": [1.0, 4.0, 1.0]},
    "ets": {"tol": 1e-9, "max_passes": 30},
    "pts": {"n_top": 3, "reg": None, "grid": [0.1, 1.0, 0.1], "tol": 1e-8, "max_passes": 40},
    "iop": {"n_top": 3, "reg_lambda": 1.0, "grid": [10.0, 1.0, 10.0], "seed": 1, "max_iter": 200,
            "tol": 1e-9},
    "prior-shift": {"base": "vector"},
    "row-entropy": {"target_entropy": 0.5},
}


def labelled_logits(n: int = 60, k: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Informative logits (N, K) and labels (N,); defaults keep K >= 3 and N != K."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    z = rng.normal(size=(n, k)) * 2.0
    z[np.arange(n), y] += 1.5
    return z, y


def held_out_nll(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.mean(np.log(np.maximum(probs[np.arange(len(labels)), labels], 1e-300))))


def onnx_session(model: bytes | onnx.ModelProto) -> ort.InferenceSession:
    """A one-thread CPU session (deterministic reductions)."""
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def onnx_outputs(model, z32: np.ndarray) -> dict[str, np.ndarray]:
    """Outputs by name of a model (bytes, ModelProto, or anything with ``run``) on ``z32``."""
    runner = model if hasattr(model, "run") else onnx_session(model)
    return dict(zip(OUTPUT_NAMES, runner.run(list(OUTPUT_NAMES), {INPUT_NAME: z32}), strict=True))


def assert_onnx_matches_numpy(cal: Calibrator, z32: np.ndarray, atol: float = 1e-6) -> None:
    """The ONNX graph's four outputs equal the numpy path on float32 logits ``z32``."""
    out = onnx_outputs(cal.to_onnx(), z32)
    p = cal.predict_proba(z32)
    assert np.abs(out["probabilities"] - p).max() <= atol
    assert np.abs(out["confidence"] - p.max(axis=1)).max() <= atol
    entropy = -np.sum(p * np.log(np.maximum(p, 1e-300)), axis=1)
    assert np.abs(out["entropy"] - entropy).max() <= atol
    np.testing.assert_array_equal(out["label"], z32.argmax(axis=1))


def assert_order_kept(z: np.ndarray, v: np.ndarray) -> None:
    """Within each row: equal scores -> equal outputs, larger -> at least as large."""
    less = z[:, :, None] < z[:, None, :]
    equal = z[:, :, None] == z[:, None, :]
    assert np.all(v[:, :, None] <= v[:, None, :], where=less)
    assert np.all(v[:, :, None] == v[:, None, :], where=equal)
    np.testing.assert_array_equal(v.argmax(axis=1), z.argmax(axis=1))


def from_arrays(method: str, k: int, **arrays) -> Calibrator:
    """A fitted calibrator of ``method`` with the given arrays, through from_params."""
    params = {"method": method, "n_classes": k}
    for name, value in arrays.items():
        params[name] = value if value is None or np.isscalar(value) else np.asarray(value).tolist()
    return calibrators.from_params(params)


#: The methods of the ``softmax(W * phi(z) + b)`` family, from the registry.
LINEAR_METHODS: tuple[str, ...] = tuple(
    method for method, cls in CALIBRATORS.items() if issubclass(cls, LinearSoftmax)
)


def perturbed(cal: Calibrator, rng: np.random.Generator, scale: float = 0.3) -> Calibrator:
    """``cal`` with every fitted array moved at random (a positive scalar by a random
    factor): a fit may end at the identity of its extra parameters (a PTS or IOP fit
    that keeps temperature scaling), which would hide a wrong export of them."""
    params = cal.to_params()
    for name, shape in type(cal).fitted_arrays.items():
        if shape is None:
            continue
        value = np.asarray(params[name], dtype=np.float64)
        if shape == () and value > 0:  # beta, smoothing: positive by their params' rules
            params[name] = float(value * np.exp(scale * rng.normal()))
        else:
            params[name] = (value + scale * rng.normal(size=value.shape)).tolist()
    return calibrators.from_params(params)


def random_calibrator(method: str, k: int, rng: np.random.Generator) -> LinearSoftmax:
    """A calibrator of the linear family with random parameters near the identity."""
    cls = CALIBRATORS[method]
    if cls.structure == "scalar":
        weight = float(rng.uniform(0.2, 5))
    elif cls.structure == "diagonal":
        weight = 1.0 + 0.3 * rng.normal(size=k)
    else:
        weight = np.eye(k) + 0.3 * rng.normal(size=(k, k))
    bias = rng.normal(size=k) if cls.has_bias else None
    return from_arrays(method, k, weight=weight, bias=bias)


def _bad_values(check) -> list:
    """Values every option checked by ``check`` must refuse."""
    if isinstance(check, Integer):
        return [True, False, 2.5, "3", None]
    if isinstance(check, Positive):
        bad = [True, float("nan"), float("inf"), -1.0, "1"]
        if not check.allow_zero:
            bad.append(0.0)
        if not check.allow_none:
            bad.append(None)
        return bad
    return []


def assert_estimator_contract(cls: type[Calibrator], options: dict, z, y) -> None:
    """The estimator contract of one calibrator class (see the module docstring).

    ``options``: valid, non-default options of ``cls``; ``z, y``: a small
    labelled set (logits) it can be fitted on.
    """
    # __init__ stores every keyword unchanged (the same object), and nothing else.
    cal = cls(**options)
    signature = [
        p.name for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"
    ]
    assert list(cls.option_checks) == signature  # one check per option, in signature order
    assert set(vars(cal)) == set(signature)
    for name, value in options.items():
        assert getattr(cal, name) is value, name
    # get_params / set_params round trip; clone copies the options, not the fit.
    params = cal.get_params()
    assert set(params) == set(signature)
    assert cls().set_params(**params).get_params() == params
    fitted = cal.fit(z, y)
    assert fitted is cal  # fit returns self
    assert set(cal.get_params()) == set(signature) and cal.get_params() == params
    twin = clone(cal)
    assert type(twin) is cls and twin is not cal and twin.get_params() == params
    assert not hasattr(twin, "n_classes_")
    with pytest.raises(NotFittedError, match="not fitted"):
        twin.predict_proba(z)
    with pytest.raises(NotFittedError, match="not fitted"):
        twin.to_params()
    with pytest.raises(NotFittedError, match="not fitted"):
        twin.to_onnx()
    # Learned state ends in "_"; to_params stores the canonical options.
    learned = set(vars(cal)) - set(signature)
    assert learned and all(name.endswith("_") for name in learned), learned
    assert cal.to_params()["options"] == cal.checked_options()
    # Every invalid value of an integer or positive option is refused by checked_options,
    # by fit and by create, with a message that ends with "Got <value>.".
    for name, check in cls.option_checks.items():
        for bad in _bad_values(check):
            broken = clone(cal).set_params(**{name: bad})
            with pytest.raises(CalibrationInputError, match=name) as info:
                broken.checked_options()
            assert str(info.value).endswith(f"Got {bad!r}."), str(info.value)
            with pytest.raises(CalibrationInputError, match=name):
                broken.fit(z, y)
            with pytest.raises(CalibrationInputError, match=name):
                cls.with_options({**options, name: bad})
