"""Request bodies, streamed: size limits enforced while reading, big bodies to disk.

Nothing here holds more than one copy of a body: JSON bodies (bounded by what
their rows can need, :func:`service.api.json_body.json_body_limit`) are read into one
buffer, preallocated when the length is declared; a .npy predict body is decoded
while it arrives (:func:`read_npy`: its header checked before the data are
allocated, the data written once into the array); binary uploads are streamed to
a temp file in the array store's folder; multipart uploads are parsed on the
fly with python-multipart and only the ``file`` field's bytes reach the disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import numpy as np
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from service.api.codecs import npy, npz
from service.api.codecs.rules import SCORE_KEYS
from service.errors import ContentTooLarge, InvalidInput, MalformedBody, UnsupportedMediaType

try:  # zlib-ng's CRC-32 (folding with carry-less multiplies): 5x zlib's (bench/README.md)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # an install without it: zlib's, the same sums
    from zlib import crc32

_FLUSH_BYTES = 1 << 20

#: Media types of a binary .npz body (datasets, feedback).
NPZ_TYPES = ("application/octet-stream", "application/x-npz", "application/zip")


@dataclass
class Upload:
    """A labelled-scores body: JSON read into memory, or a .npz spooled to a file (or split,
    its score member apart: :func:`spool_npz`)."""

    json: bytes | None = None
    npz: Path | npz.NpzBody | None = None


def media_type(request: Request) -> str:
    """The request's media type without parameters, lower case ('' when absent)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def require_json(request: Request) -> None:
    """415 unless the body is JSON (for the routes whose body is a pydantic model)."""
    kind = media_type(request)
    if kind != "application/json" and not kind.endswith("+json"):
        raise UnsupportedMediaType(
            f"This endpoint takes application/json. Got {kind or 'no Content-Type'!r}."
        )


def _too_large(limit: int) -> ContentTooLarge:
    return ContentTooLarge(f"The request body is larger than the limit of {limit} bytes.")


def declared_length(request: Request) -> int | None:
    """The Content-Length, or None (chunked, or not a number)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared and declared.isdigit() else None


@asynccontextmanager
async def labelled_body(
    request: Request,
    *,
    json_limit: int,
    temp_path: Callable[[str], Path],
    multipart: bool,
    expected: str,
    split_scores: bool = False,
) -> AsyncIterator[Upload]:
    """A labelled-scores body by its media type: JSON read into memory (up to
    ``json_limit``), a .npz body (or, with ``multipart``, the multipart field ``file``)
    spooled to a temp file that is removed on exit; 415 naming ``expected`` otherwise.
    With ``split_scores``, a .npz body's score member is spooled to a file of its own
    (:func:`spool_npz`; removed on exit too unless it was stored)."""
    kind = media_type(request)
    if kind == "application/json" or kind.endswith("+json"):
        yield Upload(json=await read_body(request, json_limit))
        return
    from_form = multipart and kind == "multipart/form-data"
    if kind not in NPZ_TYPES and not from_form:
        raise UnsupportedMediaType(f"{expected} Got {kind or 'no Content-Type'!r}.")
    path = temp_path(".npz")
    member = temp_path(".npy") if split_scores and not from_form else None
    try:
        if from_form:
            await spool_multipart_file(request, path)
            yield Upload(npz=path)
        elif member is not None:
            yield Upload(npz=await spool_npz(request, path, member))
        else:
            await spool_body(request, path)
            yield Upload(npz=path)
    finally:
        path.unlink(missing_ok=True)
        if member is not None:
            member.unlink(missing_ok=True)


async def read_body(request: Request, limit: int) -> bytes | bytearray | mmap.mmap:
    """The whole body in one buffer, refusing (413) a declared length over ``limit`` before
    reading, and a chunked body as soon as it passes ``limit``.

    With a declared length, a body that arrives in one piece (most small requests) is
    kept as it came, as ``bytes``; one in several pieces goes into a bytearray allocated
    once (no list of chunks joined into a second copy). Without a declared length, it is
    an anonymous memory map of ``limit`` bytes of address space, of which only the pages
    written cost memory, shrunk to the body's size at the end: a growing bytearray would
    be copied as it grows, holding twice the body. All are buffers (``len``, slices,
    ``find``, ``re``, ``memoryview``); only ``bytes`` is read-only.
    """
    declared = declared_length(request)
    if declared is not None:
        if declared > limit:
            raise _too_large(limit)
        whole = b""  # the body, while it has come in one piece
        body: bytearray | None = None
        filled = 0
        async for chunk in request.stream():
            end = filled + len(chunk)
            if end > declared:  # the server frames by Content-Length: never happens
                raise MalformedBody("The body is longer than its Content-Length.")
            if not filled:
                whole = chunk
            elif chunk:
                if body is None:
                    body = bytearray(declared)
                    body[:filled] = whole
                body[filled:end] = chunk
            filled = end
        if filled < declared:
            raise MalformedBody(f"The body ended after {filled} of {declared} bytes.")
        return whole if body is None else body
    buffer = mmap.mmap(-1, limit, flags=mmap.MAP_PRIVATE)
    filled = 0
    try:
        async for chunk in request.stream():
            end = filled + len(chunk)
            if end > limit:
                raise _too_large(limit)
            buffer[filled:end] = chunk
            filled = end
    except BaseException:
        buffer.close()
        raise
    if not filled:
        buffer.close()
        return bytearray()
    buffer.resize(filled)
    return buffer


async def read_npy(
    request: Request,
    check: Callable[[npy.NpyHeader], None],
    limit: int,
    score_dtype: str | None = None,
) -> np.ndarray:
    """A .npy body decoded while it arrives (:class:`service.api.npy.NpyStream`):
    ``check`` refuses the header's shape before the data are allocated, and a byte past
    the declared data is a 400 at once; a declared length over ``limit`` is a 413 before
    reading. ``score_dtype``: ``?dtype=`` (bfloat16 bit patterns)."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    stream = npy.NpyStream("The .npy body", check, score_dtype=score_dtype)
    async for chunk in request.stream():
        stream.feed(chunk)
    return stream.finish()


async def spool_body(request: Request, path: Path) -> int:
    """Stream the body to ``path`` (limits: :mod:`service.server.budget`); return its size."""
    total = 0
    pending = bytearray()
    with open(path, "wb") as f:
        async for chunk in request.stream():
            total += len(chunk)
            pending += chunk
            if len(pending) >= _FLUSH_BYTES:
                await anyio.to_thread.run_sync(f.write, bytes(pending))
                pending.clear()
        if pending:
            await anyio.to_thread.run_sync(f.write, bytes(pending))
    return total


#: Bytes of a split body's member written between two background flushes (fdatasync in
#: a thread of its own while the body still arrives: the store's fsync then has only the
#: last of them to wait for, and a last flush starts as the body ends, while it is read
#: and validated).
_SYNC_BYTES = 64 << 20


class _SplitWriter:
    """The files of :func:`spool_npz`. Each 1 MiB of the body (the pieces it arrived in,
    not joined) is routed in the event loop (:class:`~service.api.codecs.npz.MemberRouter`:
    a few slices); then one thread hashes the member's bytes (sha256) while another
    CRC-sums them and writes every slice where it goes (hashlib, the CRC and os.pwrite
    release the GIL), and a third flushes the member every :data:`_SYNC_BYTES` and once
    more at the end (:meth:`flush_rest`), through a descriptor of its own: nothing waits
    for those flushes here (the store's fsync does)."""

    def __init__(self, path: Path, member: Path, pool: ThreadPoolExecutor):
        self.router = npz.MemberRouter(SCORE_KEYS)
        self.pool = pool
        self.member_path = member
        self.sha256 = hashlib.sha256()
        self.crc32 = 0
        self.written = 0
        self.at = 0
        self.synced = 0
        self.jobs: list[Future] = []
        self.sync: Future | None = None
        self.body = os.open(path, os.O_WRONLY)
        try:
            self.member = os.open(member, os.O_WRONLY)
        except BaseException:
            os.close(self.body)
            raise

    def submit(self, pieces: list[bytes]) -> None:
        """Start the work of ``pieces`` (the body's next bytes, as received), after that of
        the pieces before (:meth:`wait`)."""
        runs = [run for piece in pieces for run in self.router.feed(piece)]
        views = [view for to_member, view in runs if to_member]
        self.jobs = [self.pool.submit(self._write, runs)]
        if views:
            self.jobs.append(self.pool.submit(self._hash, views))
        if self.written - self.synced >= _SYNC_BYTES and (self.sync is None or self.sync.done()):
            self.flush_rest()

    def flush_rest(self) -> None:
        """Start flushing what the member has so far (no-op when nothing new was written)."""
        if self.written > self.synced:
            self.synced = self.written
            self.sync = self.pool.submit(_flush, self.member_path)

    async def wait(self) -> None:
        for job in self.jobs:
            await asyncio.wrap_future(job)
        self.jobs = []

    def settle(self) -> None:
        """Block until no thread writes the files (a failed body's last piece)."""
        wait_futures(self.jobs)

    def _hash(self, views: list[memoryview]) -> None:
        for view in views:
            self.sha256.update(view)

    def _write(self, runs: list[tuple[bool, memoryview]]) -> None:
        for to_member, view in runs:
            if to_member:
                self.crc32 = crc32(view, self.crc32)
                _pwrite(self.member, view, self.written)
                self.written += len(view)
            else:
                _pwrite(self.body, view, self.at)
            self.at += len(view)

    def close(self) -> None:
        os.ftruncate(self.body, self.at)  # the body may end in the member's hole
        os.close(self.body)
        os.close(self.member)


def _flush(path: Path) -> None:
    """fdatasync of ``path`` (gone meanwhile: a failed upload's, nothing to flush)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


async def spool_npz(request: Request, path: Path, member: Path) -> npz.NpzBody:
    """Stream a .npz body to ``path``, its first stored score member's data to ``member``
    (:class:`~service.api.codecs.npz.MemberRouter`), hashed (sha256) and CRC-summed as they
    arrive: the reader checks them against the zip's directory and the store keeps the
    member file as it is (:func:`~service.api.codecs.npz.labelled_from_npz`).

    The body is handed to worker threads 1 MiB at a time, as the pieces it arrived in,
    while the next MiB arrives (:class:`_SplitWriter`): about two MiB are held.
    Limits: :mod:`service.server.budget`.
    """
    pool = ThreadPoolExecutor(3, thread_name_prefix="spool")
    try:
        writer = _SplitWriter(path, member, pool)
        try:
            pieces: list[bytes] = []
            held = 0
            async for chunk in request.stream():
                pieces.append(chunk)
                held += len(chunk)
                if held >= _FLUSH_BYTES:
                    await writer.wait()
                    writer.submit(pieces)
                    pieces, held = [], 0
            await writer.wait()
            if held:
                writer.submit(pieces)
                await writer.wait()
            writer.flush_rest()
        finally:
            writer.settle()
            writer.close()
    finally:
        pool.shutdown(wait=False)  # a flush may still run: its thread ends after it
    return npz.NpzBody(
        path, writer.at, writer.router.routed, member if writer.router.routed else None,
        writer.written, writer.crc32, writer.sha256.hexdigest(),
    )


_BOUNDARY = re.compile(rb"^[ -~]{1,200}$")
#: A multipart body's parts, the headers of a part, and the bytes of a header's name
#: or value, at most: they are held in memory (only the file's data go to disk).
MAX_PARTS = 64
MAX_PART_HEADERS = 32
MAX_HEADER_BYTES = 8 * 1024


async def spool_multipart_file(request: Request, path: Path, field: str = "file") -> int:
    """Stream the multipart field ``field`` to ``path``; other fields are skipped.

    Raises 400 for a body that is not multipart/form-data with a boundary and
    422 when the field is missing.
    """
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary or not _BOUNDARY.match(boundary):
        raise MalformedBody("multipart/form-data needs a boundary parameter in Content-Type.")

    state = {"name": None, "field": b"", "value": b"", "found": False, "done": False}
    headers: dict[bytes, bytes] = {}
    pending = bytearray()
    parts = 0

    def too_big(what: str, limit: int) -> MalformedBody:
        return MalformedBody(f"The multipart body has {what}; at most {limit}.")

    def on_part_begin() -> None:
        nonlocal parts
        parts += 1
        if parts > MAX_PARTS:
            raise too_big("more parts than allowed", MAX_PARTS)
        headers.clear()
        state["name"] = None

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]
        if len(state["field"]) > MAX_HEADER_BYTES:
            raise too_big("a part header name longer than allowed (bytes)", MAX_HEADER_BYTES)

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]
        if len(state["value"]) > MAX_HEADER_BYTES:
            raise too_big("a part header value longer than allowed (bytes)", MAX_HEADER_BYTES)

    def on_header_end() -> None:
        if len(headers) >= MAX_PART_HEADERS:
            raise too_big("a part with more headers than allowed", MAX_PART_HEADERS)
        headers[state["field"].lower()] = state["value"]
        state["field"] = state["value"] = b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        state["name"] = name.decode("latin-1") if name is not None else None
        if state["name"] == field:
            if state["found"]:
                raise MalformedBody(f"The multipart body has more than one {field!r} field.")
            state["found"] = True

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["name"] == field:
            pending.extend(data[start:end])

    def on_end() -> None:
        state["done"] = True

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_end": on_end,
        },
    )
    total = 0
    with open(path, "wb") as f:
        async for chunk in request.stream():
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise MalformedBody(f"The multipart body is malformed: {exc}.") from None
            if len(pending) >= _FLUSH_BYTES:
                total += len(pending)
                await anyio.to_thread.run_sync(f.write, bytes(pending))
                pending.clear()
        if pending:
            total += len(pending)
            await anyio.to_thread.run_sync(f.write, bytes(pending))
    if not state["done"]:
        raise MalformedBody("The multipart body ends before its closing boundary.")
    if not state["found"]:
        raise InvalidInput(f"The multipart body has no file field named {field!r}.")
    return total
