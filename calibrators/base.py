"""The base of every calibrator: logits in, calibrated logits out, softmax on top.

A calibrator is a map ``z -> u(z)`` from the logits of a classifier to calibrated
logits (unnormalised log-probabilities); its probabilities are ``softmax(u(z))``.
A subclass implements three things:

* ``_fit(x, y, *, kind, options, progress)``: learn the fitted arrays (attributes
  ending in ``_``) and return a JSON-serialisable ``fit_info`` dict;
* ``_forward(z)``: ``u`` for a float64 block of logits, in numpy;
* ``_onnx_forward(graph, z)``: the same map as ONNX nodes (see
  :class:`calibrators.onnx_export.GraphBuilder`).

and declares, at class level, its constructor options (``option_checks``: name ->
check, in the order of the ``__init__`` signature) and its fitted arrays
(``fitted_arrays``: name -> shape). It should also state what its fit costs, as
formulas in N and K (the classmethod ``fit_cost``, see :mod:`calibrators.cost`);
the default is a conservative bound. Everything else is shared and written once
here: option validation, input validation, row-chunked float64 prediction, the
ONNX wrapper (input, ``-inf`` handling, the four outputs), the
:meth:`~Calibrator.to_params` / :func:`calibrators.from_params` round trip and
the scikit-learn estimator contract (``get_params``, ``set_params``, ``clone``).

The ``softmax(W * phi(z) + b)`` family (temperature, vector, matrix and Dirichlet
scaling) is one subclass of this base: :class:`calibrators.linear_softmax.LinearSoftmax`.

Examples
--------
A calibrator that halves every logit (it learns nothing; ``_onnx_forward`` omitted):

>>> class Halve(Calibrator):
...     method = "halve"
...     def _fit(self, x, y, *, kind, options, progress):
...         return {}
...     def _forward(self, z):
...         return 0.5 * z
>>> cal = Halve().fit([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]], [0, 1])
>>> cal.predict_proba([[2.0, 0.0, 0.0]]).round(4).tolist()
[[0.5761, 0.2119, 0.2119]]
>>> Halve.from_params(cal.to_params()).n_classes_
3
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np
from sklearn.base import BaseEstimator

from calibrators.cost import Cost, conservative_cost
from calibrators.numerics import map_rows, softmax
from calibrators.options import reject_unknown
from calibrators.validation import (
    KINDS,
    SCORE_DTYPE_KINDS,
    CalibrationInputError,
    KindError,
    NotFittedError,
    as_scores,
    as_scores_and_labels,
    check_kind,
    logits64,
)

if TYPE_CHECKING:  # ONNX is imported by to_onnx only, not with the package
    from calibrators.onnx_export import GraphBuilder

Progress = Callable[[float], None]
#: The format :meth:`Calibrator.to_params` writes. Format 2 records the kind of scores
#: a calibrator was fitted on (``kind``) and changed the features of vector and matrix
#: scaling to the centred log-ratio (:func:`calibrators.validation.centred_log_ratio`).
PARAMS_FORMAT = "welltempered.calibrator/2"
#: Format 1: before format 2. Still read: the same maps, with vector and matrix scaling
#: on the raw logits (see :attr:`Calibrator.input_kinds`).
PARAMS_FORMAT_1 = "welltempered.calibrator/1"
#: The formats :func:`calibrators.from_params` reads.
PARAMS_FORMATS = (PARAMS_FORMAT_1, PARAMS_FORMAT)
#: A fitted array's shape: a tuple of ints and names, each name ``"n_classes"``
#: (K) or a constructor option; ``()`` for a float; None for an array that is
#: always absent (stored as JSON null, e.g. the bias of temperature scaling).
Shape = tuple[int | str, ...] | None


def _no_progress(fraction: float) -> None:
    return None


class Calibrator(BaseEstimator):
    """Base class: a map from logits to calibrated logits, and its softmax.

    Class attributes of a subclass
    ------------------------------
    method : str
        The name in :data:`calibrators.METHODS` and in ``to_params()``.
    option_checks : dict of str to callable
        One entry per ``__init__`` keyword, in signature order:
        ``check(name, value) -> canonical value`` (the value stored in
        ``to_params()["options"]``), raising CalibrationInputError.
    fitted_arrays : dict of str to shape
        The learned arrays, stored as attributes ``<name>_`` and as keys
        ``<name>`` of ``to_params()`` (see :data:`Shape`).
    preserves_argmax : bool
        True when the calibrated argmax always equals the argmax of the logits.
    learns_from_labels : bool
        False for a method whose ``fit`` on labelled rows learns nothing of its own
        (a wrapper whose parameters come from elsewhere): ``auto`` does not try it.
        Whether a fit needs labels at all is :meth:`needs_labels` (it may depend on
        the options).
    onnx_graph_name : str
        Name of the exported ONNX graph.

    Attributes set by :meth:`fit`
    -----------------------------
    n_classes_ : int
    kind_ : {"logits", "probabilities"} or None
        The kind of scores it was fitted on (None: params that do not say).
    fit_info_ : dict
        How the fit went (iterations, gradient, chosen penalties, ...).

    One answer per distribution: every calibrator of format 2 gives the same
    probabilities for logits with any per-row constant added and for the
    probabilities of the same distribution (its map reads only the distribution,
    by construction or through the centred log-ratio), whichever kind it was
    fitted on. A calibrator that cannot (params of format 1, see
    :attr:`input_kinds`) refuses the other kind with :class:`KindError`.
    """

    method: ClassVar[str]
    option_checks: ClassVar[dict[str, Callable[[str, Any], Any]]] = {}
    fitted_arrays: ClassVar[dict[str, Shape]] = {}
    preserves_argmax: ClassVar[bool] = False
    learns_from_labels: ClassVar[bool] = True
    onnx_graph_name: ClassVar[str] = "calibrator"

    # -- options ----------------------------------------------------------
    def checked_options(self) -> dict[str, Any]:
        """The options, checked, as ``to_params()["options"]`` stores them.

        Every option of :meth:`get_params`, in signature order, in canonical
        JSON-serialisable form (e.g. a penalty grid sorted and without repeats),
        each through its ``option_checks`` entry (:mod:`calibrators.options`).
        Called by :func:`calibrators.create`, at the start of :meth:`fit` and by
        :meth:`to_params`; a subclass with rules across options extends it.

        Raises
        ------
        CalibrationInputError
            An option is invalid.
        """
        params = self.get_params(deep=False)
        if set(params) != set(self.option_checks):
            raise TypeError(
                f"{type(self).__name__}.option_checks must name every __init__ option: "
                f"{sorted(params)}. Got {sorted(self.option_checks)}."
            )
        return {name: check(name, params[name]) for name, check in self.option_checks.items()}

    @classmethod
    def with_options(cls, options: Mapping[str, Any]) -> Self:
        """A new, unfitted calibrator with these options, checked.

        Raises
        ------
        CalibrationInputError
            ``options`` is not a mapping, names an unknown option (the message
            lists the valid ones), or has an invalid value.
        """
        reject_unknown(cls.method, cls.option_checks, options)
        calibrator = cls(**options)
        calibrator.checked_options()
        return calibrator

    # -- cost -------------------------------------------------------------
    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options: Mapping[str, Any]) -> Cost:
        """Predicted peak working memory and work of :meth:`fit` on N x K scores.

        The caller is :func:`calibrators.estimate_cost`, which validates N and K,
        canonicalises ``options`` and adds the input's own bytes.

        Parameters
        ----------
        n_samples : int
            N, the rows given to ``fit``.
        n_classes : int
            K.
        options : dict
            The canonical options (every option, defaults included).

        Returns
        -------
        Cost
            ``bytes``: the peak memory ``fit`` allocates on top of its input (given
            as a C-contiguous float32 or float64 array; anything else adds one
            float64 copy), as numpy and scipy allocate it; ``flops``: an order of
            magnitude of the work.

        Notes
        -----
        The default is :func:`calibrators.cost.conservative_cost`: a dense fit of
        ``K**2 + K`` parameters on four float64 copies of the scores. A subclass
        overrides this classmethod with the formula of its own fit, written with
        the blocks of :mod:`calibrators.cost` (``chunk_bytes`` for row-chunked
        passes, ``FLOAT64 * n * k`` for a float64 copy of the scores,
        ``lbfgs_bytes`` for scipy's L-BFGS-B), states that formula in its
        docstring, keeps it non-decreasing in K (:func:`calibrators.max_classes`
        bisects on K), and checks it against a measured peak at two sizes in
        ``tests/calibrators/test_cost.py``.
        """
        return conservative_cost(n_samples, n_classes)

    # -- fitting ----------------------------------------------------------
    @classmethod
    def needs_labels(cls, options: Mapping[str, Any]) -> bool:
        """Whether :meth:`fit` with these (canonical) options needs labels.

        True by default: a calibrator is fitted to labels. A method whose target is a
        property of the scores alone (an entropy) says False, for the options that
        make it so; its ``_fit`` then gets ``y`` None when no labels are given.
        """
        return True

    def fit(self, scores, labels=None, *, kind: str = "logits",
            progress: Progress | None = None):
        """Fit on a validation set, labelled unless the method needs no labels.

        Parameters
        ----------
        scores : array-like of shape (n_samples, n_classes)
            Logits, or probabilities with ``kind="probabilities"``.
        labels : array-like of shape (n_samples,), optional
            Integer class labels in ``[0, n_classes)``. Required unless
            :meth:`needs_labels` says otherwise for the options.
        kind : {"logits", "probabilities"}
        progress : callable, optional
            Called with a fraction in [0, 1] as a long fit advances.

        Returns
        -------
        self

        Raises
        ------
        CalibrationInputError
            No labels for a method (and options) that learns from them.
        """
        options = self.checked_options()
        if labels is None:
            if self.needs_labels(options):
                raise CalibrationInputError(
                    f"{self.method} calibration with these options learns from labels: give "
                    "one class index per row, or choose a label-free fit (temperature with "
                    "target_entropy, or row-entropy). Got no labels."
                )
            x, y = as_scores(scores, kind), None
        else:
            x, y = as_scores_and_labels(scores, labels, kind)
        fit_info = self._fit(x, y, kind=kind, options=options, progress=progress or _no_progress)
        for name, shape in self.fitted_arrays.items():
            if shape is None:
                setattr(self, f"{name}_", None)
        self._check_fitted_arrays(int(x.shape[1]), options)
        self.fit_info_ = fit_info
        self.kind_ = kind
        self.n_classes_ = int(x.shape[1])
        return self

    def _fit(
        self, x: np.ndarray, y: np.ndarray | None, *, kind: str, options: dict[str, Any],
        progress: Progress,
    ) -> dict[str, Any]:
        """Learn the fitted arrays from validated scores; return ``fit_info``.

        Parameters
        ----------
        x : ndarray of shape (n_samples, n_classes), float32 or float64
            Validated scores, logits or probabilities per ``kind``: turn row
            blocks of it into float64 logits with
            :func:`calibrators.validation.logits64`.
        y : ndarray of shape (n_samples,), int64, or None
            None only when :meth:`needs_labels` is False for ``options``.
        kind : {"logits", "probabilities"}
        options : dict
            The canonical options (:meth:`checked_options`).
        progress : callable

        Returns
        -------
        dict
            JSON-serialisable facts about the fit (becomes ``fit_info_``).
        """
        raise NotImplementedError

    # -- the map, in numpy and in ONNX --------------------------------------
    def _forward(self, z: np.ndarray) -> np.ndarray:
        """Calibrated logits of a float64 block of logits.

        Parameters
        ----------
        z : ndarray of shape (n_rows, n_classes), float64
            Finite logits.

        Returns
        -------
        ndarray of shape (n_rows, n_classes), float64
            Unnormalised calibrated log-probabilities: their softmax is the output.
        """
        raise NotImplementedError

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        """Append :meth:`_forward` as ONNX nodes to ``graph``; return the output's name.

        Parameters
        ----------
        graph : calibrators.onnx_export.GraphBuilder
        z : str
            Name of the float64 logits, shape (N, K).

        Returns
        -------
        str
            Name of the float64 calibrated logits, shape (N, K).
        """
        raise NotImplementedError

    # -- prediction -------------------------------------------------------
    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "n_classes_")

    def _check_fitted(self) -> None:
        if not self.__sklearn_is_fitted__():
            raise NotFittedError(
                f"{type(self).__name__} is not fitted: call fit() or calibrators.from_params() "
                "first. Got an unfitted instance."
            )

    @property
    def input_kinds(self) -> tuple[str, ...]:
        """The kinds of scores this calibrator gives its one answer for.

        Both (``calibrators.validation.KINDS``) for every map of format 2. A map of
        format 1 that depends on the logits' per-row constant (vector and matrix
        scaling then) gives it only for the kind it was fitted on, when known.
        """
        return KINDS

    def check_input_kind(self, kind: str) -> None:
        """Raise :class:`KindError` (or CalibrationInputError for an unknown
        ``kind``) unless this calibrator takes scores of ``kind``
        (:attr:`input_kinds`)."""
        self._check_fitted()
        check_kind(kind)
        if kind in self.input_kinds:
            return
        (needed,) = self.input_kinds
        raise KindError(
            f"this {self.method} calibrator (params {self._params_format()}) maps raw "
            f"logits, so its answer depends on their per-row constant: it gives one "
            f"answer only for {needed}, the kind it was fitted on. Give {needed} "
            f"(kind={needed!r}), or refit it. Got kind={kind!r}.",
            needed,
        )

    def predict_proba(self, scores, *, kind: str = "logits") -> np.ndarray:
        """Calibrated probabilities.

        Parameters
        ----------
        scores : array-like of shape (n_samples, n_classes)
        kind : {"logits", "probabilities"}

        Returns
        -------
        ndarray of shape (n_samples, n_classes), float64
            Rows sum to 1; finite for any finite input. The same for the same
            distribution however it is given (see :attr:`input_kinds`).

        Raises
        ------
        KindError
            ``kind`` is not in :attr:`input_kinds`.
        """
        self.check_input_kind(kind)
        x = as_scores(scores, kind, n_classes=self.n_classes_)
        return map_rows(lambda block: softmax(self._forward(logits64(block, kind))), x)

    # -- serialisation ----------------------------------------------------
    def to_params(self) -> dict[str, Any]:
        """Everything needed to rebuild this fitted calibrator, as plain JSON values.

        Returns
        -------
        dict
            ``format`` (:data:`PARAMS_FORMAT`; format 1 for a calibrator read from
            format 1 params whose map format 2 changed), ``method``, ``n_classes``,
            ``kind`` (the kind of scores it was fitted on, or None), ``options``
            (canonical), one key per fitted array (a float, nested lists, or None)
            and ``fit_info``.
        """
        self._check_fitted()
        out: dict[str, Any] = {
            "format": self._params_format(),
            "method": self.method,
            "n_classes": self.n_classes_,
            "kind": self.kind_,
            "options": self.checked_options(),
        }
        for name, shape in self.fitted_arrays.items():
            value = getattr(self, f"{name}_")
            if shape is None:
                out[name] = None
            elif shape == ():
                out[name] = float(value)
            else:
                out[name] = value.tolist()
        out["fit_info"] = self.fit_info_
        return out

    def _shape(self, shape: Shape, n_classes: int, options: Mapping[str, Any]) -> tuple:
        sizes = {"n_classes": n_classes, **options}
        return tuple(sizes[d] if isinstance(d, str) else d for d in shape)

    def _check_fitted_arrays(self, n_classes: int, options: Mapping[str, Any]) -> None:
        """A subclass's ``_fit`` must set every declared array with its declared shape."""
        for name, shape in self.fitted_arrays.items():
            value = getattr(self, f"{name}_", None)
            want = None if shape is None else self._shape(shape, n_classes, options)
            got = None if value is None else np.shape(value)
            if got != want:
                raise TypeError(
                    f"{type(self).__name__}._fit must set {name}_ with shape {want}. Got {got}."
                )

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """Rebuild a fitted calibrator of this class from :meth:`to_params` output.

        :func:`calibrators.from_params` picks the class from ``params["method"]``.

        Raises
        ------
        CalibrationInputError
            Anything missing, malformed or of the wrong shape.
        """
        if not isinstance(params, Mapping):
            raise CalibrationInputError(f"params must be a dict. Got {type(params).__name__}.")
        fmt = params.get("format", PARAMS_FORMAT)
        if not isinstance(fmt, str) or fmt not in PARAMS_FORMATS:
            raise CalibrationInputError(
                f"params format must be {' or '.join(repr(f) for f in PARAMS_FORMATS)} "
                f"(absent: {PARAMS_FORMAT!r}). Got {_short(fmt)}."
            )
        method = params.get("method")
        if not isinstance(method, str) or method != cls.method:
            raise CalibrationInputError(
                f"params method must be {cls.method!r}. Got {_short(method)}."
            )
        options = params.get("options")
        cal = cls.with_options({} if options is None else options)
        cal._load_format(fmt)
        cal._load_params(params)
        return cal

    def _load_format(self, fmt: str) -> None:
        """Adopt the map of params format ``fmt`` (one of :data:`PARAMS_FORMATS`).

        The maps of format 1 are those of format 2 except where a subclass says
        otherwise (:class:`calibrators.linear_softmax.LinearSoftmax`)."""

    def _params_format(self) -> str:
        """The format :meth:`to_params` writes: the one whose map this calibrator has."""
        return PARAMS_FORMAT

    def _load_params(self, params: Mapping[str, Any]) -> None:
        """Set the fitted state from :meth:`to_params` output (validated here)."""
        required = [name for name, shape in self.fitted_arrays.items() if shape is not None]
        missing = [key for key in ("method", "n_classes", *required) if key not in params]
        if missing:
            raise CalibrationInputError(
                f"params must have keys {', '.join(('method', 'n_classes', *required))}. "
                f"Got none for {missing}."
            )
        k = params["n_classes"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 2:
            raise CalibrationInputError(f"params n_classes must be an integer >= 2. Got {k!r}.")
        options = self.checked_options()
        arrays = {}
        for name, shape in self.fitted_arrays.items():
            value = params.get(name)
            if shape is None:
                if value is not None:
                    raise CalibrationInputError(
                        f"params {name} for {self.method} must be null. Got {value!r}."
                    )
                arrays[name] = None
                continue
            want = self._shape(shape, k, options)
            if value is None:
                raise CalibrationInputError(
                    f"params {name} for {self.method} must be numbers of shape {want}. Got None."
                )
            arr = _numbers(f"params {name} for {self.method}", value)
            if arr.shape != want:
                raise CalibrationInputError(
                    f"params {name} for {self.method} must have shape {want}. Got {arr.shape}."
                )
            if not np.isfinite(arr).all():
                raise CalibrationInputError(f"params {name} must be finite. Got NaN or Inf.")
            arrays[name] = float(arr) if want == () else arr
        for name, value in arrays.items():
            setattr(self, f"{name}_", value)
        kind = params.get("kind")
        if kind is not None and kind not in KINDS:
            raise CalibrationInputError(
                f"params kind must be {' or '.join(repr(k) for k in KINDS)}, the kind of "
                f"scores it was fitted on, or null (unknown). Got {_short(kind)}."
            )
        self.fit_info_ = _fit_info(params.get("fit_info"))
        self.kind_ = kind
        self.n_classes_ = k

    # -- export -----------------------------------------------------------
    def to_onnx(self, *, metadata: dict[str, str] | None = None) -> bytes:
        """This calibrator as a serialised ONNX model.

        Parameters
        ----------
        metadata : dict of str to str, optional
            Added to the model's ``metadata_props`` (after ``method`` and ``n_classes``).

        Returns
        -------
        bytes
            A model with the interface of :func:`calibrators.onnx_export.softmax_model`.
            Its metadata holds ``method``, ``n_classes``, ``kind`` (when known) and
            ``input_kinds`` (:attr:`input_kinds`, comma-separated): the graph's one
            input takes logits or the log of probabilities, and computes the same
            answer for both exactly when ``input_kinds`` names both.
        """
        from calibrators.onnx_export import softmax_model

        self._check_fitted()
        meta = {"method": self.method, "n_classes": str(self.n_classes_)}
        if self.kind_ is not None:
            meta["kind"] = self.kind_
        meta["input_kinds"] = ",".join(self.input_kinds)
        meta.update(metadata or {})
        return softmax_model(
            self.n_classes_,
            self._onnx_forward,
            graph_name=self.onnx_graph_name,
            doc_string=f"welltempered {self.method} scaling",
            metadata=meta,
        ).SerializeToString()


def _numbers(what: str, value: Any) -> np.ndarray:
    """``value`` (a number or nested lists of them) as float64, else CalibrationInputError.

    Only real numbers: numpy would read ``"1.5"`` and ``True`` as 1.5 and 1.0, ragged
    lists and integers beyond float64 not at all (ValueError, OverflowError).
    """
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):  # ragged nesting, too many dimensions
        raise CalibrationInputError(
            f"{what} must be numbers in nested lists of equal lengths. Got {_short(value)}."
        ) from None
    if arr.dtype.kind not in SCORE_DTYPE_KINDS:  # strings, bools, None, huge ints (objects)
        raise CalibrationInputError(
            f"{what} must be numbers (nested lists of them). Got {_short(value)}."
        )
    return arr.astype(np.float64)


def _fit_info(value: Any) -> dict[str, Any]:
    """``fit_info`` of params: absent or null ({}), else a mapping with string keys."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise CalibrationInputError(
            f"params fit_info must be an object with string keys, or null. Got {_short(value)}."
        )
    return dict(value)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
