"""The one model behind every calibrator: ``softmax(W * phi(z) + b)``.

A subclass sets three things (the structure of ``W``, whether ``b`` exists,
and the feature map ``phi``) and implements ``_fit``; prediction,
serialisation and ONNX export are shared.

============  ===========  ========  ====================  ===============
method        ``W``        ``b``     ``phi(z)``            keeps argmax
============  ===========  ========  ====================  ===============
temperature   scalar beta  no        z                     always
vector        diagonal     yes       z                     not guaranteed
matrix        full         yes       z                     not guaranteed
dirichlet     full         yes       log_softmax(z)        not guaranteed
============  ===========  ========  ====================  ===============
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np

from calibrators.numerics import log_softmax, row_chunks, softmax
from calibrators.validation import (
    CalibrationInputError,
    NotFittedError,
    as_scores,
    as_scores_and_labels,
    logits64,
)

Progress = Callable[[float], None]
PARAMS_FORMAT = "welltempered.calibrator/1"


def _no_progress(fraction: float) -> None:
    return None


class Calibrator:
    """Base class of the ``softmax(W * phi(z) + b)`` family.

    Attributes set by :meth:`fit`
    -----------------------------
    n_classes_ : int
    weight_ : float or ndarray of shape (K,) or (K, K)
    bias_ : ndarray of shape (K,) or None
    fit_info_ : dict
        How the fit went (iterations, gradient, chosen penalties, ...).
    """

    method: ClassVar[str]
    structure: ClassVar[Literal["scalar", "diagonal", "full"]]
    has_bias: ClassVar[bool]
    feature: ClassVar[Literal["logits", "log_softmax"]] = "logits"
    preserves_argmax: ClassVar[bool] = False

    # -- options ----------------------------------------------------------
    def get_options(self) -> dict[str, Any]:
        """The constructor options, as JSON-serialisable values."""
        return dict(self._options)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"{type(self).__name__}({opts})"

    # -- fitting ----------------------------------------------------------
    def fit(self, scores, labels, *, kind: str = "logits", progress: Progress | None = None):
        """Fit on a labelled validation set.

        Parameters
        ----------
        scores : array-like of shape (n_samples, n_classes)
            Logits, or probabilities with ``kind="probabilities"``.
        labels : array-like of shape (n_samples,)
            Integer class labels in ``[0, n_classes)``.
        kind : {"logits", "probabilities"}
        progress : callable, optional
            Called with a fraction in [0, 1] as a long fit advances.

        Returns
        -------
        self
        """
        x, y = as_scores_and_labels(scores, labels, kind)
        self._fit(x, y, kind, progress or _no_progress)
        self.n_classes_ = int(x.shape[1])
        return self

    def _fit(self, x: np.ndarray, y: np.ndarray, kind: str, progress: Progress) -> None:
        """Learn ``weight_``, ``bias_`` and ``fit_info_`` from validated scores.

        ``x`` is the validated score array (float32 or float64, logits or
        probabilities per ``kind``); turn row blocks of it into float64
        logits with :func:`calibrators.validation.logits64`.
        """
        raise NotImplementedError

    # -- prediction -------------------------------------------------------
    def _check_fitted(self) -> None:
        if not hasattr(self, "n_classes_"):
            raise NotFittedError(
                f"{type(self).__name__} is not fitted: call fit() or calibrators.from_params() "
                "first. Got an unfitted instance."
            )

    def decision_function(self, z: np.ndarray) -> np.ndarray:
        """Calibrated logits ``W * phi(z) + b`` of a float64 block of validated logits."""
        x = log_softmax(z) if self.feature == "log_softmax" else z
        if self.structure == "scalar":
            return x * self.weight_
        if self.structure == "diagonal":
            return x * self.weight_ + self.bias_
        return x @ self.weight_.T + self.bias_

    def predict_proba(self, scores, *, kind: str = "logits") -> np.ndarray:
        """Calibrated probabilities.

        Parameters
        ----------
        scores : array-like of shape (n_samples, n_classes)
        kind : {"logits", "probabilities"}

        Returns
        -------
        ndarray of shape (n_samples, n_classes), float64
            Rows sum to 1; finite for any finite input.
        """
        self._check_fitted()
        x = as_scores(scores, kind, n_classes=self.n_classes_)
        out = np.empty(x.shape, dtype=np.float64)
        for rows in row_chunks(*x.shape):
            out[rows] = softmax(self.decision_function(logits64(x[rows], kind)))
        return out

    # -- serialisation ----------------------------------------------------
    def to_params(self) -> dict[str, Any]:
        """Everything needed to rebuild this fitted calibrator, as plain JSON values."""
        self._check_fitted()
        weight = self.weight_
        return {
            "format": PARAMS_FORMAT,
            "method": self.method,
            "n_classes": self.n_classes_,
            "options": self.get_options(),
            "weight": float(weight) if self.structure == "scalar" else weight.tolist(),
            "bias": None if self.bias_ is None else self.bias_.tolist(),
            "fit_info": self.fit_info_,
        }

    def _load_params(self, params: dict[str, Any]) -> None:
        k = params["n_classes"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 2:
            raise CalibrationInputError(f"params n_classes must be an integer >= 2. Got {k!r}.")
        shape = {"scalar": (), "diagonal": (k,), "full": (k, k)}[self.structure]
        try:
            weight = np.asarray(params["weight"], dtype=np.float64)
            bias = None if params.get("bias") is None else np.asarray(params["bias"], np.float64)
        except (TypeError, ValueError) as exc:
            raise CalibrationInputError(f"params weight/bias must be numbers. Got {exc}.") from None
        if weight.shape != shape:
            raise CalibrationInputError(
                f"params weight for {self.method} must have shape {shape}. Got {weight.shape}."
            )
        if self.has_bias != (bias is not None) or (bias is not None and bias.shape != (k,)):
            want = f"shape ({k},)" if self.has_bias else "null"
            got = None if bias is None else bias.shape
            raise CalibrationInputError(f"params bias for {self.method} must be {want}. Got {got}.")
        if not np.isfinite(weight).all() or (bias is not None and not np.isfinite(bias).all()):
            raise CalibrationInputError("params weight/bias must be finite. Got NaN or Inf.")
        self.weight_ = float(weight) if self.structure == "scalar" else weight
        self.bias_ = bias
        self.fit_info_ = dict(params.get("fit_info") or {})
        self.n_classes_ = k

    # -- export -----------------------------------------------------------
    def to_onnx(self, *, metadata: dict[str, str] | None = None) -> bytes:
        """This calibrator as a serialised ONNX model (see :mod:`calibrators.onnx_export`)."""
        from calibrators.onnx_export import linear_softmax_onnx

        self._check_fitted()
        meta = {"method": self.method, "n_classes": str(self.n_classes_)}
        meta.update(metadata or {})
        return linear_softmax_onnx(
            self.n_classes_,
            weight=self.weight_,
            bias=self.bias_,
            feature=self.feature,
            doc_string=f"welltempered {self.method} scaling",
            metadata=meta,
        )


def check_positive(name: str, value, *, allow_none: bool = False) -> None:
    """Raise CalibrationInputError unless ``value`` is a finite number > 0."""
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CalibrationInputError(f"{name} must be a finite number > 0. Got {value!r}.")
