""".npy bodies: decoded while they arrive, bounded before their data are allocated;
and .npy answers, encoded without a copy.

A ``.npy`` header is parsed here, not by numpy: at most :data:`MAX_NPY_HEADER`
bytes, a shape of non-negative Python ints (no bool), a dtype of
:data:`NPY_DTYPES`. The shape is checked against the model's K, the row limit and
the byte limit (:class:`~service.api.codecs.rules.Bounds`) *before* the data are
allocated; the data then fill one preallocated array, chunk by chunk
(:class:`NpyStream`), and a byte past the declared size is an error (docs/api.md,
"Body formats"). Pure: no web framework.
"""

from __future__ import annotations

import ast
import io
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from service.api.codecs.rules import (
    CHUNK_BYTES,
    Bounds,
    check_not_probabilities,
    shorten,
    too_many_bytes,
    validated_scores,
)
from service.errors import InvalidInput, MalformedBody

#: numpy refuses longer .npy headers too (``max_header_size``).
MAX_NPY_HEADER = 10_000

#: Bytes of a .npy before its data, at most (magic, version, length, header).
NPY_PREFIX_MAX = 12 + MAX_NPY_HEADER

NPY_MAGIC = b"\x93NUMPY"

#: .npy dtypes a body may hold: real floats and integers of at most 8 bytes, either
#: byte order. float128, bool, complex, datetime, strings, objects and records are
#: refused from the header. Integer scores must also be exact in float64 (the core's rule).
NPY_DTYPES = re.compile(r"[<>|=]?(?:f[248]|[iu][1248])")

#: .npy dtypes of a dataset's sequence ids (``ids=True``): integers, or unicode strings
#: (``<U``, what ``np.savez`` writes for Python str; bytes and objects are refused).
SEQUENCE_DTYPES = re.compile(r"[<>|=]?(?:[iu][1248]|U[1-9][0-9]{0,8})")

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
        become float32, the rest float64 (scores) or int64 (labels and integer sequence
        ids), so an int8 array takes 8 times its data; strings (sequence ids) at most
        their own bytes."""
        if self.dtype.kind == "U":
            return self.nbytes
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


def parse_npy_header(
    head: bytes | bytearray, what: str, score_dtype: str | None = None, *, ids: bool = False
) -> NpyHeader | None:
    """The header of a .npy starting at ``head[0]``; None while ``head`` is too short to
    hold all of it. 400 for anything numpy would not write; 422 for a dtype of another
    kind than :data:`NPY_DTYPES` (with ``ids``, :data:`SEQUENCE_DTYPES`), or with
    ``score_dtype="bfloat16"`` than 16-bit little-endian patterns."""
    if head[:6] != NPY_MAGIC[: len(head)]:
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
        raise MalformedBody(f"{what} has an unreadable .npy header: {shorten(exc)}.") from None
    if not isinstance(fields, dict) or set(fields) != {"descr", "fortran_order", "shape"}:
        raise MalformedBody(
            f"{what} has a .npy header that is not a dict of descr, fortran_order and shape. "
            f"Got {shorten(fields)}."
        )
    shape = fields["shape"]
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedBody(
            f"{what} declares shape {shorten(shape)}: a .npy shape is a tuple of non-negative "
            "integers."
        )
    if type(fields["fortran_order"]) is not bool:
        raise MalformedBody(
            f"{what} has fortran_order {shorten(fields['fortran_order'])}; a bool was expected."
        )
    descr = fields["descr"]
    if ids:
        if not isinstance(descr, str) or not SEQUENCE_DTYPES.fullmatch(descr):
            raise InvalidInput(
                f"{what} must hold 8- to 64-bit integers or unicode strings (<U, numpy's "
                f"str arrays). Got dtype {shorten(descr)}."
            )
        return NpyHeader(shape, np.dtype(descr), fields["fortran_order"], offset)
    if score_dtype == "bfloat16":
        if not isinstance(descr, str) or not _BFLOAT16_DESCRS.fullmatch(descr):
            raise InvalidInput(
                f"{what}: ?dtype=bfloat16 reads the raw 16-bit patterns of bfloat16 scores, "
                "a little-endian 2-byte array (<u2, <i2 or |V2, as np.save writes an "
                f"ml_dtypes.bfloat16 array). Got dtype {shorten(descr)}."
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
            f"bfloat16 with ?dtype=bfloat16). Got dtype {shorten(descr)}"
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
    are widened to float32 as they arrive, a slice of :data:`CHUNK_BYTES` bytes at a time.
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
        for start in range(0, len(data) - 1, CHUNK_BYTES):
            piece = data[start : min(start + CHUNK_BYTES, len(data) - len(data) % 2)]
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
        raise too_many_bytes(what, header.memory, bounds.max_bytes)


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


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def npy_header(arr: np.ndarray) -> bytes:
    """The .npy header of a C-contiguous ``arr`` (format 1.0, or 2.0 as np.save picks for
    huge shapes)."""
    return _header_bytes(np.lib.format.header_data_from_array_1_0(arr))


def npy_header_for(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The .npy header ``np.save`` writes for a C-ordered array of ``shape`` and ``dtype``
    (without one)."""
    return _header_bytes({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                          "fortran_order": False, "shape": tuple(shape)})


def _header_bytes(fields: dict) -> bytes:
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, fields)
    except ValueError:
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, fields)
    return head.getvalue()


def npy_chunks(arr: np.ndarray) -> tuple[int, Iterator[bytes | memoryview]]:
    """``arr`` as a .npy file: its size, and its bytes as the header then views of the
    data of at most :data:`CHUNK_BYTES` bytes (no copy of the data: for big answers)."""
    arr = np.ascontiguousarray(arr)
    return byte_chunks(npy_header(arr), [arr])


def byte_chunks(
    head: bytes, arrays: list[np.ndarray]
) -> tuple[int, Iterator[bytes | memoryview]]:
    """``head`` followed by the little-endian bytes of each array in row-major order: the
    total size, and the bytes as ``head`` then views of the arrays' data of at most
    :data:`CHUNK_BYTES` bytes each (no copy of a little-endian C-contiguous array: for big
    answers, a .npy or the Open Inference Protocol's binary tensors)."""
    data = [
        memoryview(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
        for a in arrays
    ]

    def chunks() -> Iterator[bytes | memoryview]:
        yield head
        for view in data:
            for at in range(0, len(view), CHUNK_BYTES):
                yield view[at : at + CHUNK_BYTES]

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
