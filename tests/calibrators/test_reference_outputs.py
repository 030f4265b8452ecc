"""Every number of the four calibrators is what it was before the calibrator-base refactor.

``data/reference_outputs.npz`` was written once, by ``make_reference_outputs.py``, with
the code before the refactor; this test recomputes every case with the current code
and asserts equality bit for bit: fitted weight and bias, ``to_params()`` JSON (without
the fit's timing), ``predict_proba`` on float64 and float32 input, and the ONNX Runtime
outputs of ``to_onnx()``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import calibrators
from tests.calibrators import make_reference_outputs as reference


@pytest.fixture(scope="module")
def frozen():
    with np.load(reference.PATH, allow_pickle=False) as f:
        return {key: f[key] for key in f.files}


def test_the_inputs_are_the_frozen_ones(frozen):
    for key, value in reference.dataset().items():
        np.testing.assert_array_equal(value, frozen[f"input/{key}"], strict=True)


@pytest.mark.parametrize("case", reference.CASES, ids=[c[0] for c in reference.CASES])
def test_outputs_are_bit_identical_to_the_frozen_ones(frozen, case):
    now = reference.compute(*case, reference.dataset())
    expected = {key for key in frozen if key.startswith(f"{case[0]}/")}
    assert set(now) == expected
    for key, value in now.items():
        np.testing.assert_array_equal(value, frozen[key], strict=True, err_msg=key)
        assert value.tobytes() == frozen[key].tobytes(), key  # bit for bit (-0.0 too)


@pytest.mark.parametrize("case", reference.CASES, ids=[c[0] for c in reference.CASES])
def test_params_stored_before_the_refactor_still_load_and_predict_the_same(frozen, case):
    name, _, kind, _ = case
    params = json.loads(str(frozen[f"{name}/params_json"]))
    held = reference.dataset()[kind][reference.N_FIT :]
    probs = calibrators.from_params(params).predict_proba(held, kind=kind)
    assert probs.tobytes() == frozen[f"{name}/predict_proba"].tobytes()


def test_the_frozen_methods_still_exist():
    assert {c[1] for c in reference.CASES} <= set(calibrators.METHODS)
