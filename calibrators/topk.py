"""Temperature scaling of truncated distributions: top-k log-probabilities from black-box APIs.

A hosted language model answers with at most the ``k`` (often 20) largest
log-probabilities of each next token, never the whole vocabulary of ``V`` tokens. A row
of this format holds ``k`` token ids, their log-probabilities ``l_1 .. l_k`` (as the
model gives them: ``log softmax`` of its logits) and the vocabulary size ``V``; the
label (the token that followed) may be outside the top-k. The rest of the vocabulary is
one bucket, the tail, of mass ``T = 1 - sum_i exp(l_i)`` (floored at
:data:`~calibrators.validation.PROBABILITY_FLOOR`, the library's zero probability).

**A stated model of the tail.** Tempering needs each tail token's log-probability, which
the API does not give; a tail model states them, as ``G`` groups of tokens sharing one
log-probability ``t_g`` with ``m_g`` tokens each (``sum_g m_g = V - k``,
``sum_g m_g exp(t_g) = T``):

* ``"uniform"``: one group, ``t = log(T / (V - k))``: the tail spread evenly;
* ``"decay"``: the tail continues the decay of the top-k in ``log r`` (``r`` the rank):
  the sorted ``l_(r)`` are fitted by least squares over the ranks ``1 .. k`` as a
  parabola ``a + b log r + c (log r)**2`` with curvature ``c <= 0`` (the constrained
  optimum: the unconstrained parabola where it bends down, else the straight line of
  Zipf's law, its slope capped at 0), continued to the ranks ``k + 1 .. V`` with ``a``
  set so the tail sums to ``T``. The ranks are cut into :data:`DECAY_GROUPS` groups,
  even in ``log r``, each at the mean ``log r`` of its ranks. Why bend: a language
  model's log-probabilities fall faster far down the vocabulary (SmolLM2-135M's do), and
  a straight line gives that far tail too much mass.
  (The figures: ``bench/README.md``, "Temperature from top-k log-probabilities".)

The multiplicities depend only on ``k`` and ``V``, so a row is a vector of ``k + G``
scores ``s`` with constant log-weights ``w`` (0 for the top-k, ``log m_g`` for the
groups), and tempering by ``beta`` is temperature scaling of that vector:
``q_j = exp(w_j + beta s_j) / sum_j' exp(w_j' + beta s_j')``. The calibrated top-k are
``q_1 .. q_k`` and the tail's mass is the rest. With ``k = V`` there is no tail and
this is plain temperature scaling of the log-probabilities (which are the logits up to
a per-row constant).

**The label's score.** A label in the top-k scores its ``l_y``. A label in the tail
scores the tail's mean log-probability under the model's own tail distribution,
``tbar = sum_g (m_g exp(t_g) / T) t_g``: its NLL term ``logsumexp(w + beta s) - beta
tbar`` is the expected NLL of a tail token drawn as the model believes (for the uniform
tail, exactly the tail token's ``-log q``). Per row, with ``s_y`` that score:

```
NLL(beta)    = logsumexp_j(w_j + beta s_j) - beta s_y
dNLL/dbeta   = E_q[s] - s_y
d2NLL/dbeta2 = Var_q(s) >= 0        (convex in beta, whatever the tail model)
```

so the mean NLL is minimised as :class:`~calibrators.methods.temperature.TemperatureScaler`
does: safeguarded Halley/Newton steps inside a bracket, ``beta > 0`` at every
iterate (the order of the top-k never changes). A row is ``k + G`` numbers, so the
fit needs none of the full temperature's chunking and float32 starts.

Why an input format beside the methods, not a method: the registry's methods map an
(N, K) score matrix to an (N, K) one; this format has its own input (ids, truncated
log-probabilities, ``V``), its own output (the top-k plus the tail's mass) and its own
ONNX interface (:func:`TopKTemperature.to_onnx`). It reuses the temperature scaler's
solver, so it stands above the methods in the core's layers (``docs/design.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx
from onnx import TensorProto, helper
from scipy.special import gammaln, logsumexp

from calibrators.evaluation import metrics
from calibrators.methods.temperature import BETA_MAX, BETA_MIN, safeguarded_newton
from calibrators.numerics import map_chunks, softmax, softmax_terms
from calibrators.onnx_export import IR_VERSION, OPSET, GraphBuilder
from calibrators.options import Integer, Positive
from calibrators.validation import (
    MAX_PASSES,
    PROBABILITY_FLOOR,
    CalibrationInputError,
    NotFittedError,
    as_labels,
)

#: The ``.npz`` members of the format (with ``labels`` and ``sequence_ids`` as
#: everywhere else).
IDS, LOGPROBS, VOCAB_SIZE = "topk_ids", "topk_logprobs", "vocab_size"
#: The stated tail models (see the module docstring).
TAILS = ("uniform", "decay")
#: Groups of the "decay" tail (fewer when the tail has fewer tokens).
DECAY_GROUPS = 32
#: How far above 0 a log-probability, and above 1 a top-k's total probability, may be
#: (rounding of the API's float32 numbers); the library's tolerance for probabilities.
LOGPROB_SLACK = 1e-3
#: The largest vocabulary accepted (the service's largest K).
MAX_VOCAB = 1 << 24
#: The format of :meth:`TopKTemperature.to_params`.
PARAMS_FORMAT = "welltempered.topk/1"
INPUT_NAME = "topk_logprobs"
OUTPUT_NAMES = ("probabilities", "tail")


@dataclass(frozen=True)
class TopK:
    """Validated top-k rows (:func:`as_topk`).

    Attributes
    ----------
    ids : ndarray of shape (n_samples, k), int64
        Distinct token ids in ``[0, vocab_size)`` per row.
    logprobs : ndarray of shape (n_samples, k), float64
        Their log-probabilities, finite, ``<= 0`` (values up to ``LOGPROB_SLACK`` above
        are read as 0), in any order.
    vocab_size : int
        ``V >= max(k, 2)``.
    """

    ids: np.ndarray
    logprobs: np.ndarray
    vocab_size: int

    @property
    def k(self) -> int:
        return self.logprobs.shape[1]

    def tail_mass(self) -> np.ndarray:
        """``T = max(1 - sum_i exp(l_i), PROBABILITY_FLOOR)`` per row; 0 when ``k = V``."""
        if self.k == self.vocab_size:
            return np.zeros(self.logprobs.shape[0])
        return np.maximum(1.0 - np.exp(self.logprobs).sum(axis=1), PROBABILITY_FLOOR)

    def label_in_top_k(self, labels: np.ndarray) -> np.ndarray:
        """Per row, the column of ``labels`` among the ids, or -1 for the tail."""
        hit = self.ids == labels[:, None]
        return np.where(hit.any(axis=1), hit.argmax(axis=1), -1)


def _vocab_size(value) -> int:
    """``V`` as an int in ``[2, MAX_VOCAB]`` (a 0-d array, as an ``.npz`` member, too)."""
    return Integer(2, MAX_VOCAB)(
        "vocab_size", value.item() if isinstance(value, np.ndarray | np.generic) else value)


def as_topk(ids, logprobs, vocab_size) -> TopK:
    """The one canonicalisation of top-k rows; raises CalibrationInputError.

    Parameters
    ----------
    ids : array-like of shape (n_samples, k), integers
    logprobs : array-like of shape (n_samples, k), real
    vocab_size : int

    Examples
    --------
    >>> t = as_topk([[3, 1]], [[-0.5, -1.5]], 10)
    >>> t.k, t.vocab_size, round(float(t.tail_mass()[0]), 4)
    (2, 10, 0.1703)
    """
    v = _vocab_size(vocab_size)
    lp = np.asarray(logprobs)
    if lp.ndim != 2 or lp.shape[0] < 1 or lp.shape[1] < 1 or lp.dtype.kind not in "fiu":
        raise CalibrationInputError(
            "top-k log-probabilities must be a 2-D array of real numbers of shape "
            f"(n_samples, k), k >= 1. Got shape {lp.shape}, dtype {lp.dtype}.")
    n, k = lp.shape
    if k > v:
        raise CalibrationInputError(
            f"k (the top-k's width) must be at most the vocabulary size {v}. Got k = {k}.")
    lp = lp.astype(np.float64)
    bad = ~np.isfinite(lp) | (lp > LOGPROB_SLACK)
    if bad.any():
        row = int(bad.any(axis=1).argmax())
        raise CalibrationInputError(
            f"top-k log-probabilities must be finite and <= 0. Got {lp[bad][0]!r} at row {row}.")
    np.minimum(lp, 0.0, out=lp)
    total = np.exp(lp).sum(axis=1)
    if (total > 1 + LOGPROB_SLACK).any():
        row = int((total > 1 + LOGPROB_SLACK).argmax())
        raise CalibrationInputError(
            "the top-k probabilities of a row must sum to at most 1 (they are part of one "
            f"distribution). Got {total[row]!r} at row {row}.")
    raw = np.asarray(ids)
    if raw.shape != (n, k) or raw.dtype.kind not in "iu":
        raise CalibrationInputError(
            f"top-k ids must be integers of the log-probabilities' shape {(n, k)}. "
            f"Got shape {raw.shape}, dtype {raw.dtype}.")
    out = (raw < 0) | (raw >= v)
    if out.any():
        row = int(out.any(axis=1).argmax())
        raise CalibrationInputError(
            f"top-k ids must lie in [0, {v}). Got {raw[out][0]!r} at row {row}.")
    ordered = np.sort(raw, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        row = int(repeated.argmax())
        raise CalibrationInputError(
            f"top-k ids must be distinct within a row. Got {raw[row].tolist()!r} at row {row}.")
    return TopK(raw.astype(np.int64), lp, v)


def from_arrays(arrays) -> tuple[TopK, np.ndarray | None]:
    """``(TopK, labels or None)`` from a mapping of the format's members (an opened
    ``.npz``: ``topk_ids``, ``topk_logprobs``, ``vocab_size``, optionally ``labels``)."""
    missing = [m for m in (IDS, LOGPROBS, VOCAB_SIZE) if m not in arrays]
    if missing:
        raise CalibrationInputError(
            f"top-k data need the members {IDS}, {LOGPROBS} and {VOCAB_SIZE}. "
            f"Got {sorted(arrays)}.")
    topk = as_topk(arrays[IDS], arrays[LOGPROBS], arrays[VOCAB_SIZE])
    labels = arrays["labels"] if "labels" in arrays else None
    if labels is not None:
        labels = as_labels(labels, topk.logprobs.shape[0], topk.vocab_size)
    return topk, labels


def from_chat_logprobs(content, vocab_size, vocabulary=None):
    """``(TopK, labels, names)`` from the chat-completions shape of hosted APIs.

    ``content`` is ``choices[i].logprobs.content``: per position a dict with ``token``
    (str), ``logprob`` and ``top_logprobs``, a list of ``{"token", "logprob"}``, the same
    length ``k`` at every position. The label of a position is its own ``token`` (the
    token that is there: the text's own when the API scored a given text).

    Token strings become ids through ``vocabulary`` (a sequence of token strings, id =
    index: the model's tokenizer, when known); without one they are interned in order of
    first appearance, and ``names`` (id -> token string) keeps the mapping: ids then
    name tokens only within these rows, which is all the fit needs, while ``vocab_size``
    stays the model's own ``V``. Two alternatives of one position with the same string
    (APIs show some distinct byte tokens alike) are refused as repeated ids.

    Examples
    --------
    >>> content = [{"token": "a", "logprob": -0.1, "top_logprobs": [
    ...     {"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -2.5}]},
    ...     {"token": "c", "logprob": -3.0, "top_logprobs": [
    ...     {"token": "b", "logprob": -0.3}, {"token": "a", "logprob": -1.6}]}]
    >>> rows, labels, names = from_chat_logprobs(content, 100)
    >>> rows.ids.tolist(), labels.tolist(), names
    ([[0, 1], [1, 0]], [0, 2], ['a', 'b', 'c'])
    """
    if not isinstance(content, list | tuple) or not content:
        raise CalibrationInputError(
            "logprobs content must be a non-empty list of positions. "
            f"Got {type(content).__name__}.")
    ids: dict[str, int] = {}
    if vocabulary is not None:
        ids = {name: i for i, name in enumerate(vocabulary)}

    def token_id(entry, where: str) -> int:
        name = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise CalibrationInputError(
                f"{where} must be an object with a string 'token'. Got {entry!r:.100}.")
        if name not in ids:
            if vocabulary is not None:
                raise CalibrationInputError(
                    f"{where}'s token is not in the vocabulary. Got {name!r:.100}.")
            ids[name] = len(ids)
        return ids[name]

    rows, logprobs, labels = [], [], []
    for i, position in enumerate(content):
        labels.append(token_id(position, f"position {i}"))
        top = position.get("top_logprobs")
        if not isinstance(top, list | tuple) or not top:
            raise CalibrationInputError(
                f"position {i} must have a non-empty list 'top_logprobs'. Got {top!r:.100}.")
        rows.append([token_id(t, f"position {i}'s top_logprobs") for t in top])
        logprobs.append([t.get("logprob") for t in top])
        if len(rows[-1]) != len(rows[0]):
            raise CalibrationInputError(
                f"every position must list the same number of top_logprobs ({len(rows[0])}). "
                f"Got {len(rows[-1])} at position {i}.")
    if any(not isinstance(v, int | float) or isinstance(v, bool) for row in logprobs for v in row):
        raise CalibrationInputError("every top_logprobs entry needs a numeric 'logprob'.")
    v = _vocab_size(vocab_size)
    if len(ids) > v:
        raise CalibrationInputError(
            f"the rows name more distinct tokens than the vocabulary size {v}. Got {len(ids)}.")
    topk = as_topk(np.array(rows), np.array(logprobs, dtype=np.float64), v)
    names = list(vocabulary) if vocabulary is not None else list(ids)
    return topk, as_labels(labels, len(labels), topk.vocab_size), names


@dataclass(frozen=True)
class _Tail:
    """A tail model's constants for one ``(k, V)``: the groups' log-multiplicities
    ``log_m`` (G,) and, for "decay", the mean log-rank of each group ``rho`` (G,), the
    least-squares coefficients ``slope`` (k,) that give the line's ``b`` from the sorted
    top-k, and ``curve`` (k, 2) those of the parabola's ``(b, c)`` (None for k < 3)."""

    log_m: np.ndarray
    rho: np.ndarray | None = None
    slope: np.ndarray | None = None
    curve: np.ndarray | None = None


def _tail_model(tail: str, k: int, v: int) -> _Tail:
    m = v - k
    if m == 0:
        return _Tail(np.zeros(0))
    if tail == "uniform":
        return _Tail(np.array([math.log(m)]))
    edges = np.unique(np.round(np.geomspace(k + 1, v + 1, min(DECAY_GROUPS, m) + 1)))
    edges = edges.astype(np.int64)
    counts = np.diff(edges).astype(np.float64)
    # mean of log r over ranks e .. e' - 1: (lgamma(e') - lgamma(e)) / (e' - e)
    rho = np.diff(gammaln(edges.astype(np.float64))) / counts
    log_r = np.log(np.arange(1, k + 1, dtype=np.float64))
    centred = log_r - log_r.mean()
    slope = centred / (centred @ centred) if k > 1 else np.zeros(1)
    curve = None
    if k >= 3:  # rows 1, 2 of the pseudo-inverse of [1, log r, log r**2]
        curve = np.ascontiguousarray(
            np.linalg.pinv(np.stack([np.ones(k), log_r, log_r**2], axis=1))[1:].T)
    return _Tail(np.log(counts), rho, slope, curve)


def _tail_scores(t: TopK, model: _Tail) -> np.ndarray:
    """The tail groups' log-probabilities ``t_g`` per row, shape (N, G)."""
    n = t.logprobs.shape[0]
    if model.log_m.size == 0:
        return np.zeros((n, 0))
    log_tail = np.log(t.tail_mass())[:, None]
    if model.rho is None:
        return log_tail - model.log_m
    ordered = -np.sort(-t.logprobs, axis=1)
    b = np.minimum(ordered @ model.slope, 0.0)[:, None]
    c = np.zeros_like(b)
    if model.curve is not None:  # the parabola where it bends down, else the line
        bq, cq = np.hsplit(ordered @ model.curve, 2)
        concave = cq < 0
        b, c = np.where(concave, bq, b), np.where(concave, cq, 0.0)
    shape = b * model.rho + c * model.rho**2
    return shape + (log_tail - logsumexp(shape + model.log_m, axis=1, keepdims=True))


@dataclass(frozen=True)
class _Rows:
    """A fit's rows as tempered vectors: scores (N, k + G), log-weights (k + G,) and
    each row's label score (N,)."""

    s: np.ndarray
    w: np.ndarray
    sy: np.ndarray


def _scores(t: TopK, model: _Tail):
    """``(s, w, tails, shift)``: the rows' scores (N, k + G) shifted so that each row's
    largest is 0 (tempering is shift-invariant, and a huge ``beta`` times a large common
    offset would lose every digit), the log-weights (k + G,), the tail scores (N, G)
    and the shift (N,)."""
    tails = _tail_scores(t, model)
    s = np.concatenate([t.logprobs, tails], axis=1)
    shift = s.max(axis=1)
    s -= shift[:, None]
    return s, np.concatenate([np.zeros(t.k), model.log_m]), tails, shift


def _rows(t: TopK, labels: np.ndarray, model: _Tail) -> _Rows:
    s, w, tails, shift = _scores(t, model)
    column = t.label_in_top_k(labels)
    sy = np.empty(len(labels))
    top = column >= 0
    sy[top] = t.logprobs[top, column[top]]
    if (~top).any():
        if tails.shape[1] == 0:  # unreachable: with k = V every label is in the top-k
            raise CalibrationInputError("a label outside the top-k needs k < V.")
        p = np.exp(tails[~top] + model.log_m)
        sy[~top] = (p * tails[~top]).sum(axis=1) / p.sum(axis=1)
    return _Rows(s, w, sy - shift)


def _moments(r: _Rows, beta: float) -> tuple[float, float, float, float]:
    """Mean NLL, dNLL/dbeta, d2NLL/dbeta2 and d3NLL/dbeta3 at ``beta``: one pass in row
    chunks, float64 sums."""

    def chunk(rows: slice) -> np.ndarray:
        s, sy = r.s[rows], r.sy[rows]
        q, row_max, log_total = softmax_terms(r.w + beta * s, overwrite=True)
        mean = np.einsum("ij,ij->i", q, s)
        d = s - mean[:, None]
        q *= d
        q *= d
        var = q.sum(axis=1)
        third = np.einsum("ij,ij->i", q, d)
        return np.array([np.sum(row_max + log_total - beta * sy), np.sum(mean - sy),
                         var.sum(), third.sum()])

    total = np.sum(map_chunks(chunk, *r.s.shape), axis=0) / r.s.shape[0]
    return tuple(map(float, total))


def mean_nll(topk: TopK, labels, beta: float, tail: str = "decay") -> float:
    """The mean NLL of tempering ``topk`` by ``beta`` under ``tail``, labels in the tail
    scored as the module docstring says (the objective :class:`TopKTemperature` minimises)."""
    y = as_labels(labels, topk.logprobs.shape[0], topk.vocab_size)
    return _moments(_rows(topk, y, _tail_model(_check_tail(tail), topk.k, topk.vocab_size)),
                    float(beta))[0]


def nll_rows(topk: TopK, labels, beta: float = 1.0, tail: str = "decay") -> np.ndarray:
    """The NLL of each row tempered by ``beta`` under ``tail`` (n_samples,): the terms
    whose mean :func:`mean_nll` is (labels in the tail scored as the module docstring
    says). At ``beta`` 1, the rows as the model gave them."""
    y = as_labels(labels, topk.logprobs.shape[0], topk.vocab_size)
    r = _rows(topk, y, _tail_model(_check_tail(tail), topk.k, topk.vocab_size))
    return logsumexp(r.w + float(beta) * r.s, axis=1) - float(beta) * r.sy


def report(topk: TopK, labels, *, beta: float = 1.0, tail: str = "decay", sequences=None,
           n_bins: int = metrics.DEFAULT_N_BINS) -> dict:
    """The metrics of top-k rows tempered by ``beta`` (1: as given), JSON values.

    ``n``, ``k``, ``vocab_size``, ``tail``, ``beta``; ``nll``, ``nll_median``,
    ``nll_p95`` (:func:`nll_rows`); ``accuracy`` (the top-1 token is the label);
    ``ece`` (top-label, equal-width bins, the top-1's calibrated probability as the
    confidence); ``label_in_top_k`` (the share of labels among the ids; the rest are in
    the tail); ``tail_mass`` (the mean calibrated mass of the tail); ``bins`` (the
    reliability bins of that confidence, as ``metrics.report``'s); and with
    ``sequences``, ``sequences`` (:func:`calibrators.evaluation.metrics.nll_rows_summary`).

    >>> t = as_topk([[0, 1], [2, 0]], np.log([[0.7, 0.2], [0.6, 0.3]]), 5)
    >>> out = report(t, [0, 4])
    >>> out["accuracy"], out["label_in_top_k"], round(out["tail_mass"], 3)
    (0.5, 0.5, 0.1)
    """
    n = topk.logprobs.shape[0]
    y = as_labels(labels, n, topk.vocab_size)
    model = _tail_model(_check_tail(tail), topk.k, topk.vocab_size)
    r = _rows(topk, y, model)
    u = r.w + float(beta) * r.s
    lse = logsumexp(u, axis=1)
    nll = lse - float(beta) * r.sy
    top = topk.logprobs.argmax(axis=1)
    rows = np.arange(n)
    confidence = np.exp(u[rows, top] - lse)
    correct = topk.ids[rows, top] == y
    tail_mass = (np.exp(logsumexp(u[:, topk.k:], axis=1) - lse) if model.log_m.size
                 else np.zeros(n))
    median, p95 = np.percentile(nll, [50.0, 95.0])
    ece = metrics.ece_from_bin_statistics(**metrics.bin_statistics(confidence, correct, n_bins))
    out = {
        "n": int(n), "k": topk.k, "vocab_size": topk.vocab_size, "tail": tail,
        "beta": float(beta), "nll": float(nll.mean()), "nll_median": float(median),
        "nll_p95": float(p95), "accuracy": float(correct.mean()), "ece": ece["ece"],
        "label_in_top_k": float((topk.label_in_top_k(y) >= 0).mean()),
        "tail_mass": float(tail_mass.mean()), "bins": ece["bins"],
    }
    if sequences is not None:
        out["sequences"] = metrics.nll_rows_summary(nll, sequences)
    return out


def _check_tail(tail) -> str:
    if tail not in TAILS:
        raise CalibrationInputError(f"tail must be one of {', '.join(TAILS)}. Got {tail!r}.")
    return tail


class TopKTemperature:
    """Temperature scaling fitted and applied on top-k log-probabilities.

    Parameters
    ----------
    tail : {"uniform", "decay"}, default "decay"
        The stated model of the tail (module docstring). "decay" by default: on a real
        model's top-20 its temperature came closer to the full vocabulary's than the
        uniform tail's (``bench/README.md``).
    tol : float, default=1e-10
        Stop when ``|dNLL/dbeta| < tol * scale``, ``scale`` the mean spread of the
        rows' scores (``max s - mean s``).
    max_passes : int, default=50

    Attributes
    ----------
    beta_ : float
        The inverse temperature.
    fit_info_ : dict
        ``passes``, ``reason`` ("converged", "max_passes" or "bound"), ``nll`` (the mean
        NLL of the fit's rows at ``beta_``, tail labels scored as the module docstring
        says), ``gradient``, ``label_in_top_k`` (the share of such labels), ``tail``,
        ``k`` and ``vocab_size``.

    Examples
    --------
    >>> ids = [[0, 1], [2, 0], [1, 2]]
    >>> lp = np.log([[0.7, 0.2], [0.6, 0.3], [0.8, 0.1]])
    >>> cal = TopKTemperature().fit(as_topk(ids, lp, 5), [1, 3, 1])
    >>> probs, tail = cal.predict(as_topk(ids, lp, 5))
    >>> bool(np.allclose(probs.sum(axis=1) + tail, 1.0)), cal.beta_ < 1
    (True, True)
    """

    option_checks: ClassVar[dict] = {"tol": Positive(), "max_passes": Integer(1, MAX_PASSES)}

    def __init__(self, *, tail: str = "decay", tol: float = 1e-10, max_passes: int = 50):
        self.tail = tail
        self.tol = tol
        self.max_passes = max_passes

    def _options(self) -> dict:
        _check_tail(self.tail)
        return {name: check(name, getattr(self, name))
                for name, check in self.option_checks.items()}

    def fit(self, topk: TopK, labels) -> TopKTemperature:
        """Fit ``beta`` on validated top-k rows (:func:`as_topk`) and their labels
        (token ids in ``[0, V)``, in the top-k or not); returns ``self``."""
        options = self._options()
        y = as_labels(labels, topk.logprobs.shape[0], topk.vocab_size)
        rows = _rows(topk, y, _tail_model(self.tail, topk.k, topk.vocab_size))
        spread = float((rows.s.max(axis=1) - rows.s.mean(axis=1)).mean())
        if spread == 0.0:  # every row flat: every beta predicts the same
            beta, nll, grad, passes, reason = 1.0, _moments(rows, 1.0)[0], 0.0, 1, "converged"
        else:
            def f(beta):
                nll, grad, var, third = _moments(rows, beta)
                return grad / spread, var / spread, third / spread, (nll, grad)

            beta, _, (nll, grad), passes, reason = safeguarded_newton(
                f, BETA_MIN / spread, BETA_MAX / spread, 1.0, tol=options["tol"],
                max_passes=options["max_passes"], increasing=True)
        self.beta_ = float(beta)
        self.k_, self.vocab_size_ = topk.k, topk.vocab_size
        self.fit_info_ = {
            "passes": passes, "reason": reason, "nll": nll, "gradient": grad,
            "label_in_top_k": float((topk.label_in_top_k(y) >= 0).mean()),
            "tail": self.tail, "k": topk.k, "vocab_size": topk.vocab_size,
        }
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "beta_"):
            raise NotFittedError("this TopKTemperature is not fitted: call fit first.")

    def predict(self, topk: TopK) -> tuple[np.ndarray, np.ndarray]:
        """``(probabilities (N, k), tail (N,))``: the calibrated top-k, in the input's
        order (tempering keeps their order), and the tail's mass; each row sums to 1."""
        self._check_fitted()
        s, w, _, _ = _scores(topk, _tail_model(self.tail, topk.k, topk.vocab_size))
        q = softmax(self.beta_ * s + w)
        return q[:, : topk.k], q[:, topk.k:].sum(axis=1)

    def to_params(self) -> dict:
        """A dict of JSON values that :meth:`from_params` turns back into this calibrator."""
        self._check_fitted()
        return {"format": PARAMS_FORMAT, "tail": self.tail, "beta": self.beta_,
                "k": self.k_, "vocab_size": self.vocab_size_, "fit_info": self.fit_info_}

    @classmethod
    def from_params(cls, params: dict) -> TopKTemperature:
        if not isinstance(params, dict) or params.get("format") != PARAMS_FORMAT:
            raise CalibrationInputError(f"top-k params must be a dict of format {PARAMS_FORMAT}. "
                                        f"Got {params!r:.200}.")
        cal = cls(tail=params["tail"])
        cal._options()
        cal.beta_ = Positive()("beta", params["beta"])
        cal.k_ = Integer(1, MAX_VOCAB)("k", params["k"])
        cal.vocab_size_ = Integer(max(2, cal.k_), MAX_VOCAB)("vocab_size", params["vocab_size"])
        cal.fit_info_ = params.get("fit_info", {})
        return cal

    def to_onnx(self, k: int | None = None, vocab_size: int | None = None) -> bytes:
        """The serialised ONNX model of :meth:`predict` for rows of ``k`` log-probabilities
        out of ``vocab_size`` tokens (default: the fit's), as ``Calibrator.to_onnx``.

        Input ``topk_logprobs`` float32 (N, k) (validated rows: finite, ``<= 0``);
        outputs ``probabilities`` float32 (N, k) and ``tail`` float32 (N,). The graph
        computes in float64 (the tail model's constants and ``beta`` are float64
        initializers), opset 17 and IR version 8 as every calibrator's graph
        (:mod:`calibrators.onnx_export`).
        """
        self._check_fitted()
        k = self.k_ if k is None else Integer(1, MAX_VOCAB)("k", k)
        v = self.vocab_size_ if vocab_size is None else Integer(max(2, k), MAX_VOCAB)(
            "vocab_size", vocab_size)
        model = _tail_model(self.tail, k, v)
        g = GraphBuilder(k)
        for reserved in (INPUT_NAME, *OUTPUT_NAMES):
            g.name(reserved)
        x = g.node("Cast", [INPUT_NAME], "x", to=TensorProto.DOUBLE)
        probabilities, tail = OUTPUT_NAMES
        scores = x
        one = g.constant(np.array([1], dtype=np.int64), "class_axis")
        if model.log_m.size:
            total = g.node("ReduceSum", [g.node("Exp", [x], "e"), one], "top_mass", keepdims=1)
            rest = g.node("Sub", [g.constant(1.0, "one"), total], "rest")
            log_tail = g.node("Log", [g.node("Max", [rest, g.constant(PROBABILITY_FLOOR, "floor")],
                                             "tail_mass")], "log_tail")
            if model.rho is None:
                t = g.node("Sub", [log_tail, g.constant(model.log_m[None, :], "log_m")], "t")
            else:
                ordered = g.node("TopK", [x, g.constant(np.array([k], dtype=np.int64), "k")],
                                 "sorted", axis=1)
                g.nodes[-1].output.append(g.name("sorted_index"))
                zero = g.constant(0.0, "zero")
                b = g.node("Min", [g.node("MatMul", [ordered, g.constant(model.slope[:, None],
                                                                          "slope")], "b_ls"),
                                   zero], "b")
                rho = g.constant(model.rho[None, :], "rho")
                shape = g.node("Mul", [b, rho], "line")
                if model.curve is not None:  # the parabola where it bends down
                    bc = g.node("MatMul", [ordered, g.constant(model.curve, "curve")], "bc")
                    bq = g.node("Slice", [bc, g.constant(np.array([0]), "bc_b"),
                                          g.constant(np.array([1]), "bc_c"), one], "bq")
                    cq = g.node("Slice", [bc, "bc_c", g.constant(np.array([2]), "bc_end"), one],
                                "cq")
                    concave = g.node("Less", [cq, zero], "concave")
                    parabola = g.node("Add", [
                        g.node("Mul", [bq, rho], "bq_rho"),
                        g.node("Mul", [cq, g.constant(model.rho[None, :]**2, "rho2")], "cq_rho2"),
                    ], "parabola")
                    shape = g.node("Where", [concave, parabola, shape], "shape")
                shape_w = g.node("Add", [shape, g.constant(model.log_m[None, :], "log_m")],
                                 "shape_w")
                norm = g.node("ReduceLogSumExp", [shape_w], "shape_lse", axes=[1], keepdims=1)
                t = g.node("Add", [shape, g.node("Sub", [log_tail, norm], "a")], "t")
            scores = g.node("Concat", [x, t], "scores", axis=1)
        # as the numpy path: shifted to a row maximum of 0, times beta, plus log-weights
        top = g.node("ReduceMax", [scores], "top", axes=[1], keepdims=1)
        s = g.node("Sub", [scores, top], "s")
        w = np.concatenate([np.zeros(k), model.log_m])[None, :]
        u = g.node("Add", [g.node("Mul", [s, g.constant(self.beta_, "beta")], "bs"),
                           g.constant(w, "w")], "u")
        lse = g.node("ReduceLogSumExp", [u], "lse", axes=[1], keepdims=1)
        q = g.node("Exp", [g.node("Sub", [u, lse], "log_q")], "q")
        columns = [g.constant(np.array([c], dtype=np.int64), f"column_{c}") for c in (0, k)]
        p = g.node("Slice", [q, columns[0], columns[1], one], "p")
        if model.log_m.size:
            end = g.constant(np.array([k + model.log_m.size], dtype=np.int64), "end")
            q_tail = g.node("Slice", [q, columns[1], end, one], "q_tail")
            tail64 = g.node("ReduceSum", [q_tail, one], "tail64", keepdims=0)
            g.nodes.append(helper.make_node("Cast", [tail64], [tail], to=TensorProto.FLOAT))
        else:
            n = g.node("Shape", [x], "n", end=1)
            g.nodes.append(helper.make_node("ConstantOfShape", [n], [tail],
                                            value=helper.make_tensor("zero", TensorProto.FLOAT,
                                                                     [1], [0.0])))
        g.nodes.append(helper.make_node("Cast", [p], [probabilities], to=TensorProto.FLOAT))
        graph = helper.make_graph(
            g.nodes, "topk_temperature",
            inputs=[helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", k])],
            outputs=[helper.make_tensor_value_info(probabilities, TensorProto.FLOAT, ["N", k]),
                     helper.make_tensor_value_info(tail, TensorProto.FLOAT, ["N"])],
            initializer=g.initializers)
        onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                       ir_version=IR_VERSION, producer_name="welltempered")
        helper.set_model_props(onnx_model, {"method": "temperature", "format": "topk",
                                            "tail": self.tail, "k": str(k), "vocab_size": str(v)})
        onnx.checker.check_model(onnx_model, full_check=True)
        return onnx_model.SerializeToString()
