""".npz dataset bodies spooled split (issue 22 item 5): the score member's data to a file
of their own, hashed as they arrive (service/api/uploads.py spool_npz), read back through
the spliced view (service/api/codecs/npz.py), and stored as they are only when they are
exactly what storing the validated array writes; every other body reads as before."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from starlette.requests import ClientDisconnect

from calibrators.validation import CalibrationInputError
from service.api import uploads
from service.api.codecs import npz
from service.api.codecs.rules import Bounds
from service.api.uploads import spool_npz
from service.errors import InvalidInput, MalformedBody
from tests.service.helpers import assert_problem, create_model

BOUNDS = Bounds(5, "m", 10_000, 1 << 30, "dataset", None, True, True)


def npz_body(compressed: bool = False, **arrays) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


class _Request:
    """What spool_npz reads of a request: its body in chunks of the given sizes."""

    def __init__(self, body: bytes, sizes: list[int]):
        self.body, self.sizes = body, sizes

    async def stream(self):
        at, i = 0, 0
        while at < len(self.body):
            n = self.sizes[i % len(self.sizes)]
            yield self.body[at : at + n]
            at, i = at + n, i + 1


def spool(tmp_path: Path, body: bytes, sizes=(65_536,)) -> npz.NpzBody:
    path, member = tmp_path / "body.npz", tmp_path / "member.npy"
    path.touch()
    member.touch()
    return asyncio.run(spool_npz(_Request(body, list(sizes)), path, member))


def scores(n=40, dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 5)).astype(dtype)


LABELS = np.arange(40) % 5


@pytest.mark.parametrize("sizes", [(1,), (7, 1000), (65_536,), (3_000_000,)])
@pytest.mark.parametrize("labels_first", [False, True])
def test_the_score_member_is_split_off_and_the_view_is_the_body(tmp_path, sizes, labels_first):
    z = scores(300)  # a member over 1 MiB of pieces at the larger sizes: several pieces
    z = np.tile(z, (200, 1))
    arrays = {"labels": np.arange(len(z)) % 5, "logits": z}
    if not labels_first:
        arrays = {"logits": z, "labels": arrays["labels"]}
    body = npz_body(**arrays)
    spooled = spool(tmp_path, body, sizes)
    member = npy_bytes(z)
    assert spooled.routed is not None and spooled.routed.name == "logits.npy"
    assert spooled.member.read_bytes() == member
    assert body[spooled.routed.start : spooled.routed.start + spooled.routed.size] == member
    assert spooled.sha256 == hashlib.sha256(member).hexdigest()
    assert spooled.crc32 == zlib.crc32(member) and spooled.written == len(member)
    with spooled.open() as f:
        assert f.read() == body
        f.seek(spooled.routed.start - 3)  # reads across the seams
        assert f.read(10) == body[spooled.routed.start - 3 : spooled.routed.start + 7]
    data = npz.labelled_from_npz(spooled, Bounds(5, "m", 100_000, 1 << 30, "dataset"))
    assert data.scores_file is not None and data.scores_file.sha256 == spooled.sha256
    np.testing.assert_array_equal(data.scores, z)


@pytest.mark.parametrize(
    "arrays, compressed, kept",
    [
        ({"logits": scores(dtype=np.float16), "labels": LABELS}, False, False),
        ({"logits": np.asfortranarray(scores()), "labels": LABELS}, False, False),
        ({"logits": scores().astype(">f4"), "labels": LABELS}, False, False),
        ({"logits": (scores() * 10).astype(np.int32), "labels": LABELS}, False, False),
        ({"logits": scores(), "labels": LABELS}, True, False),
        ({"probabilities": np.full((40, 5), 0.2), "labels": LABELS}, False, True),
        ({"logits": scores(dtype=np.float64), "labels": LABELS, "sequence_ids": LABELS // 2},
         False, True),
        ({"logits": scores()}, False, True),
    ],
    ids=["float16", "fortran", "big-endian", "int32", "deflated", "probabilities", "float64",
         "unlabelled"],
)  # fmt: skip
def test_a_split_body_reads_as_the_whole_file(tmp_path, arrays, compressed, kept):
    body = npz_body(compressed, **arrays)
    check_split_reads_as_whole(tmp_path, body, kept)


def test_a_member_with_another_npy_header_is_written_from_its_array(tmp_path):
    # A .npy of format 2.0 holds the same array as np.save's 1.0, with other header bytes:
    # kept as sent, its file would have another hash than the array stored from the
    # whole file (the same content, two datasets).
    member = io.BytesIO()
    np.lib.format.write_array(member, scores(), version=(2, 0))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("logits.npy", member.getvalue())
        zf.writestr("labels.npy", npy_bytes(LABELS))
    check_split_reads_as_whole(tmp_path, buf.getvalue(), kept=False)


def check_split_reads_as_whole(tmp_path, body: bytes, kept: bool) -> None:
    (tmp_path / "whole.npz").write_bytes(body)
    whole = npz.labelled_from_npz(tmp_path / "whole.npz", BOUNDS)
    split = npz.labelled_from_npz(spool(tmp_path, body), BOUNDS)
    for name in ("scores", "labels", "sequences"):
        a, b = getattr(whole, name), getattr(split, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))
    assert whole.kind == split.kind and whole.scores_file is None
    # Stored as they are only when those bytes are what writing the array would write.
    assert (split.scores_file is not None) == kept
    if kept:
        assert split.scores_file.path.read_bytes() == npy_bytes(whole.scores)


def corrupt_member(body: bytes) -> bytes:
    """The body with one byte of the score member's data changed (the CRC in the zip's
    directory no longer matches)."""
    at = body.index(b"\x93NUMPY") + 200
    return body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]


@pytest.mark.parametrize(
    "mangle, error, words",
    [
        (corrupt_member, MalformedBody, "corrupt"),
        (lambda b: b[: len(b) // 2], MalformedBody, "zip"),
        (lambda b: b[:-30], MalformedBody, "zip"),
    ],
    ids=["crc", "truncated in the member", "truncated directory"],
)
def test_a_bad_split_body_gets_the_error_of_the_whole_file(tmp_path, mangle, error, words):
    # 2,000 rows: more than zipfile reads of the member with its header (its own CRC
    # check then never runs on the split path)
    body = mangle(npz_body(logits=scores(2000), labels=np.arange(2000) % 5))
    (tmp_path / "whole.npz").write_bytes(body)
    with pytest.raises(error) as whole:
        npz.labelled_from_npz(tmp_path / "whole.npz", BOUNDS)
    with pytest.raises(error) as split:
        npz.labelled_from_npz(spool(tmp_path, body), BOUNDS)
    assert str(split.value) == str(whole.value) and words in str(split.value)


def test_a_split_body_s_digest_names_its_bytes_without_reading_the_member_again(tmp_path):
    z = scores(2000)
    body = npz_body(logits=z, labels=np.arange(2000) % 5)
    labels_changed = npz_body(logits=z, labels=(np.arange(2000) + 1) % 5)
    digests = {}
    for name, b, sizes in [("body", body, (65_536,)), ("again", body, (7, 100_000)),
                           ("member", corrupt_member(body), (65_536,)),
                           ("labels", labels_changed, (65_536,))]:  # fmt: skip
        (tmp_path / name).mkdir()
        spooled = spool(tmp_path / name, b, sizes)
        assert spooled.routed is not None
        spooled.member.unlink()  # hashed as it arrived: not read again
        digests[name] = spooled.digest()
    assert digests["body"] == digests["again"]
    assert len({digests["body"], digests["member"], digests["labels"]}) == 3
    # nothing routed: the file's own sha256
    unrouted = npz.NpzBody(tmp_path / "plain.npz", len(body))
    unrouted.path.write_bytes(body)
    assert unrouted.digest() == hashlib.sha256(body).hexdigest()


class _CutRequest(_Request):
    """A body that stops after ``cut`` bytes as a client that goes away does (None: whole)."""

    def __init__(self, body: bytes, cut: int | None):
        super().__init__(body[:cut], [65_536])
        self.headers = {"content-type": "application/octet-stream"}
        self.cut = cut

    async def stream(self):
        async for chunk in super().stream():
            yield chunk
        if self.cut is not None:
            raise ClientDisconnect()


@pytest.mark.parametrize("cut", [100, 3 << 20, None])
def test_a_cut_or_refused_split_body_leaves_no_file(tmp_path, monkeypatch, cut):
    # flushes start every MiB: a cut comes while they run, on files then removed
    monkeypatch.setattr(uploads, "_SYNC_BYTES", 1 << 20)
    z = np.tile(scores(2000), (3, 1))  # 1.1 MiB of float32 per 2,000 rows: 3.4 MiB
    body = npz_body(logits=z, labels=np.arange(len(z)) % 5)
    spool_dir = tmp_path / "tmp"
    spool_dir.mkdir()
    made = iter(range(100))

    def temp_path(suffix):
        path = spool_dir / f"{next(made)}{suffix}"
        path.touch()
        return path

    async def upload():
        request = _CutRequest(body, cut)
        async with uploads.labelled_body(request, json_limit=1000, temp_path=temp_path,
                                         multipart=False, expected="", split_scores=True) as up:
            assert up.npz.routed is not None and up.npz.written == z.nbytes + 128
            raise InvalidInput("refused after the body, as validation may")  # fmt: skip

    with pytest.raises(ClientDisconnect if cut is not None else InvalidInput):
        asyncio.run(upload())
    assert not any(spool_dir.iterdir())


def test_the_spool_s_crc_is_the_zip_s():
    # zlib-ng's where it is installed: the CRC-32 zip and zlib compute, piece after piece
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, np.uint8).tobytes()
    crc = 0
    for at in range(0, len(data), 777_777):
        crc = uploads.crc32(memoryview(data)[at : at + 777_777], crc)
    assert crc == zlib.crc32(data) and crc != 0


def test_nan_in_a_split_member_is_refused_as_before(tmp_path):
    z = scores()
    z[-1, -1] = np.nan
    with pytest.raises(CalibrationInputError, match=r"finite.*row 39, column 4"):
        npz.labelled_from_npz(spool(tmp_path, npz_body(logits=z, labels=LABELS)), BOUNDS)


def test_the_router_leaves_members_it_cannot_place_in_the_body():
    # Written to a stream that cannot seek, zipfile puts the sizes after the data (a data
    # descriptor): the member's end is unknown while it streams, so nothing is routed.
    class Unseekable(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.data += b
            return len(b)

    out = Unseekable()
    np.savez(out, logits=scores(), labels=LABELS)
    router = npz.MemberRouter(["logits"])
    runs = router.feed(bytes(out.data))
    assert router.routed is None and not any(to_member for to_member, _ in runs)
    router = npz.MemberRouter(["logits"])
    assert not any(m for m, _ in router.feed(b"not a zip at all, 30 bytes or more"))


def test_an_upload_split_stores_what_the_whole_file_stores(client, settings):
    create_model(client, "m", k=5)
    body = npz_body(logits=scores(), labels=LABELS)
    first = client.post("/v1/models/m/datasets", content=body,
                        headers={"content-type": "application/octet-stream"})  # fmt: skip
    assert first.status_code == 201, first.text
    # multipart is spooled whole and written from the array: the same files, the same
    # dataset
    again = client.post("/v1/models/m/datasets", files={"file": ("d.npz", body)})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    stored = settings.data_dir / "arrays"
    files = {p.name: p.read_bytes() for p in stored.rglob("*.npy")}
    member = npy_bytes(scores())
    assert files[f"{hashlib.sha256(member).hexdigest()}.npy"] == member
    assert not any((settings.data_dir / "tmp").iterdir())


def test_a_refused_split_upload_leaves_no_file_and_no_row(client, settings):
    create_model(client, "m", k=5)
    z = scores()
    z[-1, -1] = np.inf
    r = client.post("/v1/models/m/datasets", content=npz_body(logits=z, labels=LABELS),
                    headers={"content-type": "application/octet-stream"})  # fmt: skip
    assert_problem(r, 422, "finite")
    assert client.get("/v1/models/m/datasets").json()["datasets"] == []
    assert not list((settings.data_dir / "arrays").rglob("*.npy"))
    assert not any((settings.data_dir / "tmp").iterdir())
