"""What every score body shares, whatever its format: the names of its arrays, the
bounds of a request (:class:`Bounds`: the model's K, the row and byte limits, known
before a byte of data is read) and the validation of the decoded arrays.

Shapes, NaN/Inf, probability rows, dtypes and labels are checked by
``calibrators.validation`` (its ``CalibrationInputError`` becomes a 422 in
:mod:`service.server.problems`); this module adds what the core cannot know: the
model's number of classes, the row and byte limits of the request, and whether
logits look like probabilities. Pure: no web framework.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from calibrators import topk
from calibrators.numerics import row_chunks
from calibrators.validation import as_labels, as_scores
from service.errors import ContentTooLarge, InvalidInput
from service.security import limits
from service.settings import Settings
from service.storage.arrays import Staged
from service.vocabulary import KINDS

#: Accepted names of the score array, and the kind each one means. ``predictions``
#: is the name used by the shared CIFAR files (softmax probabilities).
SCORE_KEYS = {"logits": "logits", "probabilities": "probabilities", "predictions": "probabilities"}

LABEL_KEYS = ("labels", "ground_truth")

#: A JSON body names its score array by its kind.
JSON_SCORE_KEYS = KINDS

#: The optional array of a dataset (``.npz`` member, JSON field) that gives the sequence
#: (the text) of each row, when rows are tokens: integers or strings.
SEQUENCE_KEY = "sequence_ids"

#: Characters of one string sequence id, at most. All of them together are bounded by
#: the request's bytes (:attr:`Bounds.max_bytes`), as a ``<U`` array of the longest one.
MAX_SEQUENCE_ID_CHARS = 256

#: A body of logits whose every row is a probability distribution (non-negative,
#: summing to 1 within this) is refused unless the kind was given explicitly.
PROBABILITY_LIKE_TOLERANCE = 1e-4

#: Bytes of a body handled at a time where one is walked in pieces (widening, inflating,
#: counting).
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Bounds:
    """What a body may hold, known before its data are read: the model's K, the rows
    of one request (``what``: ``predict``, ``feedback`` or ``dataset``, the name of the
    row limit) and the bytes of array data, all arrays together."""

    num_classes: int
    model: str
    max_rows: int
    max_bytes: int
    what: str
    #: ``?dtype=`` (:data:`service.vocabulary.SCORE_DTYPES`): how a binary body's scores are read.
    dtype: str | None = None
    #: Whether the body may give each row's sequence (:data:`SEQUENCE_KEY`): datasets.
    sequences: bool = False
    #: Whether the body may leave out the labels (scores for label-free fits): datasets.
    unlabelled: bool = False
    #: Whether the body may hold top-k rows (:data:`TOPK_KEYS`, :data:`CHAT_KEYS`)
    #: instead of scores: datasets (a top-k version's predict reads nothing else).
    topk: bool = False

    def check_rows(self, rows: int) -> None:
        limits.check_rows(rows, self.max_rows, self.what)


#: The setting that limits the rows of each kind of request.
_ROW_SETTINGS = {
    "predict": "max_predict_rows",
    "feedback": "max_feedback_rows",
    "dataset": "max_dataset_rows",
}


def bounds(
    settings: Settings, what: str, num_classes: int, model: str, dtype: str | None = None
) -> Bounds:
    """The :class:`Bounds` of a ``what`` request (``predict``, ``feedback`` or ``dataset``)
    for a model of ``num_classes`` classes; ``dtype`` is the request's ``?dtype=``."""
    return _bounds(
        num_classes, model, getattr(settings, _ROW_SETTINGS[what]), settings.max_body_bytes,
        what, dtype,
    )


@functools.lru_cache(maxsize=1024)
def _bounds(
    num_classes: int, model: str, rows: int, max_bytes: int, what: str, dtype: str | None
) -> Bounds:
    # One frozen object per distinct set of values (immutable, so shared): building one
    # per predict took more than a few of its checks.
    dataset = what == "dataset"
    return Bounds(num_classes, model, rows, max_bytes, what, dtype, dataset, dataset, dataset)


@dataclass(frozen=True)
class Labelled:
    scores: np.ndarray  # (N, K) float32 or float64, validated
    labels: np.ndarray | None  # (N,) int64 in [0, K); None: scores alone (a dataset's)
    kind: str
    sequences: np.ndarray | None = None  # (N,) int64 or <U, :func:`validated_sequences`
    #: The scores' .npy bytes, already written and hashed (an upload's routed member,
    #: :mod:`service.api.codecs.npz`): stored as they are.
    scores_file: Staged | None = None


#: The members (.npz) and keys (JSON) of top-k rows (``calibrators.topk``).
TOPK_KEYS = (topk.IDS, topk.LOGPROBS, topk.VOCAB_SIZE)
#: The keys of top-k rows in the chat-completions shape: ``choices`` (the answer's
#: ``choices``, each ``{"logprobs": {"content": [...]}}``, one sequence each) or
#: ``logprobs`` (one choice's ``{"content": [...]}``); ``vocabulary`` optionally maps
#: token strings to ids (id = index).
CHAT_KEYS = ("choices", "logprobs")


@dataclass(frozen=True)
class TopKRows:
    """Validated top-k rows of a request: the rows, their labels (None: predict), their
    sequence ids, and the token strings of their ids when they came in the
    chat-completions shape (id -> token; None for arrays)."""

    rows: topk.TopK
    labels: np.ndarray | None = None
    sequences: np.ndarray | None = None
    names: list[str] | None = None


def validated_topk(
    ids: Any, logprobs: Any, vocab_size: Any, bounds: Bounds, *, labels: Any = None,
    sequences: Any = None, names: list[str] | None = None,
) -> TopKRows:
    """Top-k rows checked (``calibrators.topk.as_topk``: ids, log-probabilities and V, a
    422 each) against the model: V must be its K (its vocabulary), the rows within the
    request's limit."""
    given = vocab_size.item() if isinstance(vocab_size, np.ndarray | np.generic) else vocab_size
    if isinstance(given, int) and given != bounds.num_classes:  # first: the likeliest slip
        raise InvalidInput(
            f"vocab_size must be the number of classes of model {bounds.model!r}, "
            f"{bounds.num_classes} (its vocabulary). Got {given}."
        )
    rows = topk.as_topk(ids, logprobs, vocab_size)
    n = rows.logprobs.shape[0]
    bounds.check_rows(n)
    if labels is not None:
        labels = as_labels(labels, n, rows.vocab_size)
    if sequences is not None:
        sequences = validated_sequences(sequences, n, bounds.max_bytes)
    return TopKRows(rows, labels, sequences, names)


def topk_needed(served: str) -> InvalidInput:
    """The 422 of full scores sent to what serves top-k rows (``served``: its name)."""
    return InvalidInput(
        f"{served} serves top-k rows (calibrators.topk): send {topk.IDS} and "
        f"{topk.LOGPROBS} (JSON arrays or .npz members) or the chat-completions shape "
        f"({' or '.join(CHAT_KEYS)}, top_logprobs at each position), not full (n, K) scores."
    )


def full_needed(served: str) -> InvalidInput:
    """The 422 of top-k rows sent to what serves full (n, K) scores."""
    return InvalidInput(
        f"{served} serves full (n, K) scores (logits or probabilities), not top-k rows: "
        "top-k rows need a version fitted on a top-k dataset."
    )


def _check_classes(arr: np.ndarray, kind: str, num_classes: int, model: str) -> None:
    if arr.shape[1] != num_classes:
        raise InvalidInput(
            f"{kind} must have {num_classes} columns, one per class of model {model!r}. "
            f"Got shape {arr.shape}."
        )


def validated_scores(
    scores: Any, kind: str, num_classes: int, model: str, finite: bool = False
) -> np.ndarray:
    """``as_scores`` and the model's K; ``finite``: the caller knows every score is
    finite (parsed from JSON), so that is not checked again."""
    arr = as_scores(scores, kind, assume_finite=finite)
    _check_classes(arr, kind, num_classes, model)
    return arr


def validated(scores: Any, labels: Any, kind: str, num_classes: int, model: str) -> Labelled:
    """The rows checked; ``labels`` None stays None (scores alone)."""
    arr = validated_scores(scores, kind, num_classes, model)
    if labels is None:
        return Labelled(arr, None, kind)
    return Labelled(arr, as_labels(labels, arr.shape[0], arr.shape[1]), kind)


def _sequence_error(detail: str) -> InvalidInput:
    return InvalidInput(
        f"{SEQUENCE_KEY} must give the sequence (text) of each row: all integers (int64) or "
        f"all strings of at most {MAX_SEQUENCE_ID_CHARS} characters. {detail}"
    )


def _string_ids(values: list[str] | np.ndarray, n: int, max_bytes: int) -> np.ndarray:
    longest = max(map(len, values), default=0) if isinstance(values, list) else int(
        np.char.str_len(values).max(initial=0)
    )
    if longest > MAX_SEQUENCE_ID_CHARS:
        raise _sequence_error(f"Got an id of {longest} characters.")
    width = max(longest, 1)
    if n * width * 4 > max_bytes:
        raise too_many_bytes(f"{SEQUENCE_KEY} ({n} ids, the longest {longest} characters)",
                             n * width * 4, max_bytes)
    return np.asarray(values, dtype=f"<U{width}")


def validated_sequences(values: Any, n: int, max_bytes: int) -> np.ndarray:
    """The sequence id of each of ``n`` rows, canonical: ``int64``, or ``<U`` as wide as the
    longest id (the same ids give the same array, so the same stored file), or a 422.

    ``values``: a JSON list, or a decoded ``.npz`` member (integers or ``<U`` strings:
    :data:`~service.api.codecs.npy.SEQUENCE_DTYPES`). As strings, they take ``n`` times
    4 bytes per character of the longest id, at most ``max_bytes``; one sequence is
    accepted (a fit then refuses a split it cannot make)."""
    if isinstance(values, np.ndarray):
        if values.shape != (n,):
            raise _sequence_error(f"One per row, shape ({n},). Got shape {values.shape}.")
        if values.dtype.kind == "U":
            return _string_ids(values, n, max_bytes)
        if values.dtype.kind == "u" and n and values.max() > np.iinfo(np.int64).max:
            raise _sequence_error(f"Got {values.max()}, beyond int64.")
        return values.astype(np.int64)
    if not isinstance(values, list):
        raise _sequence_error(f"Got {shorten(values)}.")
    if len(values) != n:
        raise _sequence_error(f"One per row: {n}. Got {len(values)}.")
    if all(isinstance(v, str) for v in values):
        return _string_ids(values, n, max_bytes)
    kinds = {type(v).__name__ for v in values}
    if kinds != {"int"}:
        hint = " (floats are not ids)" if "float" in kinds else ""
        raise _sequence_error(f"Got a mix of {', '.join(sorted(kinds))}{hint}.")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise _sequence_error("Got an integer beyond int64.") from None


#: Values of the first row looked at before its sum (:func:`every_row_a_distribution`):
#: read as Python floats, no numpy reduction (a predict of one row, every time).
_FIRST_VALUES = 16


def every_row_a_distribution(arr: np.ndarray) -> bool:
    """True when every row of validated scores is non-negative and sums to 1 within
    :data:`PROBABILITY_LIKE_TOLERANCE` (checked in row chunks; stops at the first row
    that is not)."""
    n, k = arr.shape
    if n and min(arr[0, :_FIRST_VALUES].tolist()) < 0:
        return False  # most logits: decided by a negative among the first row's first values
    if n and abs(arr[0].sum(dtype=np.float64) - 1.0) > PROBABILITY_LIKE_TOLERANCE:
        return False  # the others: by the first row's sum
    for rows in row_chunks(n, k):
        block = arr[rows]
        if (block < 0).any():
            return False
        sums = block.sum(axis=1, dtype=np.float64)
        if (np.abs(sums - 1.0) > PROBABILITY_LIKE_TOLERANCE).any():
            return False
    return True


def check_not_probabilities(arr: np.ndarray, kind: str, explicit: bool, fix: str) -> None:
    """422 for logits (``kind`` not given ``explicit``-ly) whose every row is a
    probability distribution: probabilities sent as logits would be calibrated wrong
    without a word. ``fix`` says how to send them as probabilities."""
    if kind != "logits" or explicit or not every_row_a_distribution(arr):
        return
    raise InvalidInput(
        f"These scores were sent as logits, but every row is a probability distribution "
        f"(non-negative, summing to 1 within {PROBABILITY_LIKE_TOLERANCE:g}): calibrating "
        f"probabilities as logits gives wrong answers. {fix} If they really are logits, "
        "add ?kind=logits.",
        fix=fix,
    )


def resolve_kind(given: str | None, body_kind: str, where: str) -> tuple[str, bool]:
    """The kind of the scores and whether it was explicit: ``?kind=`` when given (422 if it
    contradicts ``body_kind``, the kind the body names ``where``), else ``body_kind``."""
    if given is None:
        return body_kind, False
    if given != body_kind:
        raise InvalidInput(
            f"?kind={given} contradicts the body, which holds {body_kind} ({where}): "
            "give the kind once, or make them agree."
        )
    return given, True


def shorten(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def too_many_bytes(what: str, nbytes: int, limit: int) -> ContentTooLarge:
    return ContentTooLarge(
        f"{what} declares data that take {nbytes} bytes once read and converted (float16 "
        "and bfloat16 to float32, anything but float32 to float64); a request may hold at most "
        f"{limit} (WELLTEMPERED_MAX_BODY_BYTES).",
        max_bytes=limit,
    )
