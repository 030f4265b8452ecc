""".npz bodies (datasets, feedback), read from the file they were spooled to.

A ``.npz`` is a zip: its central directory is bounded (:data:`MAX_NPZ_MEMBERS`
entries) before :mod:`zipfile` reads it; only stored and deflated, unencrypted
members are read, each through :class:`~service.api.codecs.npy.NpyStream`, so a
member inflates to at most its declared size, checked while inflating. Pure: no
web framework.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from service.api.codecs.npy import (
    NPY_MAGIC,
    NpyHeader,
    NpyStream,
    check_scores_header,
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


def _open_npz(path: Path | bytes | bytearray, what: str) -> zipfile.ZipFile:
    """``path``: the file a body was spooled to, or a body read into memory."""
    if not isinstance(path, Path):
        path = io.BytesIO(path)
        entries, size = _zip_directory(path, what)
    else:
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
    path: Path, bounds: Bounds, kind: str | None = None
) -> Labelled | TopKRows:
    """A ``.npz`` holding ``logits`` | ``probabilities`` | ``predictions`` and ``labels`` |
    ``ground_truth`` (and, where ``bounds.sequences``, optionally ``sequence_ids``; where
    ``bounds.unlabelled``, the labels may be left out). Every header is checked against
    ``bounds`` before a byte of data is inflated; ``kind`` (``?kind=``) must agree with
    the member's name. Where ``bounds.topk``, a ``.npz`` of top-k rows instead
    (:func:`topk_from_npz`)."""
    what = "The .npz body"
    zf = _open_npz(path, what)
    with zf:
        members = _members(zf, what)
        if bounds.topk and any(m in members for m in TOPK_KEYS):
            if kind is not None:
                raise InvalidInput(
                    f"?kind={kind} is for full scores; top-k rows are log-probabilities. "
                    "Drop ?kind."
                )
            return _topk_members(zf, members, bounds, labelled=True)
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
                scores = _read_member_data(fs, s_head, s_read, s_what)
            sequences = None
            if bounds.sequences and SEQUENCE_KEY in members:
                sequences = _read_sequences(
                    zf, members[SEQUENCE_KEY], s_head.shape[0], total, bounds.max_bytes
                )
        except _ZIP_ERRORS as exc:  # CRC errors, bad compressed data...
            raise MalformedBody(f"{what} is corrupt: {shorten(exc)}.") from None
    data = validated(scores, labels, kind, bounds.num_classes, bounds.model)
    check_not_probabilities(
        data.scores, kind, explicit, "Name the array 'probabilities' in the .npz."
    )
    if sequences is None:
        return data
    return Labelled(data.scores, data.labels, data.kind, sequences)


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


def topk_from_npz(body: Path | bytes | bytearray, bounds: Bounds) -> TopKRows:
    """Top-k rows to calibrate (a top-k version's predict): a ``.npz`` with the members
    ``topk_ids`` and ``topk_logprobs`` (N, k) and optionally ``vocab_size`` (the model's
    K when left out); no labels."""
    what = "The .npz body"
    with _open_npz(body, what) as zf:
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
