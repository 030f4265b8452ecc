"""One input through every body parser: the fuzz target of bench/fuzz_parsers.py, and
the replay of its corpus in tests/security/test_corpus.py. The binary parsers run as
they do without ``?dtype=`` and with ``?dtype=bfloat16`` (raw bfloat16 bit patterns,
widened to float32 while read): two more formats.

A parser may refuse an input only with a domain error (``ServiceError``, which the
API maps to a 400/413/415/422 problem, or the core's ``CalibrationInputError``, a
422); anything else raised here would be a 500 in the service, and is a crash.
The JSON target also checks that the parser that reads number arrays in groups
(:func:`service.api.json_body.plain_object`) gives exactly what orjson's parse gives.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from pathlib import Path

import numpy as np
import orjson

from calibrators.validation import CalibrationInputError
from service.api.codecs import json_body, npy, npz, rules
from service.errors import ServiceError

#: A model of 4 classes; small limits, so the row and byte limits are reachable.
BOUNDS = rules.Bounds(num_classes=4, model="m", max_rows=1000, max_bytes=1 << 20, what="dataset")
#: The same with ``?dtype=bfloat16``: binary scores are raw bfloat16 bit patterns.
BFLOAT16_BOUNDS = dataclasses.replace(BOUNDS, dtype="bfloat16")
REFUSALS = (ServiceError, CalibrationInputError)
#: The formats, in the order of the fuzzer's selector byte (new ones go last, so the
#: selector byte of a saved input keeps its meaning).
FORMATS = ("npy", "npz", "json", "npy-bfloat16", "npz-bfloat16")


class Mismatch(AssertionError):
    """The group parser and orjson disagree on a JSON body."""


def run_npy(data: bytes, chunk: int = 7, bounds: rules.Bounds = BOUNDS) -> None:
    """A .npy predict body, arriving in chunks of ``chunk`` bytes, read as predict reads
    it with ``bounds.dtype`` as ``?dtype=``."""
    check = npy.npy_check(bounds)
    stream = npy.NpyStream("The .npy body", check, score_dtype=bounds.dtype)
    for at in range(0, len(data), chunk):
        stream.feed(data[at : at + chunk])
    npy.scores_from_npy(stream.finish(), bounds, None)


_NPZ_PATH: Path | None = None


def run_npz(data: bytes, bounds: rules.Bounds = BOUNDS) -> None:
    """A .npz upload (datasets, feedback), from a file as the service reads it, with
    ``bounds.dtype`` as ``?dtype=``."""
    global _NPZ_PATH
    if _NPZ_PATH is None:
        fd, name = tempfile.mkstemp(suffix=".npz", prefix="fuzz-")
        os.close(fd)
        _NPZ_PATH = Path(name)
    _NPZ_PATH.write_bytes(data)
    npz.labelled_from_npz(_NPZ_PATH, bounds, None)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def run_json(data: bytes) -> None:
    """A JSON body of each route; and the group parser against orjson on it."""
    allowed = {*rules.JSON_SCORE_KEYS, "labels", "version"}
    plain = None
    try:
        plain = json_body.plain_object(data, allowed, BOUNDS)
    except REFUSALS:
        pass
    if plain is not None:
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise Mismatch(f"group parser accepted what orjson refuses: {exc}") from None
        try:
            full = json_body.json_object(data, allowed, BOUNDS)
        except REFUSALS as exc:
            raise Mismatch(f"group parser accepted what json_object refuses: {exc}") from None
        if set(full) != set(plain) or set(parsed) != set(plain):
            raise Mismatch(f"keys differ: {sorted(plain)} vs {sorted(full)}")
        for key, value in plain.items():
            if not _same(value, full[key]):
                raise Mismatch(f"{key!r} differs: {value!r} vs {full[key]!r}")
    for call in (
        lambda: json_body.scores_from_json(data, BOUNDS, None),
        lambda: json_body.labelled_from_json(data, BOUNDS, None, extra_keys=("version",)),
    ):
        try:
            call()
        except REFUSALS:
            pass


RUNNERS = {
    "npy": run_npy,
    "npz": run_npz,
    "json": run_json,
    "npy-bfloat16": functools.partial(run_npy, bounds=BFLOAT16_BOUNDS),
    "npz-bfloat16": functools.partial(run_npz, bounds=BFLOAT16_BOUNDS),
}


def run(fmt: str, data: bytes) -> None:
    """Parse ``data`` as ``fmt``; domain refusals are expected, anything else raises."""
    try:
        RUNNERS[fmt](data)
    except REFUSALS:
        pass


def one_input(data: bytes) -> None:
    """The fuzz target: the first byte picks the format, the rest is the body."""
    if not data:
        return
    run(FORMATS[data[0] % len(FORMATS)], data[1:])
