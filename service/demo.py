"""``serve --demo``: model "digits-mlp", calibrated on real data shipped with scikit-learn.

A small MLP is trained on a fifth of scikit-learn's bundled 8x8 digits; its
pre-softmax outputs (logits) on the rest (1,438 images) are uploaded as a dataset,
temperature scaling is fitted synchronously and given the default alias. The demo
has its own SQLite file and data folder, and every step is skipped when
already done, so restarts are idempotent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from pathlib import Path

import numpy as np
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from calibrators.evaluation.holdout import DEFAULT_HOLDOUT
from service.api.codecs.rules import validated
from service.errors import NotFound
from service.jobs.attempts import execute
from service.jobs.queue import worker_config
from service.settings import Settings
from service.storage import registry
from service.storage.arrays import ArrayStore
from service.vocabulary import DEFAULT_ALIAS, DEFAULT_ARGMAX_POLICY, DEFAULT_NAMESPACE

log = logging.getLogger("welltempered.demo")

DEMO_DIR = Path("welltempered-data") / "demo"
MODEL = "digits-mlp"


def demo_settings(base: Settings) -> Settings:
    return base.model_copy(
        update={
            "database_url": f"sqlite:///{DEMO_DIR / 'demo.sqlite3'}",
            "data_dir": DEMO_DIR,
        }
    )


@functools.lru_cache(maxsize=2)
def digits_logits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train logits, train labels, held-out logits, held-out labels) of a digits MLP."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    # A small training split, no weight decay, trained to convergence: the
    # classic recipe for an over-confident network (T ~ 1.8 on the rest).
    x_tr, x_cal, y_tr, y_cal = train_test_split(x, y, train_size=0.2, random_state=seed, stratify=y)
    clf = MLPClassifier(
        hidden_layer_sizes=(32,), alpha=0.0, max_iter=2000, tol=1e-6, random_state=seed
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning on some platforms
        clf.fit(x_tr, y_tr)
    return _logits(clf, x_tr), y_tr, _logits(clf, x_cal), y_cal


def _logits(clf, x: np.ndarray) -> np.ndarray:
    """The MLP's pre-softmax output: its hidden layers (ReLU), then the last affine map."""
    a = x
    for w, b in zip(clf.coefs_[:-1], clf.intercepts_[:-1], strict=True):
        a = np.maximum(a @ w + b, 0.0)
    return a @ clf.coefs_[-1] + clf.intercepts_[-1]


def install(settings: Settings, engine: Engine) -> int:
    """Create whatever of the demo is missing; returns the version of the default alias."""
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions() as s:
        model = None
        with contextlib.suppress(NotFound):
            model = registry.find_model(s, MODEL, DEFAULT_NAMESPACE)
            aliased = registry.find_alias(s, model, DEFAULT_ALIAS)[1].version
            log.info("demo: %s is ready (version %d is %r)", MODEL, aliased, DEFAULT_ALIAS)
            return aliased
        log.info("demo: training a small MLP on scikit-learn's digits...")
        _, _, logits, labels = digits_logits()
        if model is None:
            model = registry.create_model(
                s,
                DEFAULT_NAMESPACE,
                MODEL,
                num_classes=10,
                class_names=[str(d) for d in range(10)],
                argmax_policy=DEFAULT_ARGMAX_POLICY,
            )
        arrays = ArrayStore(settings.data_dir, settings.array_store)
        arrays.ensure()
        data = validated(logits, labels, "logits", model.num_classes, model.name)
        dataset, _ = registry.add_dataset(s, model, arrays, data.scores, data.labels, data.kind)
        row = registry.create_version(
            s, model, dataset, method="temperature", holdout=DEFAULT_HOLDOUT, seed=0, options={}
        )
        # the fit workers' configuration (the array store above included), run
        # synchronously, in this thread: temperature takes milliseconds
        config = dataclasses.replace(worker_config(settings), executor="thread")
        status = execute(row.id, config, sessions, worker="demo")
        if status != "succeeded":
            raise RuntimeError(f"demo: the temperature fit ended {status}")
        registry.set_alias(s, model, DEFAULT_ALIAS, row)
        log.info("demo: %s version %d fitted and aliased %r", MODEL, row.version, DEFAULT_ALIAS)
        return row.version
