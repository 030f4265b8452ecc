"""Replay the fuzzer's corpus: every file under tests/security/corpus/<format>/ through
the parser of its format (tests/security/harness.py). A crasher that bench/fuzz_parsers.py
found is committed there once fixed, so it stays fixed.

The hostile payloads of tests/security/payloads.py go through the same harness, and a
short hypothesis run mutates them, so the suite fuzzes a little on every run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security import harness
from tests.security import payloads as pl

CORPUS = Path(__file__).parent / "corpus"
FILES = sorted(p for fmt in harness.FORMATS for p in (CORPUS / fmt).glob("*") if p.is_file())


def test_corpus_is_not_empty():
    assert {p.parent.name for p in FILES} == set(harness.FORMATS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_file(path):
    harness.run(path.parent.name, path.read_bytes())


def _bfloat16(z: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns of ``z`` (the top half of each float32), as <u2."""
    return (z.astype(np.float32).view(np.uint32) >> 16).astype("<u2")


def _seeds() -> list[tuple[str, bytes]]:
    z = np.random.default_rng(0).normal(size=(3, 4))
    y = np.arange(3)
    good = {"logits.npy": pl.array_npy(z), "labels.npy": pl.array_npy(y)}
    bits = _bfloat16(z)
    as_saved = {"logits.npy": pl.array_npy(bits.view("V2")), "labels.npy": pl.array_npy(y)}
    return [
        ("npy", pl.array_npy(z)),
        ("npy", pl.array_npy(np.asfortranarray(z).astype(">f4"))),
        ("npz", pl.npz(good)),
        ("npz", pl.npz(good, compression=8)),
        ("npy-bfloat16", pl.array_npy(bits.view("V2"))),
        ("npy-bfloat16", pl.array_npy(np.asfortranarray(bits).view("<i2"))),
        ("npz-bfloat16", pl.npz(as_saved)),
        ("npz-bfloat16", pl.npz(as_saved, compression=8)),
        ("json", b'{"logits": [[1, 2, 3, 4], [0, 0, 1, 2], [5, 1, 1, 1]], "labels": [0, 1, 2]}'),
        ("json", b'{"probabilities": [[0.25, 0.25, 0.25, 0.25]], "labels": [3], "version": 2}'),
    ]


def test_the_bfloat16_formats_read_what_dtype_bfloat16_reads():
    """The bfloat16 targets reach the widening path: the patterns np.save writes for an
    ml_dtypes.bfloat16 array (|V2) are accepted there, and refused without ?dtype."""
    z = np.random.default_rng(1).normal(size=(3, 4))
    npy = pl.array_npy(_bfloat16(z).view("V2"))
    npz = pl.npz({"logits.npy": npy, "labels.npy": pl.array_npy(np.arange(3))})
    harness.RUNNERS["npy-bfloat16"](npy)  # no refusal
    harness.RUNNERS["npz-bfloat16"](npz)
    for fmt, body in (("npy", npy), ("npz", npz)):
        with pytest.raises(harness.REFUSALS, match="dtype=bfloat16"):
            harness.RUNNERS[fmt](body)


@given(
    seed=st.sampled_from(_seeds()),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
    cut=st.integers(0, 10_000),
)
@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_mutated_seeds(seed, edits, cut):
    fmt, data = seed
    data = bytearray(data)
    for at, value in edits:
        if data:
            data[at % len(data)] = value
    harness.run(fmt, bytes(data[: max(1, len(data) - cut % 16)]))


@given(
    rows=st.lists(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64),
                           min_size=4, max_size=4), min_size=1, max_size=20),
    spaces=st.lists(st.sampled_from(["", " ", "\n", "\t ", "\r\n  "]), min_size=8, max_size=8),
    labels=st.lists(st.integers(0, 3), min_size=0, max_size=20),
)
@settings(max_examples=200, derandomize=True, deadline=None, database=None)
def test_group_parser_equals_orjson(rows, spaces, labels, monkeypatch_groups):
    # Tiny groups, so every body is split in many: the group parser must give what orjson
    # gives, row for row (harness.run_json raises Mismatch otherwise).
    a, b, c, d, e, f, g, h = spaces
    text = (a + "{" + b + '"logits"' + c + ":" + d + "["
            + ("," + e).join("[" + f + ("," + g).join(repr(x) for x in row) + h + "]"
                             for row in rows)
            + "]" + a + "," + b + '"labels":' + c + "[" + ",".join(map(str, labels)) + "]"
            + d + "}" + e)
    harness.run_json(text.encode())


@pytest.fixture(scope="module")
def monkeypatch_groups():
    from service.api.codecs import json_body

    saved = json_body._JSON_GROUP_BYTES
    json_body._JSON_GROUP_BYTES = 16
    yield
    json_body._JSON_GROUP_BYTES = saved
