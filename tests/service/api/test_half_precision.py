"""float16 and bfloat16 scores (issue 13, "Language-model scale"): .npy/.npz uploads,
feedback and predict widen them to float32 while reading (exactly: both are subsets of
float32), store float32, and fits read that; bfloat16 arrives as raw 16-bit patterns
with ``?dtype=bfloat16``. Other dtypes keep their refusals."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from service import errors
from service.api.codecs import npy as npy_codec
from service.api.codecs import rules
from service.storage.arrays import ArrayStore
from tests.service.helpers import assert_problem, create_model, logits_data, npy, npz, promote

K = 5
NPY = "application/x-npy"


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16, as its uint16 bit patterns."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


# -- the stream, in process ------------------------------------------------------


def _decode(body: bytes, chunk: int, score_dtype: str | None = None) -> np.ndarray:
    stream = npy_codec.NpyStream("x", lambda header: None, score_dtype=score_dtype)
    for at in range(0, len(body), chunk):
        stream.feed(body[at : at + chunk])
    return stream.finish()


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096, 1 << 30])
@pytest.mark.parametrize("order", ["C", "F"])
def test_stream_widens_float16_and_bfloat16_exactly_whatever_the_chunks(chunk, order):
    x = np.random.default_rng(0).normal(size=(13, 7)) * 30
    h = np.asarray(x, np.float16, order=order)
    out = _decode(npy(h), chunk)
    assert out.dtype == np.float32 and np.array_equal(out, h.astype(np.float32))
    big = _decode(npy(h.astype(">f2")), chunk)  # either byte order
    assert np.array_equal(big, h.astype(np.float32))
    bits = np.asarray(bf16_bits(x), order=order)
    for sent in (bits, bits.view("<i2"), bits.view(ml_dtypes.bfloat16)):
        out = _decode(npy(sent), chunk, "bfloat16")
        assert out.dtype == np.float32 and np.array_equal(out, bf16_value(bits)), sent.dtype


def test_header_memory_counts_the_float32_array_only():
    header = npy_codec.parse_npy_header(npy(np.zeros((10, 4), np.float16)), "x")
    assert header.widened and header.nbytes == 80 and header.memory == 160
    header = npy_codec.parse_npy_header(npy(np.zeros((10, 4), np.uint16)), "x", "bfloat16")
    assert header.bfloat16 and header.memory == 160


@pytest.mark.parametrize("dtype", ["<f4", ">u2", "<u4", "|u1", "<f2"])
def test_bfloat16_needs_16_bit_little_endian_patterns(dtype):
    with pytest.raises(errors.InvalidInput, match="bfloat16"):
        npy_codec.parse_npy_header(npy(np.zeros((2, 3), dtype)), "x", "bfloat16")


def test_a_bfloat16_npy_without_the_query_is_refused_with_the_fix():
    body = npy(np.zeros((2, 3), ml_dtypes.bfloat16))
    with pytest.raises(errors.InvalidInput, match=r"add \?dtype=bfloat16"):
        npy_codec.parse_npy_header(body, "x")


# -- the service ------------------------------------------------------------------


def test_half_precision_uploads_store_float32_and_fit(client, settings):
    create_model(client, "lm", k=K)
    z, y = logits_data(400, K, seed=1)
    half = z.astype(np.float16)
    r = client.post(
        "/v1/models/lm/datasets",
        content=npz(logits=half, labels=y),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["dtype"] == "float32" and (first["n"], first["k"]) == (400, K)
    # What is stored is the exact float32 widening, which fits read like any float32:
    # the same values sent as float32 are the same dataset.
    same = client.post(  # the same values as float32: the same dataset
        "/v1/models/lm/datasets",
        content=npz(logits=half.astype(np.float32), labels=y),
        headers={"content-type": "application/octet-stream"},
    )
    assert same.status_code == 200 and same.json()["id"] == first["id"], same.text

    bits = bf16_bits(z)
    r = client.post(
        "/v1/models/lm/datasets?dtype=bfloat16",
        content=npz(logits=bits.view(ml_dtypes.bfloat16), labels=y),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    bf = r.json()
    assert bf["dtype"] == "float32"
    same = client.post(
        "/v1/models/lm/datasets",
        content=npz(logits=bf16_value(bits), labels=y),
        headers={"content-type": "application/octet-stream"},
    )
    assert same.status_code == 200 and same.json()["id"] == bf["id"], same.text

    promote(client, "lm", bf["id"])
    stored = [f for f in ArrayStore(settings.data_dir, settings.array_store).files()]
    assert {np.load(f.path, mmap_mode="r").dtype for f in stored} == {
        np.dtype(np.float32), np.dtype(np.int64)
    }

    # predict: float16 .npy, bfloat16 patterns with ?dtype, equal to their float32 widening
    x = z[:16]
    want = client.post(
        "/v1/models/lm/predict",
        content=npy(x.astype(np.float16).astype(np.float32)),
        headers={"content-type": NPY},
    )
    assert want.status_code == 200, want.text
    got = client.post(
        "/v1/models/lm/predict", content=npy(x.astype(np.float16)), headers={"content-type": NPY}
    )
    assert got.status_code == 200, got.text
    np.testing.assert_allclose(
        got.json()["probabilities"], want.json()["probabilities"], rtol=0, atol=1e-6
    )
    b = bf16_bits(x)
    want = client.post(
        "/v1/models/lm/predict", content=npy(bf16_value(b)), headers={"content-type": NPY}
    )
    got = client.post(
        "/v1/models/lm/predict?dtype=bfloat16&top_k=2",
        content=npy(b.view("<i2")),
        headers={"content-type": NPY},
    )
    assert got.status_code == 200, got.text
    top = np.sort(np.asarray(want.json()["probabilities"]), axis=1)[:, ::-1][:, :2]
    np.testing.assert_allclose(got.json()["top_k_probabilities"], top, atol=1e-6)

    # feedback takes them too
    r = client.post(
        "/v1/models/lm/feedback?dtype=bfloat16",
        content=npz(logits=b, labels=y[:16]),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text


def test_half_precision_refusals(client):
    create_model(client, "lm", k=K)
    z, y = logits_data(50, K)
    promote(client, "lm", client.post(
        "/v1/models/lm/datasets", json={"logits": z.tolist(), "labels": y.tolist()}
    ).json()["id"])
    cases = [
        # bfloat16 without the query: named, with the fix
        ("/v1/models/lm/predict", npy(np.zeros((2, K), ml_dtypes.bfloat16)), NPY, "dtype=bfloat16"),
        # the query on a dtype that is not 16-bit patterns
        ("/v1/models/lm/predict?dtype=bfloat16", npy(np.zeros((2, K), np.float32)), NPY,
         "bfloat16"),
        # the query on JSON
        ("/v1/models/lm/predict?dtype=bfloat16", b'{"logits": [[0, 1, 2, 3, 4]]}',
         "application/json", "json"),
        # other dtypes keep their refusals
        ("/v1/models/lm/predict", npy(np.zeros((2, K), np.complex64)), NPY, "complex"),
        ("/v1/models/lm/predict", npy(np.zeros((2, K), bool)), NPY, "bool"),
        ("/v1/models/lm/datasets", npz(logits=np.zeros((2, K), ">f4").astype("m8[s]"),
                                       labels=[0, 1]), "application/octet-stream",
         "timedelta"),
        # a bfloat16 NaN or Inf is refused like a float32 one
        ("/v1/models/lm/predict?dtype=bfloat16",
         npy(bf16_bits(np.array([[np.inf, 0, 0, 0, 0]]))), NPY, "finite"),
    ]
    for path, body, media, word in cases:
        r = client.post(path, content=body, headers={"content-type": media})
        assert_problem(r, 422, word)
    r = client.post("/v1/models/lm/predict?dtype=float8", content=npy(np.zeros((2, K))),
                    headers={"content-type": NPY})
    assert r.status_code == 422, r.text


def test_the_byte_limit_counts_the_float32_array_of_half_precision_data():
    header = npy_codec.parse_npy_header(npy(np.zeros((8000, K), np.float16)), "x")
    npy_codec.check_scores_header(header, rules.Bounds(K, "m", 10**6, 160_000, "predict"), "x")
    with pytest.raises(errors.ContentTooLarge, match="float16 and bfloat16 to float32"):
        bounds = rules.Bounds(K, "m", 10**6, 159_999, "predict")
        npy_codec.check_scores_header(header, bounds, "x")
