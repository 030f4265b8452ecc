""".npz bodies (datasets, feedback), read from the file they were spooled to.

A ``.npz`` is a zip: its central directory is bounded (:data:`MAX_NPZ_MEMBERS`
entries) before :mod:`zipfile` reads it; only stored and deflated, unencrypted
members are read, each through :class:`~service.api.codecs.npy.NpyStream`, so a
member inflates to at most its declared size, checked while inflating. Pure: no
web framework.

A dataset's score member may arrive split off (:class:`MemberRouter`, :class:`NpzBody`):
an uncompressed zip member *is* a ``.npy`` file, so while the body streams in, the bytes
of the first stored score member go to a file of their own, hashed and CRC-summed as
they arrive, and the rest of the body to the spool file (a hole where the member was).
:func:`labelled_from_npz` reads such a body through a view that puts the two back
together (every check and every error as for one file), and when the member's CRC,
place and size agree with the central directory and its ``.npy`` header is the one
``np.save`` writes for the validated array, the scores are that file, memory-mapped,
and the store adopts it (:class:`~service.storage.arrays.Staged`) instead of copying
the array into memory and writing it out again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import struct
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from service.api.codecs.npy import (
    NPY_MAGIC,
    NpyHeader,
    NpyStream,
    check_scores_header,
    npy_header_for,
    parse_npy_header,
)
from service.api.codecs.rules import (
    CHUNK_BYTES,
    LABEL_KEYS,
    SCORE_KEYS,
    SEQUENCE_KEY,
    TOPK_KEYS,
    Bounds,
    Labelled,
    TopKRows,
    check_not_probabilities,
    resolve_kind,
    shorten,
    too_many_bytes,
    validated,
    validated_sequences,
    validated_topk,
)
from service.errors import InvalidInput, MalformedBody
from service.storage.arrays import Staged

#: Zip entries a .npz may list, and bytes its central directory may take; checked from
#: its end record, before zipfile reads them (zipfile reads the whole directory into
#: memory and builds an object per entry it finds there, whatever the count says).
MAX_NPZ_MEMBERS = 64

MAX_CENTRAL_DIRECTORY = 64 * 1024

_ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}

#: What a labelled body holds, for the error that meets a single array instead.
NPZ_MEMBERS = (
    f"a .npz (np.savez) with a score member ({' or '.join(SCORE_KEYS)}) and a label member "
    f"({' or '.join(LABEL_KEYS)})"
)


def _zip_directory(f, what: str) -> tuple[int, int]:
    """Entries and central-directory bytes the zip's end record declares (zip64 included),
    read from the last 64 KiB."""
    size = f.seek(0, io.SEEK_END)
    tail_size = min(size, 22 + 65_535)
    f.seek(size - tail_size)
    tail = f.read(tail_size)
    f.seek(0)
    if f.read(len(NPY_MAGIC)) == NPY_MAGIC:
        raise InvalidInput(
            f"{what} is a single .npy array; labelled rows are {NPZ_MEMBERS}, e.g. "
            "np.savez(f, logits=z, labels=y)."
        )
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


#: A zip local file header: signature, version, flags, method, time, date, CRC-32,
#: compressed and uncompressed sizes, name and extra lengths (then the name and extra).
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
#: Flag bits of a member the router leaves in the body: encrypted (0, 6), sizes in a data
#: descriptor after the data (3: the member's end is unknown while it streams).
_UNROUTED_FLAGS = 0x49
_ZIP64_EXTRA = 0x0001


@dataclass(frozen=True)
class Routed:
    """Where the router sent a member: its data's offset in the body and size (the local
    header's), and its name in the zip."""

    start: int
    size: int
    name: str


class MemberRouter:
    """Splits a ``.npz`` body as it streams: :meth:`feed` cuts each piece of the body into
    ``(to_member, bytes)`` runs, in order, where ``to_member`` marks the data of the first
    stored, unencrypted member named one of ``names`` (``logits`` or ``logits.npy``...)
    whose local header gives its size. Everything else (headers, other members, the
    central directory; the whole body once a member's size is unknown or the bytes are
    not a zip) is body. Pure: it only reads local headers, and decides nothing about the
    body's validity (the reader checks the member against the central directory)."""

    def __init__(self, names):
        self.names = {f"{n}{ext}".encode() for n in names for ext in ("", ".npy")}
        self.routed: Routed | None = None
        self._head = bytearray()  # a local header being read
        self._at = 0  # body bytes fed so far
        self._skip = 0  # data bytes of a passed member still to come
        self._member = 0  # data bytes of the routed member still to come
        self._done = False  # no local header is read any more

    def feed(self, data) -> list[tuple[bool, memoryview]]:
        view = memoryview(data).cast("B")
        out: list[tuple[bool, memoryview]] = []
        while view:
            if self._done:
                out.append((False, view))
                self._at += len(view)
                break
            if self._member or self._skip:
                n = min(self._member or self._skip, len(view))
                out.append((bool(self._member), view[:n]))
                if self._member:
                    self._member -= n
                    self._done = not self._member  # one member is routed, at most
                else:
                    self._skip -= n
                view, self._at = view[n:], self._at + n
                continue
            n = min(self._header_size() - len(self._head), len(view))
            self._head += view[:n]
            out.append((False, view[:n]))
            view, self._at = view[n:], self._at + n
            if len(self._head) < _LOCAL_HEADER.size:
                continue
            if _LOCAL_HEADER.unpack_from(self._head)[0] != _LOCAL_SIGNATURE:
                self._done = True  # the central directory, or not a zip: the rest is body
            elif len(self._head) == self._header_size():
                self._read_header()
        return out

    def _header_size(self) -> int:
        if len(self._head) < _LOCAL_HEADER.size:
            return _LOCAL_HEADER.size
        *_, name_length, extra_length = _LOCAL_HEADER.unpack_from(self._head)
        return _LOCAL_HEADER.size + name_length + extra_length

    def _read_header(self) -> None:
        head = self._head
        fields = _LOCAL_HEADER.unpack_from(head)
        _, _, flags, method, _, _, _, compressed, size, name_length, _ = fields
        name = bytes(head[_LOCAL_HEADER.size : _LOCAL_HEADER.size + name_length])
        compressed, size = _zip64_sizes(head[_LOCAL_HEADER.size + name_length :], compressed, size)
        self._head = bytearray()
        if flags & _UNROUTED_FLAGS or compressed is None:
            self._done = True
        elif (
            self.routed is None and method == zipfile.ZIP_STORED and compressed == size
            and size > 0 and name in self.names
        ):  # fmt: skip
            self.routed = Routed(self._at, size, name.decode("ascii"))
            self._member = size
        else:
            self._skip = compressed


def _zip64_sizes(extra, compressed: int, size: int) -> tuple[int | None, int]:
    """The sizes of a local header, from its zip64 extra field where they are 0xFFFFFFFF
    (None: the field is missing)."""
    if 0xFFFFFFFF not in (compressed, size):
        return compressed, size
    at = 0
    while at + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + length]
        if kind == _ZIP64_EXTRA:
            values = [int.from_bytes(body[i : i + 8], "little") for i in range(0, len(body) - 7, 8)]
            if size == 0xFFFFFFFF:
                if not values:
                    return None, size
                size = values.pop(0)
            if compressed == 0xFFFFFFFF:
                if not values:
                    return None, size
                compressed = values.pop(0)
            return compressed, size
        at += 4 + length
    return None, size


@dataclass(frozen=True)
class NpzBody:
    """A ``.npz`` body spooled split (:class:`MemberRouter`): ``path`` holds the body with a
    hole where the routed member's data were, ``member`` those data (``written`` bytes of
    the ``routed.size`` declared, their CRC-32 and sha256), ``size`` the body's bytes."""

    path: Path
    size: int
    routed: Routed | None = None
    member: Path | None = None
    written: int = 0
    crc32: int = 0
    sha256: str = ""

    def digest(self) -> str:
        """A sha256 that names the body's bytes without reading the member again: of the
        member's place, size and sha256 (taken as it arrived) and the spool file's bytes
        around it; the same body gives the same digest, any other body another. A body with
        nothing routed: the sha256 of its file."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            if self.routed is None:
                return hashlib.file_digest(f, "sha256").hexdigest()
            start, end = self.routed.start, self.routed.start + self.written
            h.update(f"split {start} {self.written} {self.sha256}\n".encode())
            for at, stop in ((0, start), (end, self.size)):
                f.seek(at)
                while at < stop and (chunk := f.read(min(CHUNK_BYTES, stop - at))):
                    h.update(chunk)
                    at += len(chunk)
        return h.hexdigest()

    def open(self) -> BinaryIO:
        """The body as one read-only, seekable file (the two parts spliced)."""
        if self.routed is None:
            return open(self.path, "rb")
        return io.BufferedReader(_Spliced(self), buffer_size=CHUNK_BYTES)


class _Spliced(io.RawIOBase):
    """The bytes of an :class:`NpzBody`: ``[start, start + written)`` from its member
    file, the rest from its spool file."""

    def __init__(self, body: NpzBody):
        self._size = body.size
        self._start = body.routed.start
        self._end = body.routed.start + body.written
        self._body = open(body.path, "rb", buffering=0)
        try:
            self._member = open(body.member, "rb", buffering=0)
        except BaseException:
            self._body.close()
            raise
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._size - self._pos)
        if n <= 0:
            return 0
        if self._start <= self._pos < self._end:
            f, at, n = self._member, self._pos - self._start, min(n, self._end - self._pos)
        else:
            f, at = self._body, self._pos
            if self._pos < self._start:
                n = min(n, self._start - self._pos)
        f.seek(at)
        got = f.readinto(view[:n]) or 0
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            self._body.close()
            self._member.close()
        super().close()


@contextmanager
def _body_file(body) -> Iterator[BinaryIO]:
    """The body as a file: a spooled one (a Path), a split one spliced back
    (:class:`NpzBody`), or one in memory (any buffer: bytes, a bytearray, the memory map
    of a body without a declared length)."""
    if isinstance(body, NpzBody):
        with body.open() as f:
            yield f
    elif isinstance(body, Path):
        with open(body, "rb") as f:
            yield f
    else:
        yield io.BytesIO(body)


def _routed_scores(
    body: Path | NpzBody, f: BinaryIO, info: zipfile.ZipInfo, header: NpyHeader
) -> Staged | None:
    """The routed score member as a file to store, when it is exactly what storing the
    validated array would write: all its bytes arrived, the central directory gives it
    the same place, size and CRC-32, stored and unencrypted, and its ``.npy`` header is
    the one ``np.save`` writes for a C-ordered little-endian float32 or float64 array of
    its shape (what validation keeps as it is). None: read it as any member."""
    if not isinstance(body, NpzBody) or body.routed is None:
        return None
    routed = body.routed
    if (
        body.written != routed.size or info.filename != routed.name
        or info.compress_type != zipfile.ZIP_STORED or info.flag_bits & _UNROUTED_FLAGS
        or not info.compress_size == info.file_size == routed.size or info.CRC != body.crc32
        or header.bfloat16 or header.fortran
        or header.dtype not in (np.dtype("<f4"), np.dtype("<f8"))
    ):  # fmt: skip
        return None
    f.seek(info.header_offset)
    local = f.read(_LOCAL_HEADER.size)
    if len(local) != _LOCAL_HEADER.size:
        return None
    *_, name_length, extra_length = _LOCAL_HEADER.unpack(local)
    if info.header_offset + _LOCAL_HEADER.size + name_length + extra_length != routed.start:
        return None
    expected = npy_header_for(header.shape, header.dtype)
    with open(body.member, "rb") as m:
        if m.read(len(expected)) != expected or len(expected) != header.offset:
            return None
    return Staged(body.member, body.sha256, body.written)


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


def _open_npz(f: BinaryIO, what: str) -> zipfile.ZipFile:
    entries, size = _zip_directory(f, what)
    if entries > MAX_NPZ_MEMBERS:
        raise InvalidInput(f"{what} lists {entries} entries; at most {MAX_NPZ_MEMBERS}.")
    if size > MAX_CENTRAL_DIRECTORY:
        raise InvalidInput(
            f"{what} has a zip central directory of {size} bytes; at most {MAX_CENTRAL_DIRECTORY}."
        )
    try:
        zf = zipfile.ZipFile(f)
    except _ZIP_ERRORS as exc:
        raise MalformedBody(f"{what} is not a .npz (zip) archive: {shorten(exc)}.") from None
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
        raise MalformedBody(f"{what} cannot be read: {shorten(exc)}.") from None


def _read_member_header(
    fp, what: str, score_dtype: str | None = None, *, ids: bool = False
) -> tuple[NpyHeader, bytes]:
    """The member's .npy header (inflating at most a few KiB past it), and the bytes read
    past it."""
    head = bytearray()
    while (header := parse_npy_header(head, what, score_dtype, ids=ids)) is None:
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
    while chunk := fp.read(CHUNK_BYTES):
        stream.feed(chunk)
    return stream.finish()


def _members(zf: zipfile.ZipFile, what: str) -> dict[str, zipfile.ZipInfo]:
    members: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        name = info.filename.removesuffix(".npy")
        if name in members:
            raise MalformedBody(f"{what} holds the array {name!r} twice.")
        members[name] = info
    return members


def labelled_from_npz(
    body: Path | NpzBody, bounds: Bounds, kind: str | None = None
) -> Labelled | TopKRows:
    """A ``.npz`` holding ``logits`` | ``probabilities`` | ``predictions`` and ``labels`` |
    ``ground_truth`` (and, where ``bounds.sequences``, optionally ``sequence_ids``; where
    ``bounds.unlabelled``, the labels may be left out). Every header is checked against
    ``bounds`` before a byte of data is inflated; ``kind`` (``?kind=``) must agree with
    the member's name. ``body``: the spooled file, or a body spooled split
    (:class:`NpzBody`), whose routed score member, when it is what would be stored,
    becomes the scores memory-mapped and :attr:`Labelled.scores_file`. Where
    ``bounds.topk``, a ``.npz`` of top-k rows instead (:func:`topk_from_npz`)."""
    what = "The .npz body"
    with _body_file(body) as f:
        zf = _open_npz(f, what)
        with zf:
            members = _members(zf, what)
            if bounds.topk and any(m in members for m in TOPK_KEYS):
                if kind is not None:
                    raise InvalidInput(
                        f"?kind={kind} is for full scores; top-k rows are log-probabilities. "
                        "Drop ?kind."
                    )
                return _topk_members(zf, members, bounds, labelled=True)
            scores, labels, sequences, kind, explicit, staged = _read_npz(
                zf, members, f, body, bounds, kind, what
            )
    data = validated(scores, labels, kind, bounds.num_classes, bounds.model)
    check_not_probabilities(
        data.scores, kind, explicit, "Name the array 'probabilities' in the .npz."
    )
    return dataclasses.replace(data, sequences=sequences, scores_file=staged)


def _read_npz(zf: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], f: BinaryIO,
              body: Path | NpzBody, bounds: Bounds, kind: str | None, what: str):  # fmt: skip
    score_names = [k for k in SCORE_KEYS if k in members]
    label_names = [k for k in LABEL_KEYS if k in members]
    label_counts = (0, 1) if bounds.unlabelled else (1,)
    if len(score_names) != 1 or len(label_names) not in label_counts:
        labels_rule = "at most one" if bounds.unlabelled else "one"
        raise InvalidInput(
            "The .npz must hold exactly one score array (logits, probabilities or "
            f"predictions) and {labels_rule} label array (labels or ground_truth). "
            f"Got {shorten(sorted(members))}."
        )
    score_name = score_names[0]
    kind, explicit = resolve_kind(kind, SCORE_KEYS[score_name], f"array {score_name!r}")
    staged = None
    try:
        with _member(zf, members[score_name], f"array {score_name!r}") as fs:
            s_what = f"array {score_name!r} of the .npz"
            s_head, s_read = _read_member_header(fs, s_what, bounds.dtype)
            check_scores_header(s_head, bounds, s_what)
            total = s_head.memory
            if total > bounds.max_bytes:
                raise too_many_bytes(what, total, bounds.max_bytes)
            _check_member_size(members[score_name], s_head, s_what)
            labels = None
            if label_names:
                labels, total = _read_labels(zf, members[label_names[0]], label_names[0],
                                             s_head.shape[0], total, bounds.max_bytes)
            staged = _routed_scores(body, f, members[score_name], s_head)
            if staged is not None:
                scores = np.load(staged.path, mmap_mode="r", allow_pickle=False)
            else:
                scores = _read_member_data(fs, s_head, s_read, s_what)
        sequences = None
        if bounds.sequences and SEQUENCE_KEY in members:
            sequences = _read_sequences(
                zf, members[SEQUENCE_KEY], s_head.shape[0], total, bounds.max_bytes
            )
    except _ZIP_ERRORS as exc:  # CRC errors, bad compressed data...
        raise MalformedBody(f"{what} is corrupt: {shorten(exc)}.") from None
    return scores, labels, sequences, kind, explicit, staged


def _read_labels(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, n: int, used: int, max_bytes: int
) -> tuple[np.ndarray, int]:
    """The label member ``name``, one per row of ``n``: with the ``used`` bytes of the
    scores, within ``max_bytes``, checked from its header first; and the bytes used."""
    what = f"array {name!r}"
    with _member(zf, info, what) as fl:
        head, read = _read_member_header(fl, what)
        if head.shape != (n,):
            raise InvalidInput(
                f"labels must be a 1-D array with one entry per row of the scores "
                f"({n}). Got shape {head.shape}."
            )
        total = used + head.memory
        if total > max_bytes:
            raise too_many_bytes("The .npz body", total, max_bytes)
        _check_member_size(info, head, what)
        return _read_member_data(fl, head, read, what), total


def _read_sequences(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, n: int, used: int, max_bytes: int
) -> np.ndarray:
    """The member ``sequence_ids``, one per row of ``n``: with the ``used`` bytes of the
    scores and labels, within ``max_bytes``, checked from its header first."""
    what = f"array {SEQUENCE_KEY!r} of the .npz"
    with _member(zf, info, what) as fp:
        head, read = _read_member_header(fp, what, ids=True)
        if head.shape != (n,):
            raise InvalidInput(
                f"{SEQUENCE_KEY} must be a 1-D array with one entry per row of the scores "
                f"({n}). Got shape {head.shape}."
            )
        if used + head.memory > max_bytes:
            raise too_many_bytes("The .npz body", used + head.memory, max_bytes)
        _check_member_size(info, head, what)
        arr = _read_member_data(fp, head, read, what)
    return validated_sequences(arr, n, max_bytes - used)


def topk_from_npz(body, bounds: Bounds) -> TopKRows:
    """Top-k rows to calibrate (a top-k version's predict; ``body`` as :func:`_body_file`
    takes it): a ``.npz`` with the members ``topk_ids`` and ``topk_logprobs`` (N, k) and
    optionally ``vocab_size`` (the model's K when left out); no labels."""
    what = "The .npz body"
    with _body_file(body) as f, _open_npz(f, what) as zf:
        return _topk_members(zf, _members(zf, what), bounds, labelled=False)


def _topk_members(
    zf: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], bounds: Bounds, *, labelled: bool
) -> TopKRows:
    """The top-k members (``calibrators.topk``: ``topk_ids``, ``topk_logprobs``,
    ``vocab_size``; with ``labelled`` ``labels`` too and optionally ``sequence_ids``), each
    header checked against ``bounds`` before its data are inflated."""
    ids_key, lp_key, v_key = TOPK_KEYS
    needed = (ids_key, lp_key, v_key, "labels") if labelled else (ids_key, lp_key)
    allowed = {*needed, v_key, *((SEQUENCE_KEY,) if labelled else ())}
    missing = [m for m in needed if m not in members]
    if missing or set(members) - allowed:
        raise InvalidInput(
            f"A .npz of top-k rows holds {', '.join(needed)}"
            + (f" and optionally {SEQUENCE_KEY}" if labelled else f" and optionally {v_key}")
            + f". Got {shorten(sorted(members))}."
        )
    try:
        lp, used = _read_topk_member(zf, members[lp_key], lp_key, None, 0, bounds)
        ids, used = _read_topk_member(zf, members[ids_key], ids_key, lp.shape, used, bounds)
        vocab = bounds.num_classes
        if v_key in members:
            vocab, used = _read_topk_member(zf, members[v_key], v_key, (), used, bounds)
        labels = sequences = None
        if labelled:
            labels, used = _read_labels(zf, members["labels"], "labels", lp.shape[0], used,
                                        bounds.max_bytes)
            if SEQUENCE_KEY in members:
                sequences = _read_sequences(zf, members[SEQUENCE_KEY], lp.shape[0], used,
                                            bounds.max_bytes)
    except _ZIP_ERRORS as exc:
        raise MalformedBody(f"The .npz body is corrupt: {shorten(exc)}.") from None
    return validated_topk(ids, lp, vocab, bounds, labels=labels, sequences=sequences)


def _read_topk_member(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, shape: tuple | None, used: int,
    bounds: Bounds,
) -> tuple[np.ndarray, int]:
    """One top-k member, its header checked first: ``topk_logprobs`` (``shape`` None) a
    2-D array of real numbers within the row limit; ``topk_ids`` integers of ``shape``;
    ``vocab_size`` (``shape`` ()) one integer. Returns it and the bytes used so far."""
    what = f"array {name!r} of the .npz"
    with _member(zf, info, what) as fp:
        head, read = _read_member_header(fp, what, ids=shape is not None)
        if shape is None:
            if len(head.shape) != 2 or head.shape[1] < 1:
                raise InvalidInput(f"{what} must be 2-D, (n_samples, k). Got shape {head.shape}.")
            bounds.check_rows(head.shape[0])
        elif head.dtype.kind not in "iu" or head.shape not in ((shape,) if shape else ((), (1,))):
            raise InvalidInput(
                f"{what} must hold integers of shape {shape}. Got shape {head.shape}, "
                f"dtype {head.dtype}."
            )
        total = used + head.memory
        if total > bounds.max_bytes:
            raise too_many_bytes("The .npz body", total, bounds.max_bytes)
        _check_member_size(info, head, what)
        return _read_member_data(fp, head, read, what), total
