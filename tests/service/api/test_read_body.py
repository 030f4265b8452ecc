"""service.api.uploads.read_body: a body with a Content-Length read whole, in one piece or
several, into the buffer its parsers take."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from starlette.requests import Request

from service.api.uploads import read_body
from service.errors import MalformedBody


def request(pieces: list[bytes], declared: int) -> Request:
    messages = [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
        for i, piece in enumerate(pieces)
    ]

    async def receive():
        return messages.pop(0)

    headers = [(b"content-length", str(declared).encode())]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


BODY = bytes(range(256)) * 40


def test_a_body_in_one_piece_is_kept_as_it_came():
    got = asyncio.run(read_body(request([BODY], len(BODY)), 1 << 20))
    assert got is not None and type(got) is bytes and got == BODY


@pytest.mark.parametrize(
    "cuts", [[1], [100, 5000], [0, 10, 10, len(BODY) - 1]], ids=["first-byte", "three", "empty"]
)
def test_a_body_in_several_pieces_is_joined_into_one_buffer(cuts):
    bounds = [0, *cuts, len(BODY)]
    pieces = [BODY[a:b] for a, b in itertools.pairwise(bounds)]
    got = asyncio.run(read_body(request(pieces, len(BODY)), 1 << 20))
    assert type(got) is bytearray and got == BODY


@pytest.mark.parametrize("pieces", [[BODY[:10]], [BODY[:10], BODY[10:20]]])
def test_a_body_shorter_than_declared_is_refused(pieces):
    with pytest.raises(MalformedBody, match=r"ended after (10|20) of"):
        asyncio.run(read_body(request(pieces, len(BODY)), 1 << 20))


def test_a_body_longer_than_declared_is_refused():
    with pytest.raises(MalformedBody, match="longer than its Content-Length"):
        asyncio.run(read_body(request([BODY, b"x"], len(BODY)), 1 << 20))
