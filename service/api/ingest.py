"""Decode request bodies into validated arrays, with the core's validation rules.

Shapes, NaN/Inf, probability rows and labels are checked by
``calibrators.validation`` (its ``CalibrationInputError`` becomes a 422 in
:mod:`service.api.problems`); this module adds only what the core cannot know: the
body formats, and the model's number of classes.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from calibrators.validation import as_labels, as_scores
from service.errors import InvalidInput, MalformedBody, MalformedJSON
from service.vocabulary import KINDS

#: Accepted names of the score array, and the kind each one means. ``predictions``
#: is the name used by the shared CIFAR files (softmax probabilities).
SCORE_KEYS = {"logits": "logits", "probabilities": "probabilities", "predictions": "probabilities"}
LABEL_KEYS = ("labels", "ground_truth")
#: A JSON body names its score array by its kind.
JSON_SCORE_KEYS = KINDS


@dataclass(frozen=True)
class Labelled:
    scores: np.ndarray  # (N, K) float32 or float64, validated
    labels: np.ndarray  # (N,) int64 in [0, K)
    kind: str


def decode_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedJSON(f"The body is not valid JSON: {exc}.") from None


def _check_classes(arr: np.ndarray, kind: str, num_classes: int, model: str) -> None:
    if arr.shape[1] != num_classes:
        raise InvalidInput(
            f"{kind} must have {num_classes} columns, one per class of model {model!r}. "
            f"Got shape {arr.shape}."
        )


def validated_scores(scores: Any, kind: str, num_classes: int, model: str) -> np.ndarray:
    arr = as_scores(scores, kind)
    _check_classes(arr, kind, num_classes, model)
    return arr


def validated(scores: Any, labels: Any, kind: str, num_classes: int, model: str) -> Labelled:
    arr = validated_scores(scores, kind, num_classes, model)
    return Labelled(arr, as_labels(labels, arr.shape[0], arr.shape[1]), kind)


def score_key(obj: dict, allowed: tuple[str, ...]) -> str:
    """The one key of ``allowed`` that ``obj`` holds (422 for none or several)."""
    present = [k for k in allowed if k in obj]
    if len(present) != 1:
        raise InvalidInput(
            f"The body must hold exactly one of {', '.join(map(repr, allowed))}. "
            f"Got {sorted(obj)!r}."
        )
    return present[0]


def json_object(body: bytes, allowed_keys: set[str]) -> dict:
    """The body as a JSON object with no keys but ``allowed_keys`` (400 if not JSON, else 422)."""
    obj = decode_json(body)
    if not isinstance(obj, dict):
        raise InvalidInput(f"The body must be a JSON object. Got a {type(obj).__name__}.")
    unknown = set(obj) - allowed_keys
    if unknown:
        raise InvalidInput(
            f"Unknown field(s) {sorted(unknown)!r}; expected {sorted(allowed_keys)!r}."
        )
    return obj


def labelled_from_json(body: bytes, num_classes: int, model: str) -> Labelled:
    """``{"logits" | "probabilities": [[...]], "labels": [...]}``."""
    obj = json_object(body, {*JSON_SCORE_KEYS, "labels"})
    key = score_key(obj, JSON_SCORE_KEYS)
    if "labels" not in obj:
        raise InvalidInput("The body must hold 'labels', one class index per row.")
    return validated(obj[key], obj["labels"], key, num_classes, model)


def scores_from_json(body: bytes, num_classes: int, model: str) -> tuple[np.ndarray, str]:
    """``{"logits" | "probabilities": [[...]]}`` for predict."""
    obj = json_object(body, set(JSON_SCORE_KEYS))
    key = score_key(obj, JSON_SCORE_KEYS)
    return validated_scores(obj[key], key, num_classes, model), key


_NPZ_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError)


def _read_npy(fp, what: str, max_bytes: int, body: bytes | None = None) -> np.ndarray:
    """One .npy stream, its header checked before any allocation (no pickles, no bombs).

    With ``body`` (the whole stream, ``fp`` reading it), the array is a read-only view
    of it rather than a copy.
    """
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    except _NPZ_ERRORS as exc:
        raise MalformedBody(f"{what} is not a valid .npy array: {exc}.") from None
    if dtype.hasobject:
        raise InvalidInput(f"{what} must be a numeric array. Got dtype {dtype} (objects).")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise InvalidInput(
            f"{what} declares {nbytes} bytes of data ({shape}, {dtype}); the limit is {max_bytes}."
        )
    count = math.prod(shape)
    try:
        if body is not None:
            offset = fp.tell()
            if len(body) - offset < nbytes:
                raise EOFError(f"expected {nbytes} bytes of data, got {len(body) - offset}")
            arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
        else:
            data = fp.read(nbytes)
            if len(data) != nbytes:
                raise EOFError(f"expected {nbytes} bytes of data, got {len(data)}")
            arr = np.frombuffer(data, dtype=dtype, count=count)
    except _NPZ_ERRORS as exc:
        raise MalformedBody(f"{what} is truncated or corrupt: {exc}.") from None
    order = "F" if fortran else "C"
    return arr.reshape(shape, order=order)


def _npz_members(path: Path) -> tuple[zipfile.ZipFile, dict[str, str]]:
    try:
        zf = zipfile.ZipFile(path)
    except _NPZ_ERRORS as exc:
        raise MalformedBody(f"The body is not a .npz (zip) archive: {exc}.") from None
    members = {n.removesuffix(".npy"): n for n in zf.namelist()}
    return zf, members


def labelled_from_npz(path: Path, num_classes: int, model: str, max_bytes: int) -> Labelled:
    """A ``.npz`` holding ``logits`` | ``probabilities`` | ``predictions`` and ``labels`` |
    ``ground_truth``."""
    zf, members = _npz_members(path)
    with zf:
        score_names = [k for k in SCORE_KEYS if k in members]
        label_names = [k for k in LABEL_KEYS if k in members]
        if len(score_names) != 1 or len(label_names) != 1:
            raise InvalidInput(
                "The .npz must hold exactly one score array (logits, probabilities or "
                "predictions) and one label array (labels or ground_truth). "
                f"Got {sorted(members)!r}."
            )
        arrays = {}
        for name in (score_names[0], label_names[0]):
            try:
                with zf.open(members[name]) as fp:
                    arrays[name] = _read_npy(fp, f"array {name!r} of the .npz", max_bytes)
            except _NPZ_ERRORS as exc:  # CRC errors, bad compression...
                raise MalformedBody(f"array {name!r} of the .npz is corrupt: {exc}.") from None
    kind = SCORE_KEYS[score_names[0]]
    return validated(arrays[score_names[0]], arrays[label_names[0]], kind, num_classes, model)


def scores_from_npy(body: bytes, kind: str, num_classes: int, model: str) -> np.ndarray:
    """A ``.npy`` body (predict): one (N, K) array of ``kind``."""
    arr = _read_npy(io.BytesIO(body), "The .npy body", len(body), body)
    return validated_scores(arr, kind, num_classes, model)


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def npy_view(arr: np.ndarray) -> memoryview:
    """``arr`` as a .npy file (the bytes of :func:`npy_bytes`) with one copy of the data:
    the header is written into a buffer preallocated for header + data."""
    arr = np.ascontiguousarray(arr)
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(arr))
    except ValueError:  # a header too long for format 1.0 (huge shapes): np.save picks 2.0
        return memoryview(npy_bytes(arr))
    header = head.getvalue()
    out = bytearray(len(header) + arr.nbytes)
    out[: len(header)] = header
    np.frombuffer(out, dtype=arr.dtype, offset=len(header)).reshape(arr.shape)[...] = arr
    return memoryview(out)
