"""Issue 22's items 1, 3 and 4 on real language-model outputs: tests/data/lm/smollm2_top20.npz
(SmolLM2-135M's top-20 log-probabilities at 3,000 positions of 30 texts; bench/lm_fixture.py).

Each position becomes a distribution over 21 outcomes: the model's top 20 tokens and one
bucket for the rest of the vocabulary (its mass, 1 minus the top 20's), the label the
rank of the true next token, or 20 when it is outside the top 20. That is a real model's
distribution, with the correlations of real texts, at a K the tests can afford.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import calibrators
from calibrators.evaluation import metrics
from calibrators.evaluation.holdout import split_indices
from calibrators.evaluation.pair import temperature_explains
from calibrators.methods.row_entropy import row_temperatures
from tests.oracles import softmax

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "lm" / "smollm2_top20.npz"


@pytest.fixture(scope="module")
def positions():
    """Log-probabilities (n, 21): the top 20 and the tail's bucket; labels; texts."""
    with np.load(FIXTURE) as f:
        top = f["topk_logprobs"].astype(np.float64)
        ids, labels, texts = f["topk_ids"], f["labels"], f["sequence_ids"]
    tail = np.log1p(-np.minimum(np.exp(top).sum(axis=1), 1 - 1e-12))
    hit = ids == labels[:, None]
    rank = np.where(hit.any(axis=1), hit.argmax(axis=1), top.shape[1])
    return np.column_stack([top, tail]), rank, texts


def test_the_fixture_is_what_its_readme_says(positions):
    logp, rank, texts = positions
    assert logp.shape == (3000, 21) and np.allclose(np.exp(logp).sum(axis=1), 1)
    assert np.unique(texts).size == 30
    assert 0.5 < np.mean(rank < 20) < 1  # the label is often, not always, in the top 20


def test_item_1_a_split_by_text_keeps_every_text_on_one_side(positions):
    logp, rank, texts = positions
    fit_rows, held = split_indices(len(rank), 0.2, seed=0, groups=texts)
    assert not set(texts[fit_rows]) & set(texts[held])
    assert sorted(np.concatenate([fit_rows, held])) == list(range(len(rank)))
    summary = metrics.sequence_nll_summary(np.exp(logp[held]), rank[held], texts[held])
    nll = -logp[held, rank[held]]
    assert summary["tokens"]["count"] == held.size
    assert summary["tokens"]["median"] == pytest.approx(np.median(nll), rel=1e-12)
    per_text = [nll[texts[held] == t].mean() for t in np.unique(texts[held])]
    assert summary["sequences"]["count"] == len(per_text)
    assert summary["sequences"]["p95"] == pytest.approx(np.percentile(per_text, 95), rel=1e-12)


def entropy(p: np.ndarray) -> np.ndarray:
    """Each row's entropy in nats, from its definition."""
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)


@pytest.mark.parametrize("target", [0.5, 1.5, 2.5])
def test_item_3_entropy_targets_are_hit_on_real_distributions(positions, target):
    logp, _, _ = positions
    cal = calibrators.create("temperature", target_entropy=target).fit(logp)  # no labels
    assert abs(entropy(cal.predict_proba(logp)).mean() - target) < 1e-9
    # the per-row variant: every row its own temperature, every row on the target
    temperatures = row_temperatures(logp, target)
    tempered = softmax((logp - logp.max(axis=1, keepdims=True)) / temperatures[:, None])
    assert np.max(np.abs(entropy(tempered) - target)) < 1e-9
    assert (tempered.argmax(axis=1) == logp.argmax(axis=1)).all()


def test_item_4_a_tempered_model_is_explained_and_a_reordered_one_is_not(positions):
    logp, _, _ = positions
    tempered = softmax(0.7 * logp)
    out = temperature_explains(logp, tempered, kind_b="probabilities", top_k=10)
    assert out["beta"] == pytest.approx(0.7, rel=1e-7)
    assert out["explained"] == pytest.approx(1.0, abs=1e-9)
    rng = np.random.default_rng(0)
    reordered = np.take_along_axis(logp, rng.permuted(np.tile(np.arange(21), (len(logp), 1)),
                                                      axis=1), axis=1)
    out = temperature_explains(logp, reordered, top_k=10)
    assert out["top1_agreement"] < 0.2
    assert out["explained_beyond_flat"] < 0.05
