"""Every number of the four calibrators is what it was before the calibrator-base refactor.

(Vector and matrix scaling's six cases were recomputed for params format 2, which
changed their features on purpose; their format 1 params are kept and must still
predict what they did: see ``make_reference_outputs.py``.)

``data/reference_outputs.npz`` was written once, by ``make_reference_outputs.py``, with
the code before the refactor; this test recomputes every case with the current code
and asserts equality bit for bit: fitted weight and bias, ``to_params()`` JSON (without
the fit's timing), ``predict_proba`` on float64 and float32 input, and the ONNX Runtime
outputs of ``to_onnx()``. Bit for bit on the SIMD dispatch and BLAS kernels the file was
written with; on others, numpy's exp and log round some values differently in the last
bit, BLAS sums in another order, and the bound is a relative 1e-11
(:data:`OTHER_DISPATCH_RTOL`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import calibrators
from tests.calibrators import make_reference_outputs as reference

#: numpy's SIMD dispatch and OpenBLAS's kernels on the machine that wrote a case
#: (``<case>/dispatch``, else :data:`make_reference_outputs.FROZEN_DISPATCH`: AVX-512,
#: SkylakeX kernels; bench/README.md, "Machine"). Another dispatch's exp and log differ
#: in the last bit of some values, and other BLAS kernels (seen: an AVX-512 EPYC on
#: which OpenBLAS 0.3.31 chose Haswell's) sum the fits' dot products in another order
#: (4.6e-16 relative on the vector case's bias), so bit-for-bit equality is asserted
#: only on the machine kind that wrote the case.

#: Elsewhere: the largest relative difference allowed. Measured on an AVX2 machine with
#: the frozen inputs: 2.5e-12 at most (dirichlet-cv, whose penalty search amplifies the
#: last-bit differences of exp; temperature 3e-16), so a real change still shows.
OTHER_DISPATCH_RTOL = 1e-11


_DISPATCH: list[str] = []


def same_dispatch(written: str = reference.FROZEN_DISPATCH) -> bool:
    if not _DISPATCH:
        _DISPATCH.append(reference.dispatch())
    return _DISPATCH[0] == written


def written_on(frozen, key: str) -> str:
    """The dispatch of the case of ``key`` (``<case>/<what>``)."""
    case = key.rsplit("/", 1)[0]
    dispatch = frozen.get(f"{case}/dispatch")
    return reference.FROZEN_DISPATCH if dispatch is None else str(dispatch)


@pytest.fixture(scope="module")
def frozen():
    with np.load(reference.PATH, allow_pickle=False) as f:
        return {key: f[key] for key in f.files}


@pytest.fixture(scope="module")
def inputs(frozen):
    """The frozen inputs themselves: recomputed elsewhere, their softmax differs in the
    last bit, and every case would inherit that."""
    return {key: frozen[f"input/{key}"] for key in reference.dataset()}


def assert_same(value: np.ndarray, expected: np.ndarray, key: str,
                written: str = reference.FROZEN_DISPATCH) -> None:
    if same_dispatch(written):
        np.testing.assert_array_equal(value, expected, strict=True, err_msg=key)
        assert value.tobytes() == expected.tobytes(), key  # bit for bit (-0.0 too)
    elif value.dtype.kind in "fc":
        np.testing.assert_allclose(value, expected, rtol=OTHER_DISPATCH_RTOL, atol=0, err_msg=key)
    elif value.dtype.kind == "U":  # the params' JSON: its numbers as above
        assert_json_close(json.loads(str(value)), json.loads(str(expected)), key)
    else:
        np.testing.assert_array_equal(value, expected, strict=True, err_msg=key)


def assert_json_close(value, expected, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(value, dict) and set(value) == set(expected), where
        for k in expected:
            assert_json_close(value[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert isinstance(value, list) and len(value) == len(expected), where
        for i, (v, e) in enumerate(zip(value, expected, strict=True)):
            assert_json_close(v, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(value, bool):
        # abs too: fit_info holds the final gradient's norm, a residual near 1e-6 whose
        # last-bit differences are large relative to it
        assert value == pytest.approx(expected, rel=OTHER_DISPATCH_RTOL, abs=1e-12), where
    else:
        assert value == expected, where


def test_the_inputs_are_the_frozen_ones(frozen):
    for key, value in reference.dataset().items():
        if same_dispatch():
            np.testing.assert_array_equal(value, frozen[f"input/{key}"], strict=True)
        else:  # the softmax's exp: at most a few units in the last place
            np.testing.assert_array_max_ulp(value, frozen[f"input/{key}"], maxulp=4)


@pytest.mark.parametrize("case", reference.CASES, ids=[c[0] for c in reference.CASES])
def test_outputs_are_bit_identical_to_the_frozen_ones(frozen, inputs, case):
    now = reference.compute(*case, inputs)
    expected = {key for key in frozen if key.startswith(f"{case[0]}/")}
    assert set(now) == expected - {f"{case[0]}/dispatch"}
    for key, value in now.items():
        assert_same(value, frozen[key], key, written_on(frozen, key))


@pytest.mark.parametrize("case", reference.CASES, ids=[c[0] for c in reference.CASES])
def test_params_stored_before_the_refactor_still_load_and_predict_the_same(
    frozen, inputs, case
):
    name, _, kind, _ = case
    params = json.loads(str(frozen[f"{name}/params_json"]))
    held = inputs[kind][reference.N_FIT :]
    probs = calibrators.from_params(params).predict_proba(held, kind=kind)
    assert_same(probs, frozen[f"{name}/predict_proba"], name, written_on(frozen, name + "/p"))


with np.load(reference.PATH, allow_pickle=False) as _file:
    FORMAT_1 = sorted({key.split("/")[1] for key in _file.files if key.startswith("format-1/")})


@pytest.mark.parametrize("name", FORMAT_1)
def test_params_of_format_1_still_load_and_predict_what_they_did(frozen, inputs, name):
    """Vector and matrix params written before format 2 keep their map (raw logits),
    bit for bit; without a recorded kind they take both kinds, as they did."""
    kind = next(c[2] for c in reference.CASES if c[0] == name)
    params = json.loads(str(frozen[f"format-1/{name}/params_json"]))
    assert params["format"] == calibrators.base.PARAMS_FORMAT_1 and "kind" not in params
    cal = calibrators.from_params(params)
    held = inputs[kind][reference.N_FIT :]
    assert_same(cal.predict_proba(held, kind=kind), frozen[f"format-1/{name}/predict_proba"],
                name)
    assert cal.to_params()["format"] == calibrators.base.PARAMS_FORMAT_1


def test_the_frozen_methods_still_exist():
    assert {c[1] for c in reference.CASES} <= set(calibrators.METHODS)
