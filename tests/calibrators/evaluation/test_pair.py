"""calibrators.evaluation.pair: is model B model A at another temperature?"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

from calibrators import CalibrationInputError
from calibrators.evaluation.pair import temperature_explains
from tests.oracles import softmax


def kl(q: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.where(q > 0, q * (np.log(np.where(q > 0, q, 1)) - np.log(p)), 0).sum(axis=1)


@settings(max_examples=25, deadline=None)
@given(beta=st.floats(0.05, 20.0), seed=st.integers(0, 2**32), k=st.integers(3, 30))
def test_b_is_a_tempered_all_explained_and_beta_recovered(beta, seed, k):
    z = np.random.default_rng(seed).normal(size=(300, k)) * 2
    out = temperature_explains(z, z * beta, top_k=min(5, k))
    assert out["beta"] == pytest.approx(beta, rel=1e-7)
    assert out["explained"] == pytest.approx(1.0, abs=1e-9) or out["kl_before"]["mean"] < 1e-12
    assert out["explained_beyond_flat"] == pytest.approx(1.0, abs=1e-9)
    assert out["top1_agreement"] == 1.0 and out["discordance"]["p95"] == 0.0


def test_b_ranks_the_classes_differently_little_explained():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(2000, 20)) * 2
    shuffled = np.array([row[rng.permutation(20)] for row in z])  # same values, new ranks
    out = temperature_explains(z, shuffled, top_k=10)
    assert out["explained"] > 0.3  # flattening alone lowers the KL to any B...
    assert out["explained_beyond_flat"] < 0.05  # ...and does little more here
    assert out["top1_agreement"] < 0.2
    assert 0.4 < out["discordance"]["median"] < 0.6  # a random order: half the pairs


def test_beta_is_the_kl_minimiser_against_a_scalar_search():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(400, 7)) * 3
    b = 0.6 * z + rng.normal(size=z.shape)  # partly tempered, partly noise
    out = temperature_explains(z, b, top_k=3)
    q = softmax(b)
    res = minimize_scalar(lambda t: kl(q, softmax(t * z)).mean(), bounds=(1e-3, 10),
                          method="bounded", options={"xatol": 1e-10})
    assert out["beta"] == pytest.approx(res.x, rel=1e-5)
    assert out["kl_after"]["mean"] == pytest.approx(res.fun, rel=1e-9)
    assert out["kl_before"]["mean"] == pytest.approx(kl(q, softmax(z)).mean(), rel=1e-12)
    assert 0 < out["explained"] < 1


def test_probabilities_give_the_answer_of_their_logits():
    rng = np.random.default_rng(3)
    z, zb = rng.normal(size=(100, 5)), rng.normal(size=(100, 5))
    as_logits = temperature_explains(z, zb, top_k=3)
    as_probs = temperature_explains(softmax(z), softmax(zb), kind_a="probabilities",
                                    kind_b="probabilities", top_k=3)
    assert as_probs["beta"] == pytest.approx(as_logits["beta"], rel=1e-9)


def test_edges_flat_b_and_b_peaked_beyond_any_temperature():
    z = np.random.default_rng(4).normal(size=(50, 4))
    assert temperature_explains(z, np.zeros_like(z), top_k=2)["beta"] == 0.0
    one_hot_logits = z * 1e300  # exp underflows: B is exactly one-hot on A's top class
    out = temperature_explains(z, one_hot_logits, top_k=2)
    assert out["beta"] == np.inf and out["kl_after"] is None and out["explained"] is None
    # Given as probabilities, zeros are floored (2**-149): very peaked, finite.
    floored = temperature_explains(z, np.eye(4)[z.argmax(axis=1)], kind_b="probabilities",
                                   top_k=2)
    assert 100 < floored["beta"] < np.inf and floored["top1_agreement"] == 1.0


@pytest.mark.parametrize(
    ("b", "top_k", "match"),
    [(np.zeros((3, 4)), 2, "same shape"), (np.zeros((4, 4)), 1, "top_k"),
     (np.zeros((4, 4)), 5, "top_k"), (np.zeros((4, 4)), True, "top_k")],
)
def test_bad_arguments(b, top_k, match):
    with pytest.raises(CalibrationInputError, match=match):
        temperature_explains(np.zeros((4, 4)), b, top_k=top_k)
