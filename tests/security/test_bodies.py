"""Hostile .npy, .npz and JSON bodies on every route that takes one: each is a clear
400/413/415/422 problem, decided from the headers before the data are inflated.

The table of what is tried and what is expected is tests/security/README.md.
"""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from service.api.codecs import npy as npy_codec
from service.api.codecs import rules
from service.errors import ContentTooLarge
from tests.security import payloads as pl
from tests.security.conftest import LIMITS
from tests.service.helpers import assert_problem

PREDICT = "/v1/models/m/predict"
DATASETS = "/v1/models/m/datasets"
FEEDBACK = "/v1/models/m/feedback"
NPY = {"content-type": "application/x-npy"}
OCTET = {"content-type": "application/octet-stream"}
K = 4


def labels(n: int) -> bytes:
    return pl.array_npy(np.arange(n) % K)


def members(scores: bytes, n: int = 2, name: str = "logits.npy") -> dict[str, bytes]:
    return {name: scores, "labels.npy": labels(n)}


# -- .npy headers (predict) and the same headers inside a .npz (datasets, feedback) --------

BAD_HEADERS = [
    # (what, .npy bytes, status, a word of the detail)
    ("negative dimension", pl.npy((-1, K)), 400, "non-negative"),
    ("negative dimensions", pl.npy((-2, -5)), 400, "non-negative"),
    ("bool dimension", pl.npy_header((True, K)) + bytes(8 * K), 400, "non-negative"),
    ("bool columns", pl.npy_header((2, True)) + bytes(16), 400, "non-negative"),
    ("float dimension", pl.npy_header((2.0, K)), 400, "non-negative"),
    ("list shape", pl.npy_header([2, K]), 400, "non-negative"),
    ("string shape", pl.npy_header("2,4"), 400, "non-negative"),
    ("huge rows", pl.npy_header((10**12, K)), 413, "rows"),
    ("huge columns", pl.npy_header((2, 10**12)), 422, "columns"),
    ("one dimension", pl.npy((8,)), 422, "2-D"),
    ("three dimensions", pl.npy((2, 2, K)), 422, "2-D"),
    ("scalar", pl.npy(()), 422, "2-D"),
    ("object dtype", pl.npy_header((2, K), "|O") + bytes(64), 422, "object"),
    ("bool dtype", pl.npy((2, K), "|b1"), 422, "bool"),
    ("complex dtype", pl.npy((2, K), "<c16"), 422, "complex"),
    ("timedelta dtype", pl.npy((2, K), "<m8[s]"), 422, "timedelta"),
    ("datetime dtype", pl.npy((2, K), "<M8[s]"), 422, "datetime"),
    ("float128 dtype", pl.npy((2, K), "<f16"), 422, "float"),
    ("string dtype", pl.npy((2, K), "<U3"), 422, "string"),
    ("record dtype", pl.npy_header((2,), text="{'descr': [('a', '<f8')], 'fortran_order': "
                                         "False, 'shape': (2,)}"), 422, "records"),
    ("header not a dict", pl.npy_header((2, K), text="[1, 2]"), 400, "dict"),
    ("header extra key", pl.npy_header((2, K), text="{'descr': '<f8', 'fortran_order': False, "
                                         "'shape': (2, 4), 'x': 1}"), 400, "dict"),
    ("header code", pl.npy_header((2, K), text="__import__('os').system('true')"), 400, "header"),
    ("fortran_order not bool", pl.npy_header((2, K), text="{'descr': '<f8', 'fortran_order': "
                                               "1, 'shape': (2, 4)}"), 400, "fortran_order"),
    ("unknown version", pl.npy((2, K), version=(9, 9)), 400, "version"),
    ("header length over numpy's", pl.npy_header((2, K), length=60_000), 400, "header"),
    ("v2 header of 4 GiB", pl.npy_header((2, K), version=(2, 0), length=2**32 - 1), 400,
     "header"),
    ("bad magic", b"\x93NUMPZ" + pl.npy((2, K))[6:], 400, "npy"),
    ("truncated data", pl.npy((2, K))[:-1], 400, "truncated"),
    ("trailing data", pl.npy((2, K)) + b"\0", 400, "more bytes"),
    ("only the magic", b"\x93NUMPY", 400, "header"),
    ("empty", b"", 400, "header"),
]


@pytest.mark.parametrize("what,body,status,word", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_bad_npy_predict(served, what, body, status, word):
    assert_problem(served.post(PREDICT, content=body, headers=NPY), status, word)


@pytest.mark.parametrize("what,body,status,word", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
@pytest.mark.parametrize("url", [DATASETS, FEEDBACK])
def test_bad_npy_in_npz(served, url, what, body, status, word):
    if what in ("empty", "only the magic"):
        word = "ends before"
    if what in ("trailing data", "truncated data"):  # the zip's size disagrees with the header
        word = "declares"
    archive = pl.npz(members(body))
    assert_problem(served.post(url, content=archive, headers=OCTET), status, word)


def test_valid_npy_orders_and_byte_orders_agree(served):
    z = np.random.default_rng(1).normal(size=(3, K))
    answers = [
        served.post(PREDICT, content=pl.array_npy(a), headers=NPY).json()["probabilities"]
        for a in (z, np.asfortranarray(z), z.astype(">f8"), z.astype(np.float32))
    ]
    for other in answers[1:]:
        np.testing.assert_allclose(other, answers[0], rtol=1e-6)


# -- .npz structure ---------------------------------------------------------------------


def _deflate_bomb(shape, zeros: int = 64 << 20) -> bytes:
    """A logits member declaring ``shape``, then ``zeros`` zero bytes (~1000x deflate)."""
    return pl.npy_bomb(shape, zeros)


@pytest.mark.parametrize("url", [DATASETS, FEEDBACK])
def test_inflation_bomb_refused_from_the_header(served, url):
    # issue 12: 2.0 MB took the server from 205 to 4,273 MiB. Here 64 MiB of zeros: the
    # member is never inflated past its header (tests/security/test_memory.py measures it).
    for shape in [(-1, 10), (-2, -5), (True, 10)]:
        bomb = _deflate_bomb(shape)
        assert len(bomb) < 200_000
        assert_problem(served.post(url, content=bomb, headers=OCTET), 400, "non-negative")


def test_zero_bomb_over_the_row_limit_refused_before_inflating(served):
    # A valid all-zero .npz declaring more rows than max_dataset_rows: 413 from the header.
    rows = LIMITS["max_dataset_rows"] + 1
    bomb = pl.deflated_member("logits.npy", pl.npy_header((rows, K)), rows * K * 8)
    bomb = pl._merge(bomb, {"labels.npy": labels(rows)})
    body = assert_problem(served.post(DATASETS, content=bomb, headers=OCTET), 413, "rows")
    assert body["max_rows"] == LIMITS["max_dataset_rows"]


def test_npz_over_the_byte_limit_refused_before_inflating(served):
    # Within the row limit, over max_body_bytes once inflated (float64 of 4 classes:
    # 5,000 rows are 160 KB, so the model of this test is given more columns' worth).
    rows = LIMITS["max_feedback_rows"]
    scores = pl.npy_header((rows, K), "<f8") + bytes(rows * K * 8)
    ok = pl.npz(members(scores, rows), compression=zipfile.ZIP_DEFLATED)
    r = served.post(FEEDBACK, content=ok, headers=OCTET)
    assert r.status_code != 413, r.text  # the limit is on bytes of data, this one is under it


ZIP_CASES = [
    ("encrypted member", pl.patch_members(pl.npz(members(pl.npy((2, K)))), flags=0x1), 422,
     "encrypted"),
    ("strong encryption", pl.patch_members(pl.npz(members(pl.npy((2, K)))), flags=0x41), 422,
     "encrypted"),
    ("bzip2 member", pl.npz(members(pl.npy((2, K))), zipfile.ZIP_BZIP2), 422, "method"),
    ("lzma member", pl.npz(members(pl.npy((2, K))), zipfile.ZIP_LZMA), 422, "method"),
    ("unknown method", pl.patch_members(pl.npz(members(pl.npy((2, K)))), method=99), 422,
     "method"),
    ("declared size too large", pl.patch_members(pl.npz(members(pl.npy((2, K)))),
                                                 file_size=10**9), 400, "declares"),
    ("declared size too small", pl.patch_members(pl.npz(members(pl.npy((2, K)))),
                                                 file_size=10), 400, "npz"),
    ("duplicate member", pl._merge(pl.npz(members(pl.npy((2, K)))),
                                   {"logits.npy": pl.npy((2, K))}), 400, "twice"),
    ("same name with and without .npy", pl._merge(pl.npz(members(pl.npy((2, K)))),
                                                  {"logits": pl.npy((2, K))}), 400, "twice"),
    ("too many entries", pl.many_members(65), 422, "entries"),
    ("3,000 entries, the end record says 2", pl.many_members(3000, declared=2), 422,
     "central directory"),
    ("70 entries, the end record says 2", pl.many_members(70, declared=2), 422, "entries"),
    ("no zip end record", pl.npz(members(pl.npy((2, K))))[:-22], 400, "zip"),
    ("not a zip", b"PK\x03\x04" + bytes(100), 400, "zip"),
    ("labels of another length", pl.npz({"logits.npy": pl.npy((2, K)), "labels.npy":
                                         labels(3)}), 422, "one entry per row"),
    ("labels 2-D", pl.npz({"logits.npy": pl.npy((2, K)), "labels.npy":
                           pl.array_npy(np.zeros((2, 1), int))}), 422, "1-D"),
    ("labels as timedelta", pl.npz({"logits.npy": pl.npy((2, K)), "labels.npy":
                                    pl.npy((2,), "<m8[s]")}), 422, "timedelta"),
    ("labels as bool", pl.npz({"logits.npy": pl.npy((2, K)), "labels.npy":
                               pl.npy((2,), "|b1")}), 422, "bool"),
]


@pytest.mark.parametrize("what,body,status,word", ZIP_CASES, ids=[c[0] for c in ZIP_CASES])
@pytest.mark.parametrize("url", [DATASETS, FEEDBACK])
def test_bad_npz(served, url, what, body, status, word):
    assert_problem(served.post(url, content=body, headers=OCTET), status, word)


def test_bad_npz_in_multipart(served):
    body = pl.patch_members(pl.npz(members(pl.npy((2, K)))), flags=0x1)
    r = served.post(DATASETS, files={"file": ("d.npz", body, "application/octet-stream")})
    assert_problem(r, 422, "encrypted")


def test_corrupt_deflate_stream(served):
    good = pl.npz(members(pl.array_npy(np.eye(2, K) * 3.0)), zipfile.ZIP_DEFLATED)
    at = good.find(b"PK\x03\x04") + 30 + len("logits.npy") + 40
    bad = good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :]
    r = served.post(DATASETS, content=bad, headers=OCTET)
    assert r.status_code == 400, r.text


# -- JSON ---------------------------------------------------------------------------------

JSON_CASES = [
    (b'{"logits": [[NaN, 0, 0, 0]]}', 422, "non-finite"),
    (b'{"logits": [[Infinity, 0, 0, 0]]}', 422, "non-finite"),
    (b'{"logits": [[-Infinity, 0, 0, 0]]}', 422, "non-finite"),
    (b'{"logits": [[1e999, 0, 0, 0]]}', 422, "non-finite"),
    (b'{"logits": [[nan, 0, 0, 0]]}', 422, "non-finite"),
    (b'{"logits": [[true, 0, 0, 1]]}', 422, "numeric"),
    (b'{"logits": [[null, 0, 0, 1]]}', 422, "numeric"),
    (b'{"logits": [["1", 0, 0, 1]]}', 422, "numeric"),
    (b'{"logits": [[1, 0, 0, 2]], "extra": 1}', 422, "unknown"),
    (b'{"logits": [[[1, 0, 0, 2]]]}', 422, "2-D"),
    (b'{"logits": [[1, 0], [0, 0, 0, 2]]}', 422, "rectangular"),
    (b'[[1, 0, 0, 2]]', 422, "object"),
    (b'{"logits": [[1, 0, 0, 2]]', 400, "json"),
]


@pytest.mark.parametrize("body,status,word", JSON_CASES, ids=[c[0].decode() for c in JSON_CASES])
def test_bad_json_predict(served, body, status, word):
    headers = {"content-type": "application/json"}
    assert_problem(served.post(PREDICT, content=body, headers=headers), status, word)


@pytest.mark.parametrize("labels_text,status", [
    (b"[0, 3.0]", 201), (b"[0, 3.5]", 422), (b"[0, true]", 422), (b"[0, null]", 422),
    (b"[0, 4]", 422), (b"[0, -1]", 422), (b'[0, "1"]', 422),
])
def test_json_labels(served, labels_text, status):
    body = b'{"logits": [[1, 0, 0, 2], [0, 3, 1, 0]], "labels": ' + labels_text + b"}"
    r = served.post(DATASETS, content=body, headers={"content-type": "application/json"})
    assert r.status_code in ((200, 201) if status == 201 else (status,)), r.text


def test_json_over_what_the_rows_can_need(served):
    # predict of a 4-class model, 1,000 rows: 64 KiB + 1,000 x (4 x 48 + 64) bytes at most.
    limit = 64 * 1024 + LIMITS["max_predict_rows"] * (K * 48 + 64)
    body = b'{"logits": [' + b" " * limit + b"[1, 0, 0, 2]]}"
    assert_problem(
        served.post(PREDICT, content=body, headers={"content-type": "application/json"}),
        413, str(limit),
    )

    def chunks():  # no Content-Length: refused once past the limit
        yield b'{"logits": ['
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536
        yield b"[1, 0, 0, 2]]}"

    r = served.post(PREDICT, content=chunks(), headers={"content-type": "application/json"})
    assert_problem(r, 413)


@pytest.mark.parametrize("rows_text", [b"[0,1,2,3]", b"[0, 1, 2, 3]"])
def test_json_rows_counted_before_parsing(served, rows_text):
    # Under the byte limit, over the row limit: 413 naming the limit, from the count of
    # rows (the group parser for bodies over 1 MiB, the bracket count under it).
    rows = LIMITS["max_predict_rows"] + 1
    body = b'{"logits": [' + b",".join([rows_text] * rows) + b"]}"
    r = served.post(PREDICT, content=body, headers={"content-type": "application/json"})
    assert_problem(r, 413, "rows")


def test_big_json_parsed_in_groups_equals_orjson(served):
    z = np.random.default_rng(2).normal(size=(1000, K))
    body = json.dumps({"logits": z.tolist()}, indent=4).encode()
    assert len(body) > 100_000
    small = served.post(PREDICT, json={"logits": z[:10].tolist()}).json()
    big = served.post(PREDICT, content=body, headers={"content-type": "application/json"})
    assert big.status_code == 200, big.text
    np.testing.assert_array_equal(big.json()["probabilities"][:10], small["probabilities"])


def test_chunked_json_equals_declared(served):
    z = np.random.default_rng(3).normal(size=(50, K))
    body = json.dumps({"logits": z.tolist()}).encode()

    def chunks():  # no Content-Length: read into a memory map
        for at in range(0, len(body), 100):
            yield body[at : at + 100]

    headers = {"content-type": "application/json"}
    declared = served.post(PREDICT, content=body, headers=headers)
    chunked = served.post(PREDICT, content=chunks(), headers=headers)
    assert declared.status_code == chunked.status_code == 200, chunked.text
    assert declared.json() == chunked.json()
    assert_problem(served.post(PREDICT, content=iter([b""]), headers=headers), 400, "json")


def _multipart(parts: list[tuple[str, bytes]], boundary: bytes = b"b0undary") -> bytes:
    out = b""
    for headers, data in parts:
        out += b"--" + boundary + b"\r\n" + headers.encode() + b"\r\n\r\n" + data + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


@pytest.mark.parametrize("parts,word", [
    ([('Content-Disposition: form-data; name="file"; filename="' + "x" * 20_000 + '"', b"")],
     "multipart"),
    ([("X-" + "a" * 20_000 + ": 1", b"")], "multipart"),
    ([("\r\n".join(f"X-{i}: 1" for i in range(40)), b"")], "multipart"),
    ([(f'Content-Disposition: form-data; name="f{i}"', b"") for i in range(70)], "multipart"),
])
def test_multipart_headers_are_bounded(served, parts, word):
    # Only the file's data go to disk; what is held in memory is bounded (400 past it:
    # python-multipart's own limits on headers, ours on parts and on headers too).
    r = served.post(DATASETS, content=_multipart(parts),
                    headers={"content-type": "multipart/form-data; boundary=b0undary"})
    assert_problem(r, 400, word)


def test_byte_limit_counts_the_converted_arrays(served):
    # int8 scores become float64, 8 times their data: a header whose int8 data (1.2 MiB)
    # is under max_body_bytes (4 MiB) but whose float64 copy is not is a 413 from the
    # header (the served model has 4 classes, so the check is called directly).
    rows, k = LIMITS["max_dataset_rows"], 256
    bounds = rules.Bounds(k, "m", rows, LIMITS["max_body_bytes"], "dataset")
    header = npy_codec.parse_npy_header(pl.npy_header((rows, k), "|i1"), "x")
    assert header.nbytes < bounds.max_bytes < header.memory
    with pytest.raises(ContentTooLarge):
        npy_codec.check_scores_header(header, bounds, "x")
    ok = npy_codec.parse_npy_header(pl.npy_header((rows, k // 16), "<f8"), "x")
    assert ok.memory == ok.nbytes  # float64 is used as it is
