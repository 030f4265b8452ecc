"""Every number of the four calibrators is what it was before the calibrator-base refactor.

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

#: numpy's SIMD dispatch on the machine that wrote the file (AVX-512, SkylakeX kernels;
#: bench/README.md, "Machine"). Its exp and log differ from the AVX2 ones in the last
#: bit of some values, so bit-for-bit equality is asserted only on the same dispatch.
FROZEN_DISPATCH = "AVX512_SKX"

#: OpenBLAS's kernels on that machine. The same numpy dispatch with other BLAS kernels
#: (seen: an AVX-512 EPYC on which OpenBLAS 0.3.31 chose Haswell's) sums the fits' dot
#: products in another order: 4.6e-16 relative on the vector case's bias.
FROZEN_BLAS = "SkylakeX"

#: Elsewhere: the largest relative difference allowed. Measured on an AVX2 machine with
#: the frozen inputs: 2.5e-12 at most (dirichlet-cv, whose penalty search amplifies the
#: last-bit differences of exp; temperature 3e-16), so a real change still shows.
OTHER_DISPATCH_RTOL = 1e-11


def same_dispatch() -> bool:
    import scipy.linalg  # noqa: F401  (its OpenBLAS too, if it has its own)
    from numpy._core._multiarray_umath import __cpu_features__
    from threadpoolctl import threadpool_info

    blas = [i.get("architecture") for i in threadpool_info() if i["internal_api"] == "openblas"]
    return bool(__cpu_features__.get(FROZEN_DISPATCH)) and blas != [] and all(
        arch == FROZEN_BLAS for arch in blas
    )


@pytest.fixture(scope="module")
def frozen():
    with np.load(reference.PATH, allow_pickle=False) as f:
        return {key: f[key] for key in f.files}


@pytest.fixture(scope="module")
def inputs(frozen):
    """The frozen inputs themselves: recomputed elsewhere, their softmax differs in the
    last bit, and every case would inherit that."""
    return {key: frozen[f"input/{key}"] for key in reference.dataset()}


def assert_same(value: np.ndarray, expected: np.ndarray, key: str) -> None:
    if same_dispatch():
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
    assert set(now) == expected
    for key, value in now.items():
        assert_same(value, frozen[key], key)


@pytest.mark.parametrize("case", reference.CASES, ids=[c[0] for c in reference.CASES])
def test_params_stored_before_the_refactor_still_load_and_predict_the_same(
    frozen, inputs, case
):
    name, _, kind, _ = case
    params = json.loads(str(frozen[f"{name}/params_json"]))
    held = inputs[kind][reference.N_FIT :]
    probs = calibrators.from_params(params).predict_proba(held, kind=kind)
    assert_same(probs, frozen[f"{name}/predict_proba"], name)


def test_the_frozen_methods_still_exist():
    assert {c[1] for c in reference.CASES} <= set(calibrators.METHODS)
