"""Decode request bodies into validated arrays, bounded before a byte of data is read.

Shapes, NaN/Inf, probability rows, dtypes and labels are checked by
``calibrators.validation`` (its ``CalibrationInputError`` becomes a 422 in
:mod:`service.api.problems`); this module adds what the core cannot know: the
body formats, the model's number of classes, the row and byte limits of the
request, and whether logits look like probabilities.

Nothing here can be inflated (docs/api.md, "Body formats"):

- A ``.npy`` header is parsed here, not by numpy: at most :data:`MAX_NPY_HEADER`
  bytes, a shape of non-negative Python ints (no bool), a dtype of
  :data:`NPY_DTYPES`. The shape is checked against the model's K, the row limit
  and the byte limit (:class:`Bounds`) *before* the data are allocated; the data
  then fill one preallocated array, chunk by chunk (:class:`NpyStream`), and a
  byte past the declared size is an error.
- A ``.npz`` is a zip: its central directory is bounded (:data:`MAX_NPZ_MEMBERS`
  entries) before :mod:`zipfile` reads it; only stored and deflated, unencrypted
  members are read, each through :class:`NpyStream`, so a member inflates to at
  most its declared size, checked while inflating.
- A JSON body is bounded in bytes by what its rows can need
  (:func:`json_body_limit`); its number arrays are parsed in groups of rows
  straight into a float64 array (:func:`json_object`), so no list of Python
  floats the size of the body ever exists; rows are counted before parsing.
"""

from __future__ import annotations

import ast
import io
import math
import mmap
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from calibrators.numerics import row_chunks
from calibrators.validation import as_labels, as_scores
from service.errors import ContentTooLarge, InvalidInput, MalformedBody, MalformedJSON
from service.security import limits
from service.settings import Settings
from service.vocabulary import KINDS

#: Accepted names of the score array, and the kind each one means. ``predictions``
#: is the name used by the shared CIFAR files (softmax probabilities).
SCORE_KEYS = {"logits": "logits", "probabilities": "probabilities", "predictions": "probabilities"}
LABEL_KEYS = ("labels", "ground_truth")
#: A JSON body names its score array by its kind.
JSON_SCORE_KEYS = KINDS

#: A body of logits whose every row is a probability distribution (non-negative,
#: summing to 1 within this) is refused unless the kind was given explicitly.
PROBABILITY_LIKE_TOLERANCE = 1e-4

#: numpy refuses longer .npy headers too (``max_header_size``).
MAX_NPY_HEADER = 10_000
#: Bytes of a .npy before its data, at most (magic, version, length, header).
NPY_PREFIX_MAX = 12 + MAX_NPY_HEADER
_NPY_MAGIC = b"\x93NUMPY"
#: .npy dtypes a body may hold: real floats and integers of at most 8 bytes, either
#: byte order. float128, bool, complex, datetime, strings, objects and records are
#: refused from the header. Integer scores must also be exact in float64 (the core's rule).
NPY_DTYPES = re.compile(r"[<>|=]?(?:f[248]|[iu][1248])")
#: What a refused .npy descr holds, by its type letter (for the message).
_DTYPE_NAMES = {
    "O": " (Python objects: never unpickled)",
    "b": " (bool)",
    "?": " (bool)",
    "c": " (complex)",
    "M": " (datetime64)",
    "m": " (timedelta64)",
    "U": " (strings)",
    "S": " (bytes)",
    "a": " (bytes)",
    "V": " (raw bytes or records)",
    "f": " (a float wider than 64 bits, or no float)",
    "i": " (not an integer size)",
    "u": " (not an integer size)",
}
#: Bytes of data a score in a .npy can take (the widest accepted dtype).
MAX_ITEMSIZE = 8

#: ``?dtype=`` of the binary bodies (:data:`service.vocabulary.SCORE_DTYPES`): scores
#: numpy has no dtype for, sent as their raw 16-bit patterns. ``bfloat16``
#: (torch.bfloat16, ml_dtypes.bfloat16: the top half of a float32) arrives as a
#: little-endian 2-byte .npy: ``<u2`` or ``<i2`` (torch: ``t.view(torch.int16).numpy()``)
#: or ``|V2`` (what ``np.save`` writes for an ``ml_dtypes.bfloat16`` array).
_BFLOAT16_DESCRS = re.compile(r"(?:[<=|]?[ui]2|[<|]V2)")

#: Zip entries a .npz may list, and bytes its central directory may take; checked from
#: its end record, before zipfile reads them (zipfile reads the whole directory into
#: memory and builds an object per entry it finds there, whatever the count says).
MAX_NPZ_MEMBERS = 64
MAX_CENTRAL_DIRECTORY = 64 * 1024
_ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_CHUNK = 1 << 20

#: A JSON body may take this many bytes per number and per row, plus a constant:
#: enough for any float64 written by json.dumps, indented or not.
JSON_BYTES_PER_VALUE = 48
JSON_BYTES_PER_ROW = 64
JSON_BYTES_CONSTANT = 64 * 1024
#: JSON number arrays are parsed in groups of about this many bytes; bodies up to this
#: size are parsed by orjson in one go (their Python objects are a constant).
_JSON_GROUP_BYTES = 1 << 20


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
    rows = getattr(settings, _ROW_SETTINGS[what])
    return Bounds(num_classes, model, rows, settings.max_body_bytes, what, dtype)


@dataclass(frozen=True)
class Labelled:
    scores: np.ndarray  # (N, K) float32 or float64, validated
    labels: np.ndarray  # (N,) int64 in [0, K)
    kind: str


# ---------------------------------------------------------------------------
# validation shared by every format


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


def every_row_a_distribution(arr: np.ndarray) -> bool:
    """True when every row of validated scores is non-negative and sums to 1 within
    :data:`PROBABILITY_LIKE_TOLERANCE` (checked in row chunks; stops at the first row
    that is not)."""
    n, k = arr.shape
    if n and abs(arr[0].sum(dtype=np.float64) - 1.0) > PROBABILITY_LIKE_TOLERANCE:
        return False  # most logits: decided by the first row's sum
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


# ---------------------------------------------------------------------------
# .npy


#: dtypes the validation keeps without a copy.
_UNCONVERTED = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class NpyHeader:
    """A parsed, checked .npy header; the data start at ``offset``."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    offset: int
    #: The 2-byte data are bfloat16 bit patterns (``?dtype=bfloat16``), whatever ``dtype``.
    bfloat16: bool = False

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    @property
    def widened(self) -> bool:
        """float16 and bfloat16 data are widened to float32 while they are read (exactly:
        both are subsets of float32), never held at their own width."""
        return self.bfloat16 or (self.dtype.kind == "f" and self.dtype.itemsize == 2)

    @property
    def decoded_nbytes(self) -> int:
        """Bytes of the array once validated: float32 stays float32, float16 and bfloat16
        become float32, the rest float64 (scores) or int64 (labels), so an int8 array
        takes 8 times its data."""
        return self.count * (4 if self.dtype == np.float32 or self.widened else 8)

    @property
    def memory(self) -> int:
        """Bytes the array costs at most: its data, and the validated copy unless it is
        already a C-ordered native float32 or float64 array (used as it is). Widened data
        are their float32 array only (and a C-ordered copy of a Fortran-ordered one)."""
        fortran = self.fortran and len(self.shape) > 1
        if self.widened:
            return self.decoded_nbytes * (2 if fortran else 1)
        kept = self.dtype in _UNCONVERTED and not fortran
        return self.nbytes + (0 if kept else self.decoded_nbytes)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_npy_header(
    head: bytes | bytearray, what: str, score_dtype: str | None = None
) -> NpyHeader | None:
    """The header of a .npy starting at ``head[0]``; None while ``head`` is too short to
    hold all of it. 400 for anything numpy would not write; 422 for a dtype of another
    kind than :data:`NPY_DTYPES`, or with ``score_dtype="bfloat16"`` than 16-bit little-
    endian patterns."""
    if head[:6] != _NPY_MAGIC[: len(head)]:
        raise MalformedBody(f"{what} is not a .npy array: it does not start with '\\x93NUMPY'.")
    if len(head) < 8:
        return None
    version = (head[6], head[7])
    if version == (1, 0):
        size_bytes = 2
    elif version in ((2, 0), (3, 0)):
        size_bytes = 4
    else:
        raise MalformedBody(f"{what} has .npy format version {version}; 1.0, 2.0 and 3.0 exist.")
    if len(head) < 8 + size_bytes:
        return None
    length = int.from_bytes(head[8 : 8 + size_bytes], "little")
    if length > MAX_NPY_HEADER:
        raise MalformedBody(
            f"{what} declares a .npy header of {length} bytes; at most {MAX_NPY_HEADER}."
        )
    offset = 8 + size_bytes + length
    if len(head) < offset:
        return None
    try:
        text = bytes(head[8 + size_bytes : offset]).decode("utf-8" if version[0] == 3 else "latin1")
        fields = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise MalformedBody(f"{what} has an unreadable .npy header: {_short(exc)}.") from None
    if not isinstance(fields, dict) or set(fields) != {"descr", "fortran_order", "shape"}:
        raise MalformedBody(
            f"{what} has a .npy header that is not a dict of descr, fortran_order and shape. "
            f"Got {_short(fields)}."
        )
    shape = fields["shape"]
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedBody(
            f"{what} declares shape {_short(shape)}: a .npy shape is a tuple of non-negative "
            "integers."
        )
    if type(fields["fortran_order"]) is not bool:
        raise MalformedBody(
            f"{what} has fortran_order {_short(fields['fortran_order'])}; a bool was expected."
        )
    descr = fields["descr"]
    if score_dtype == "bfloat16":
        if not isinstance(descr, str) or not _BFLOAT16_DESCRS.fullmatch(descr):
            raise InvalidInput(
                f"{what}: ?dtype=bfloat16 reads the raw 16-bit patterns of bfloat16 scores, "
                "a little-endian 2-byte array (<u2, <i2 or |V2, as np.save writes an "
                f"ml_dtypes.bfloat16 array). Got dtype {_short(descr)}."
            )
        return NpyHeader(shape, np.dtype(descr), fields["fortran_order"], offset, True)
    if not isinstance(descr, str) or not NPY_DTYPES.fullmatch(descr):
        name = _DTYPE_NAMES.get(descr.lstrip("<>|=")[:1], "") if isinstance(descr, str) else ""
        hint = (
            " For bfloat16 scores, add ?dtype=bfloat16."
            if isinstance(descr, str) and descr.lstrip("<>|=") == "V2"
            else ""
        )
        raise InvalidInput(
            f"{what} must hold float16, float32, float64 or 8- to 64-bit integers (or "
            f"bfloat16 with ?dtype=bfloat16). Got dtype {_short(descr)}"
            f"{name or ' (records)'}.{hint}"
        )
    return NpyHeader(shape, np.dtype(descr), fields["fortran_order"], offset)


def _widen(src: np.ndarray, out: np.ndarray, bfloat16: bool) -> None:
    """float16 values, or bfloat16 bit patterns (uint16), into float32 ``out``, exactly."""
    if bfloat16:  # a bfloat16 is the high half of the float32 of the same value
        np.left_shift(src, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = src


class NpyStream:
    """A .npy decoded from chunks: :meth:`feed` them, then :meth:`finish`.

    ``check(header)`` runs once the header is complete and before the data are
    allocated (it raises to refuse the shape); the data then fill one array of the
    declared size. A byte more than declared is a 400 at once; fewer at
    :meth:`finish`. float16 and bfloat16 (``score_dtype``, :data:`SCORE_DTYPES`) data
    are widened to float32 as they arrive, a slice of :data:`_CHUNK` bytes at a time.
    Memory: the array, plus at most one chunk.
    """

    def __init__(
        self,
        what: str,
        check: Callable[[NpyHeader], None],
        header: NpyHeader | None = None,
        score_dtype: str | None = None,
    ):
        self.what = what
        self.check = check
        self.score_dtype = score_dtype
        self.header: NpyHeader | None = None
        self._head = bytearray()
        self._array: np.ndarray | None = None
        self._bytes: memoryview | None = None
        self._filled = 0
        self._source: np.dtype | None = None  # the 2-byte dtype of widened data
        self._carry = b""  # a widened value's first byte, when a chunk splits it
        if header is not None:  # parsed (and checked) by the caller
            self._start(header)

    def _start(self, header: NpyHeader) -> None:
        self.check(header)
        self.header = header
        if header.widened:
            self._array = np.empty(header.count, dtype=np.float32)
            self._source = np.dtype("<u2") if header.bfloat16 else header.dtype
            return
        self._array = np.empty(header.count, dtype=header.dtype)
        self._bytes = memoryview(self._array.view(np.uint8)).cast("B")

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        if self.header is not None:
            self._write(chunk)
            return
        self._head += chunk
        header = parse_npy_header(self._head, self.what, self.score_dtype)
        if header is None:
            return
        self._start(header)
        rest = bytes(self._head[header.offset :])
        self._head = bytearray()
        self._write(rest)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not n:
            return
        end = self._filled + n
        if end > self.header.nbytes:
            raise MalformedBody(
                f"{self.what} holds more bytes than its .npy header declares "
                f"({self.header.nbytes} bytes of data for shape {self.header.shape})."
            )
        if self._source is not None:
            self._widen(data)
        else:
            self._bytes[self._filled : end] = data
        self._filled = end

    def _widen(self, data: bytes | bytearray | memoryview) -> None:
        data = memoryview(data).cast("B")
        at = self._filled // 2  # the first value not yet written
        if self._carry:
            pair = np.frombuffer(self._carry + bytes(data[:1]), self._source)
            _widen(pair, self._array[at : at + 1], self.header.bfloat16)
            data, at, self._carry = data[1:], at + 1, b""
        for start in range(0, len(data) - 1, _CHUNK):
            piece = data[start : min(start + _CHUNK, len(data) - len(data) % 2)]
            values = np.frombuffer(piece, self._source)
            _widen(values, self._array[at : at + len(values)], self.header.bfloat16)
            at += len(values)
        if len(data) % 2:
            self._carry = bytes(data[-1:])

    def finish(self) -> np.ndarray:
        """The array, in its declared shape and order (400 if short)."""
        header = self.header
        if header is None:
            raise MalformedBody(f"{self.what} ends before its .npy header does.")
        if self._filled < header.nbytes:
            raise MalformedBody(
                f"{self.what} is truncated: its header declares {header.nbytes} bytes of "
                f"data, got {self._filled}."
            )
        arr = self._array
        if header.fortran:
            return arr.reshape(header.shape[::-1]).T
        return arr.reshape(header.shape)


def _too_many_bytes(what: str, nbytes: int, limit: int) -> ContentTooLarge:
    return ContentTooLarge(
        f"{what} declares data that take {nbytes} bytes once read and converted (float16 "
        "and bfloat16 to float32, anything but float32 to float64); a request may hold at most "
        f"{limit} (WELLTEMPERED_MAX_BODY_BYTES).",
        max_bytes=limit,
    )


def check_scores_header(header: NpyHeader, bounds: Bounds, what: str) -> None:
    """Shape (N, K) with K the model's, N within the row limit, data within the byte limit."""
    shape = header.shape
    if len(shape) != 2:
        raise InvalidInput(
            f"{what} must be a 2-D array of shape (n_samples, n_classes). Got shape {shape}."
        )
    if shape[1] != bounds.num_classes:
        raise InvalidInput(
            f"{what} must have {bounds.num_classes} columns, one per class of model "
            f"{bounds.model!r}. Got shape {shape}."
        )
    bounds.check_rows(shape[0])
    if header.memory > bounds.max_bytes:
        raise _too_many_bytes(what, header.memory, bounds.max_bytes)


def npy_check(bounds: Bounds, what: str = "The .npy body") -> Callable[[NpyHeader], None]:
    """The header check of a .npy predict body."""
    return lambda header: check_scores_header(header, bounds, what)


def npy_body_limit(bounds: Bounds, max_body_bytes: int) -> int:
    """Largest .npy body the rows and K of ``bounds`` can need (and the body limit)."""
    need = NPY_PREFIX_MAX + bounds.max_rows * bounds.num_classes * MAX_ITEMSIZE
    return min(max_body_bytes, need)


def scores_from_npy(arr: np.ndarray, bounds: Bounds, kind: str | None) -> tuple[np.ndarray, str]:
    """A decoded .npy body (predict, :class:`NpyStream` with :func:`npy_check`): (N, K)
    scores, and their kind: ``?kind=`` or logits (checked not to look like probabilities)."""
    explicit = kind is not None
    kind = kind or "logits"
    scores = validated_scores(arr, kind, bounds.num_classes, bounds.model)
    check_not_probabilities(scores, kind, explicit, "Add ?kind=probabilities.")
    return scores, kind


# ---------------------------------------------------------------------------
# .npz


def _zip_directory(f, what: str) -> tuple[int, int]:
    """Entries and central-directory bytes the zip's end record declares (zip64 included),
    read from the last 64 KiB."""
    size = f.seek(0, io.SEEK_END)
    tail_size = min(size, 22 + 65_535)
    f.seek(size - tail_size)
    tail = f.read(tail_size)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise MalformedBody(f"{what} is not a .npz (zip) archive: no end of central directory.")
    entries, size = struct.unpack("<HI", tail[at + 10 : at + 16])
    locator = at - 20
    if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":
        record = size - tail_size + locator - 56
        if record < 0:
            raise MalformedBody(f"{what} has a zip64 locator but no zip64 end record.")
        f.seek(record)
        data = f.read(56)
        if len(data) < 56 or data[:4] != b"PK\x06\x06":
            raise MalformedBody(f"{what} has a zip64 locator but no zip64 end record.")
        entries, size = struct.unpack("<QQ", data[32:48])
    return entries, size


_ZIP_ERRORS = (
    ValueError,
    OSError,
    EOFError,
    zipfile.BadZipFile,
    zlib.error,
    KeyError,
    NotImplementedError,
    RuntimeError,
    struct.error,
    OverflowError,
)


def _open_npz(path: Path, what: str) -> zipfile.ZipFile:
    with open(path, "rb") as f:
        entries, size = _zip_directory(f, what)
    if entries > MAX_NPZ_MEMBERS:
        raise InvalidInput(f"{what} lists {entries} entries; at most {MAX_NPZ_MEMBERS}.")
    if size > MAX_CENTRAL_DIRECTORY:
        raise InvalidInput(
            f"{what} has a zip central directory of {size} bytes; at most {MAX_CENTRAL_DIRECTORY}."
        )
    try:
        zf = zipfile.ZipFile(path)
    except _ZIP_ERRORS as exc:
        raise MalformedBody(f"{what} is not a .npz (zip) archive: {_short(exc)}.") from None
    if len(zf.infolist()) > MAX_NPZ_MEMBERS:
        zf.close()
        raise InvalidInput(f"{what} holds {len(zf.infolist())} entries; at most {MAX_NPZ_MEMBERS}.")
    return zf


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, what: str):
    if info.flag_bits & 0x41:  # traditional or strong encryption
        raise InvalidInput(f"{what} is encrypted; send the arrays unencrypted.")
    if info.compress_type not in _ZIP_METHODS:
        raise InvalidInput(
            f"{what} is compressed with zip method {info.compress_type}; only stored "
            "(np.savez) and deflate (np.savez_compressed) members are read."
        )
    try:
        return zf.open(info)
    except _ZIP_ERRORS as exc:
        raise MalformedBody(f"{what} cannot be read: {_short(exc)}.") from None


def _read_member_header(fp, what: str, score_dtype: str | None = None) -> tuple[NpyHeader, bytes]:
    """The member's .npy header (inflating at most a few KiB past it), and the bytes read
    past it."""
    head = bytearray()
    while (header := parse_npy_header(head, what, score_dtype)) is None:
        chunk = fp.read(4096)
        if not chunk:
            raise MalformedBody(f"{what} ends before its .npy header does.")
        head += chunk
    return header, bytes(head[header.offset :])


def _check_member_size(info: zipfile.ZipInfo, header: NpyHeader, what: str) -> None:
    """400 unless the member's size in the zip is its header's plus the data it declares."""
    if info.file_size != header.offset + header.nbytes:
        raise MalformedBody(
            f"{what} is {info.file_size} bytes long once inflated, but its .npy header "
            f"declares {header.offset + header.nbytes}."
        )


def _read_member_data(fp, header: NpyHeader, read: bytes, what: str) -> np.ndarray:
    """The data of a checked header: inflated chunk by chunk into one array, never more
    bytes than the header declares."""
    stream = NpyStream(what, lambda header: None, header)
    stream.feed(read)
    while chunk := fp.read(_CHUNK):
        stream.feed(chunk)
    return stream.finish()


def labelled_from_npz(path: Path, bounds: Bounds, kind: str | None = None) -> Labelled:
    """A ``.npz`` holding ``logits`` | ``probabilities`` | ``predictions`` and ``labels`` |
    ``ground_truth``. Both headers are checked against ``bounds`` before a byte of data
    is inflated; ``kind`` (``?kind=``) must agree with the member's name."""
    what = "The .npz body"
    zf = _open_npz(path, what)
    with zf:
        members: dict[str, zipfile.ZipInfo] = {}
        for info in zf.infolist():
            name = info.filename.removesuffix(".npy")
            if name in members:
                raise MalformedBody(f"{what} holds the array {name!r} twice.")
            members[name] = info
        score_names = [k for k in SCORE_KEYS if k in members]
        label_names = [k for k in LABEL_KEYS if k in members]
        if len(score_names) != 1 or len(label_names) != 1:
            raise InvalidInput(
                "The .npz must hold exactly one score array (logits, probabilities or "
                "predictions) and one label array (labels or ground_truth). "
                f"Got {_short(sorted(members))}."
            )
        score_name, label_name = score_names[0], label_names[0]
        kind, explicit = resolve_kind(kind, SCORE_KEYS[score_name], f"array {score_name!r}")
        try:
            with (
                _member(zf, members[score_name], f"array {score_name!r}") as fs,
                _member(zf, members[label_name], f"array {label_name!r}") as fl,
            ):
                s_what, l_what = f"array {score_name!r} of the .npz", f"array {label_name!r}"
                s_head, s_read = _read_member_header(fs, s_what, bounds.dtype)
                l_head, l_read = _read_member_header(fl, l_what)
                check_scores_header(s_head, bounds, s_what)
                if l_head.shape != s_head.shape[:1]:
                    raise InvalidInput(
                        f"labels must be a 1-D array with one entry per row of the scores "
                        f"({s_head.shape[0]}). Got shape {l_head.shape}."
                    )
                total = s_head.memory + l_head.memory
                if total > bounds.max_bytes:
                    raise _too_many_bytes(what, total, bounds.max_bytes)
                _check_member_size(members[score_name], s_head, s_what)
                _check_member_size(members[label_name], l_head, l_what)
                scores = _read_member_data(fs, s_head, s_read, s_what)
                labels = _read_member_data(fl, l_head, l_read, l_what)
        except _ZIP_ERRORS as exc:  # CRC errors, bad compressed data...
            raise MalformedBody(f"{what} is corrupt: {_short(exc)}.") from None
    data = validated(scores, labels, kind, bounds.num_classes, bounds.model)
    check_not_probabilities(
        data.scores, kind, explicit, "Name the array 'probabilities' in the .npz."
    )
    return data


# ---------------------------------------------------------------------------
# JSON


def json_body_limit(bounds: Bounds, max_json_bytes: int) -> int:
    """Largest JSON body the rows and K of ``bounds`` can need (and the JSON limit)."""
    per_row = bounds.num_classes * JSON_BYTES_PER_VALUE + JSON_BYTES_PER_ROW
    return min(max_json_bytes, JSON_BYTES_CONSTANT + bounds.max_rows * per_row)


def _count(body, byte: bytes, start: int = 0, end: int | None = None) -> int:
    """``body.count(byte, start, end)``, for a memory map too (which has no ``count``)."""
    end = len(body) if end is None else end
    if not isinstance(body, mmap.mmap):
        return body.count(byte, start, end)
    view = np.frombuffer(body, np.uint8)
    value = byte[0]
    total = sum(
        int(np.count_nonzero(view[at : min(at + _CHUNK, end)] == value))
        for at in range(start, end, _CHUNK)
    )
    del view
    return total


def _loads(body) -> Any:
    if isinstance(body, mmap.mmap):
        with memoryview(body) as view:
            return orjson.loads(view)
    return orjson.loads(body)


_NON_FINITE = (b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"Inf", b"-inf", b"-NaN")


def decode_json(body: bytes | bytearray | mmap.mmap) -> Any:
    try:
        return _loads(body)
    except orjson.JSONDecodeError as exc:
        at = exc.pos
        near = bytes(body[at : at + 9])
        if "infinity" in str(exc) or near.startswith(_NON_FINITE):
            raise InvalidInput(
                "Non-finite numbers are not allowed: JSON has no NaN or Infinity, and scores "
                f"must be finite. Got {near.decode('latin1')!r} near char {at}."
            ) from None
        raise MalformedJSON(f"The body is not valid JSON: {exc}.") from None


_WS = rb"[ \t\n\r]*"
_OPEN = re.compile(_WS + rb"\{" + _WS)
_KEY = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]{0,63})"' + _WS + rb":" + _WS)
_AFTER_VALUE = re.compile(_WS + rb"([,}])" + _WS)
_INTEGER = re.compile(rb"-?(?:0|[1-9][0-9]{0,17})(?![0-9.eE])")
_NUMERIC = re.compile(rb"[-+0-9.eE,\[\] \t\n\r]*")
_ROWS_END = re.compile(rb"\]" + _WS + rb"\]")
_SEPARATOR = re.compile(_WS + rb"," + _WS)
_SPACE = re.compile(_WS)
_LITERALS = re.compile(rb"true|false|null")


def _may_hold_literals(body) -> bool:
    """Whether ``true``, ``false`` or ``null`` occur in ``body``: numpy would read a true
    among numbers as 1.0, so their rows are checked item by item.

    Each literal has a ``u`` or an ``f``, and no JSON number does: two ``memchr`` scans
    rule them out in well under a microsecond for a 1 x 1,000 body, where the regular
    expression alone took three times as long as parsing it (bench/README.md).

    >>> _may_hold_literals(b'{"logits": [[1.5e-3, -2]]}'), _may_hold_literals(b'[true]')
    (False, True)
    """
    if body.find(b"u") < 0 and body.find(b"f") < 0:
        return False
    return _LITERALS.search(body) is not None


def _numbers(text: bytes) -> np.ndarray | None:
    """``text``, a JSON array, as float64; None unless it parses to numbers of one shape."""
    try:
        arr = np.asarray(orjson.loads(text), dtype=np.float64)
    except (orjson.JSONDecodeError, ValueError, TypeError):
        return None
    return arr


def _array_2d(body, start: int, end: int, bounds: Bounds) -> np.ndarray | None:
    """The rows between ``start`` (a row's '[') and ``end`` (after the last row's ']'),
    parsed in groups of rows into one preallocated (N, K) float64 array."""
    n = _count(body, b"[", start, end)
    bounds.check_rows(n)
    out = None
    filled = 0
    pos = start
    while pos < end:
        cut = body.find(b"]", min(pos + _JSON_GROUP_BYTES, end - 1), end)
        block = _numbers(b"[" + bytes(body[pos : cut + 1]) + b"]")
        if block is None or block.ndim != 2 or filled + len(block) > n:
            return None
        if out is None:
            out = np.empty((n, block.shape[1]))
        elif block.shape[1] != out.shape[1]:
            return None
        out[filled : filled + len(block)] = block
        filled += len(block)
        pos = cut + 1
        if pos < end:
            sep = _SEPARATOR.match(body, pos)
            if sep is None or body[sep.end() : sep.end() + 1] != b"[":
                return None
            pos = sep.end()
    return out if filled == n else None


def _array_1d(body, start: int, end: int, bounds: Bounds) -> np.ndarray | None:
    """The numbers between ``start`` and ``end`` (a 1-D array's ']'), in groups."""
    if body.find(b"[", start, end) >= 0:
        return None
    n = _count(body, b",", start, end) + 1
    bounds.check_rows(n)
    out = np.empty(n)
    filled = 0
    pos = start
    while pos < end:
        cut = body.find(b",", pos + _JSON_GROUP_BYTES, end)
        cut = end if cut < 0 else cut
        block = _numbers(b"[" + bytes(body[pos:cut]) + b"]")
        if block is None or block.ndim != 1 or filled + len(block) > n:
            return None
        out[filled : filled + len(block)] = block
        filled += len(block)
        pos = cut + 1
    return out if filled == n else None


def _array(body, pos: int, bounds: Bounds) -> tuple[np.ndarray, int] | None:
    """The number array whose '[' is at ``pos``, and the position after it; None unless it
    is a plain 1-D or 2-D array of numbers."""
    limit = _NUMERIC.match(body, pos + 1).end()
    inner = _SPACE.match(body, pos + 1).end()
    first = body[inner : inner + 1]
    if first == b"]":
        return np.empty(0), inner + 1
    if first == b"[":
        close = _ROWS_END.search(body, inner, limit)
        if close is None:
            return None
        arr = _array_2d(body, inner, close.start() + 1, bounds)
        return None if arr is None else (arr, close.end())
    close = body.find(b"]", inner, limit)
    if close < 0:
        return None
    arr = _array_1d(body, inner, close, bounds)
    return None if arr is None else (arr, close + 1)


def plain_object(body, allowed: set[str], bounds: Bounds) -> dict[str, Any] | None:
    """A JSON object of plain keys whose values are number arrays or integers, parsed
    without a Python object per number; None for anything else (:func:`json_object` then
    reads it with orjson). What it returns is what orjson's parse would give, with the
    arrays as float64 (bench/fuzz_parsers.py compares the two)."""
    m = _OPEN.match(body)
    if m is None:
        return None
    pos, out = m.end(), {}
    if body[pos : pos + 1] == b"}":
        return out if _SPACE.match(body, pos + 1).end() == len(body) else None
    while True:
        m = _KEY.match(body, pos)
        if m is None:
            return None
        key = m.group(1).decode()
        if key in out or key not in allowed:
            return None
        pos = m.end()
        if body[pos : pos + 1] == b"[":
            parsed = _array(body, pos, bounds)
            if parsed is None:
                return None
            out[key], pos = parsed
        else:
            m = _INTEGER.match(body, pos)
            if m is None:
                return None
            out[key], pos = int(m.group()), m.end()
        m = _AFTER_VALUE.match(body, pos)
        if m is None:
            return None
        pos = m.end()
        if m.group(1) == b"}":
            return out if pos == len(body) else None


def _quotes_only_in_keys(body, keys: int) -> bool:
    """Whether ``body``, a JSON object of ``keys`` keys, has no ``"`` but its keys' own
    (two each): then none of its values holds a string. One ``memchr`` per quote.

    >>> _quotes_only_in_keys(b'{"logits": [[1, 2]]}', 1), _quotes_only_in_keys(b'{"a": ["1"]}', 1)
    (True, False)
    """
    at = -1
    for _ in range(2 * keys + 1):
        at = body.find(b'"', at + 1)
        if at < 0:
            return True
    return False


def _only_numbers(key: str, value: Any, scan: bool, no_strings: bool = False) -> Any:
    """A parsed array of numbers as float64. true/false/null are looked for when ``scan``
    (a 422: numpy would read true as 1.0 next to a float); strings, ragged or nested
    arrays are left as they are, for the core's message.

    ``no_strings`` (the body holds none, :func:`_quotes_only_in_keys`) and no ``scan``:
    numbers and lists are all there is, and numpy converts them to float64 in one pass
    (what :func:`_numbers` does for large bodies), without first discovering a dtype:
    a third of the conversion's time for a 1 x 1,000 predict.
    """
    if not isinstance(value, list):
        return value
    if no_strings and not scan:
        try:
            return np.asarray(value, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):
            pass  # ragged, nested or out of range: the checks below word it
    for row in value if scan else ():
        items = row if isinstance(row, list) else (row,)
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int | float | list):
                raise InvalidInput(
                    f"{key} must be a numeric array: JSON numbers only (read as float64), "
                    f"no strings, true, false or null. Got {_short(item)}."
                )
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        return value
    return arr.astype(np.float64, copy=False) if arr.dtype.kind in "fiu" else value


def json_object(body: bytes | bytearray, allowed_keys: set[str], bounds: Bounds) -> dict:
    """The body as a JSON object with no keys but ``allowed_keys`` (400 if not JSON, else
    422); number arrays become float64 arrays, rows limited by ``bounds`` (413)."""
    if len(body) > _JSON_GROUP_BYTES:
        plain = plain_object(body, allowed_keys, bounds)
        if plain is not None:
            return plain
    # Small bodies, and anything else (escaped keys, other value types, errors): orjson,
    # once the body is known to hold no more numbers than the row limit allows.
    allowed = bounds.max_rows * (bounds.num_classes + 2) + 64
    # Every number takes a byte: a body no longer than that cannot hold too many, and
    # then its commas and brackets need no counting (a 1 x 1,000 predict, every time).
    values = 0 if len(body) <= allowed else _count(body, b",") + _count(body, b"[")
    if values > allowed:
        raise ContentTooLarge(
            f"The JSON body holds up to {values} numbers, more than {bounds.max_rows} rows of "
            f"{bounds.num_classes} classes can need (WELLTEMPERED_MAX_"
            f"{bounds.what.upper()}_ROWS); split it.",
            max_rows=bounds.max_rows,
        )
    obj = decode_json(body)
    if not isinstance(obj, dict):
        raise InvalidInput(f"The body must be a JSON object. Got a {type(obj).__name__}.")
    unknown = set(obj) - allowed_keys
    if unknown:
        raise InvalidInput(
            f"Unknown field(s) {_short(sorted(unknown))}; expected {sorted(allowed_keys)!r}."
        )
    scan = _may_hold_literals(body)
    plain = _quotes_only_in_keys(body, len(obj))
    return {k: _only_numbers(k, v, scan, plain) if k != "version" else v for k, v in obj.items()}


def score_key(obj: dict, allowed: tuple[str, ...]) -> str:
    """The one key of ``allowed`` that ``obj`` holds (422 for none or several)."""
    present = [k for k in allowed if k in obj]
    if len(present) != 1:
        raise InvalidInput(
            f"The body must hold exactly one of {', '.join(map(repr, allowed))}. "
            f"Got {sorted(obj)!r}."
        )
    return present[0]


_JSON_FIX = "Send them under the key 'probabilities'."


def _json_scores(obj: dict, bounds: Bounds, kind: str | None) -> tuple[np.ndarray, str, bool]:
    if bounds.dtype is not None:
        raise InvalidInput(
            f"?dtype={bounds.dtype} says how a binary body's raw scores are read; a JSON body "
            "holds numbers. Drop ?dtype, or send a .npy/.npz."
        )
    key = score_key(obj, JSON_SCORE_KEYS)
    kind, explicit = resolve_kind(kind, key, f"key {key!r}")
    scores = validated_scores(obj[key], kind, bounds.num_classes, bounds.model)
    bounds.check_rows(scores.shape[0])
    return scores, kind, explicit


def scores_from_json(
    body: bytes | bytearray, bounds: Bounds, kind: str | None = None
) -> tuple[np.ndarray, str]:
    """``{"logits" | "probabilities": [[...]]}`` for predict."""
    obj = json_object(body, set(JSON_SCORE_KEYS), bounds)
    scores, kind, explicit = _json_scores(obj, bounds, kind)
    check_not_probabilities(scores, kind, explicit, _JSON_FIX)
    return scores, kind


def labelled_from_json(
    body: bytes | bytearray,
    bounds: Bounds,
    kind: str | None = None,
    extra_keys: tuple[str, ...] = (),
) -> tuple[Labelled, dict[str, Any]]:
    """``{"logits" | "probabilities": [[...]], "labels": [...], <extra_keys>?}``: the
    validated rows, and the values of ``extra_keys`` the body holds."""
    obj = json_object(body, {*JSON_SCORE_KEYS, "labels", *extra_keys}, bounds)
    if "labels" not in obj:
        score_key(obj, JSON_SCORE_KEYS)
        raise InvalidInput("The body must hold 'labels', one class index per row.")
    scores, kind, explicit = _json_scores(obj, bounds, kind)
    labels = as_labels(obj["labels"], scores.shape[0], scores.shape[1])
    check_not_probabilities(scores, kind, explicit, _JSON_FIX)
    return Labelled(scores, labels, kind), {k: obj[k] for k in extra_keys if k in obj}


# ---------------------------------------------------------------------------
# answers


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def npy_header(arr: np.ndarray) -> bytes:
    """The .npy header of a C-contiguous ``arr`` (format 1.0, or 2.0 as np.save picks for
    huge shapes)."""
    fields = np.lib.format.header_data_from_array_1_0(arr)
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, fields)
    except ValueError:
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, fields)
    return head.getvalue()


def npy_chunks(arr: np.ndarray) -> tuple[int, Iterator[bytes | memoryview]]:
    """``arr`` as a .npy file: its size, and its bytes as the header then views of the
    data of at most :data:`_CHUNK` bytes (no copy of the data: for big answers)."""
    arr = np.ascontiguousarray(arr)
    return byte_chunks(npy_header(arr), [arr])


def byte_chunks(
    head: bytes, arrays: list[np.ndarray]
) -> tuple[int, Iterator[bytes | memoryview]]:
    """``head`` followed by the little-endian bytes of each array in row-major order: the
    total size, and the bytes as ``head`` then views of the arrays' data of at most
    :data:`_CHUNK` bytes each (no copy of a little-endian C-contiguous array: for big
    answers, a .npy or the Open Inference Protocol's binary tensors)."""
    data = [
        memoryview(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
        for a in arrays
    ]

    def chunks() -> Iterator[bytes | memoryview]:
        yield head
        for view in data:
            for at in range(0, len(view), _CHUNK):
                yield view[at : at + _CHUNK]

    return len(head) + sum(len(view) for view in data), chunks()


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
