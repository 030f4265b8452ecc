"""The CLI and the service choose the same rows for the same (N, holdout, seed).

Both go through calibrators.evaluation.holdout.split_indices; this test holds the two entry
points against each other on an odd N (where the old CLI and service rules
disagreed: 450 against 449 fit rows at N = 899, holdout 0.5).
"""

from __future__ import annotations

import pytest

from service.offline import compare
from tests.service.helpers import create_model, fit, logits_data, upload


@pytest.mark.parametrize("holdout,seed", [(0.5, 3), (0.2, 0), (0.37, 11)])
def test_cli_and_service_fit_and_evaluate_the_same_rows(client, holdout, seed):
    scores, labels = logits_data(n=899, k=5, seed=seed)
    create_model(client, "m", k=5)
    dataset = upload(client, "m", scores, labels)
    version = fit(client, "m", dataset["id"], method="temperature", holdout=holdout, seed=seed)
    assert version["status"] == "succeeded", version

    offline = compare(scores, labels, methods=("temperature",), holdout=holdout, seed=seed)
    cli = offline["methods"]["temperature"]
    # Same held-out rows: the same metrics before and after, to the last digit.
    assert version["metrics"]["before"] == offline["uncalibrated"]
    assert version["metrics"]["after"] == cli["report"]
    assert version["metrics"]["after"]["n"] == offline["n_holdout"] == round(899 * holdout)
    # Same fit rows (in the same order): the same fitted temperature, bit for bit.
    assert version["params"]["weight"] == cli["params"]["weight"]
