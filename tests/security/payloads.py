"""Hostile .npy, .npz and JSON bodies, built byte by byte (the tests and bench/fuzz_parsers.py).

numpy and zipfile refuse to write most of these, so the headers and zip records
are written here: a .npy header with any dict text, a zip whose members carry
any flags, compression method or declared sizes.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections.abc import Iterable

import numpy as np


def npy_header(shape, descr: str = "<f8", fortran: bool = False, *, text: str | None = None,
               version: tuple[int, int] = (1, 0), length: int | None = None) -> bytes:
    """The magic, version, length and header of a .npy; ``text`` replaces the dict,
    ``length`` the declared header length."""
    if text is None:
        text = repr({"descr": descr, "fortran_order": fortran, "shape": shape})
    body = text.encode("utf-8" if version[0] == 3 else "latin1")
    size_format = "<H" if version == (1, 0) else "<I"
    prefix = 6 + 2 + struct.calcsize(size_format)
    body += b" " * ((64 - (prefix + len(body) + 1) % 64) % 64) + b"\n"
    declared = len(body) if length is None else length
    return b"\x93NUMPY" + bytes(version) + struct.pack(size_format, declared) + body


def npy(shape, descr: str = "<f8", data: bytes | None = None, **kwargs) -> bytes:
    """A .npy with the header of ``shape``/``descr`` and ``data`` (zeros of the declared
    size when None and the shape is sane)."""
    if data is None:
        count = int(np.prod(shape)) if all(d >= 0 for d in shape) else 0
        data = bytes(count * np.dtype(descr).itemsize)
    return npy_header(shape, descr, **kwargs) + data


def array_npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def npz(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    """A zip of raw member bytes (names as given: add '.npy' yourself)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def patch_members(archive: bytes, *, flags: int | None = None, method: int | None = None,
                  file_size: int | None = None) -> bytes:
    """Set the general-purpose flags, compression method or uncompressed size of every
    member, in its local header and its central directory entry alike."""
    data = bytearray(archive)
    for sig, flag_at, method_at, size_at in ((b"PK\x03\x04", 6, 8, 22), (b"PK\x01\x02", 8, 10, 24)):
        at = data.find(sig)
        while at >= 0:
            if flags is not None:
                data[at + flag_at : at + flag_at + 2] = struct.pack("<H", flags)
            if method is not None:
                data[at + method_at : at + method_at + 2] = struct.pack("<H", method)
            if file_size is not None:
                data[at + size_at : at + size_at + 4] = struct.pack("<I", file_size)
            at = data.find(sig, at + 4)
    return bytes(data)


def deflated_member(name: str, head: bytes, zeros: int, chunk: int = 1 << 24) -> bytes:
    """A zip holding one deflated member: ``head`` then ``zeros`` zero bytes (a bomb: about
    1,000 times smaller than what it inflates to), written in chunks."""
    return deflated_members({name: (head, zeros)}, chunk)


def deflated_members(members: dict[str, tuple[bytes, int]], chunk: int = 1 << 24) -> bytes:
    """A zip of deflated members, each ``name: (head, zeros)``: its ``head`` then ``zeros``
    zero bytes, written in chunks (a valid .npz of zeros when each head declares them)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, (head, zeros) in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(info, "w", force_zip64=True) as f:
                f.write(head)
                block = bytes(min(chunk, zeros))
                left = zeros
                while left > 0:
                    f.write(block[: min(left, len(block))])
                    left -= len(block)
    return buf.getvalue()


def npy_bomb(shape, zeros: int, descr: str = "<f8") -> bytes:
    """The .npz bomb of issue 12: a deflated ``logits.npy`` whose header declares ``shape``
    (e.g. (-1, 10)), followed by ``zeros`` zero bytes; ``labels.npy`` of 10 rows."""
    scores = deflated_member("logits.npy", npy_header(shape, descr), zeros)
    labels = npy((10,), "<i8")
    return _merge(scores, {"labels.npy": labels})


def _merge(archive: bytes, extra: dict[str, bytes]) -> bytes:
    buf = io.BytesIO(archive)
    with zipfile.ZipFile(buf, "a") as zf:
        for name, data in extra.items():
            zf.writestr(name, data)
    return buf.getvalue()


def many_members(count: int, declared: int | None = None) -> bytes:
    """A zip of ``count`` empty members whose end record says ``declared`` entries."""
    data = bytearray(npz({f"a{i}.npy": b"" for i in range(count)}))
    if declared is not None:
        at = data.rfind(b"PK\x05\x06")
        data[at + 8 : at + 12] = struct.pack("<HH", declared, declared)
    return bytes(data)


def deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def endless(first: bytes, chunk: int = 1 << 16) -> Iterable[bytes]:
    """``first``, then zero bytes forever."""
    yield first
    zeros = bytes(chunk)
    while True:
        yield zeros
