"""``Idempotency-Key`` on the unsafe routes: one dependency, the same rules everywhere.

A route that takes a key declares the dependency :func:`idempotent` made for its body (the
JSON body FastAPI parsed, or the dependency that reads or spools an upload), and
does three things with the :class:`Claim` it gets::

    if claim.replay is not None:
        return claim.replay                      # a retry: the first answer, again
    ...                                          # the work
    claim.store(session, answer, status_code=201, headers={"Location": url})
    session.commit()                             # (or the route's write commits)

The dependency runs after the model is found and the body is read, before the
handler: it computes the request's fingerprint (:func:`fingerprint`) and claims the
key (:func:`service.storage.idempotency.begin`), so a used key is judged by what was
sent before the body is validated: a different request is a 422
``idempotency-key-reused``, whatever its body; one still in progress a 409
``idempotency-key-in-flight`` with ``Retry-After``; the same request, done, the stored
answer with ``Idempotent-Replayed: true``. :meth:`Claim.store` puts the answer in
the transaction of the write; if the handler fails, the key is released (errors are
not stored: the request may be corrected and sent again with the key).

The rules are those of the IETF draft "The Idempotency-Key HTTP Header Field"
(draft-ietf-httpapi-idempotency-key-header): a fingerprint of the request payload
next to the key, 422 for a key reused with another payload, 409 for a request
retried while the first is still processed, both problem documents.
"""

# No ``from __future__ import annotations``: the dependency :func:`idempotent` makes
# names its route's body dependency in an annotation, which FastAPI must see evaluated.
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from fastapi import Depends, Header, Request
from fastapi.dependencies.models import Dependant
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from service.api.codecs.npz import NpzBody
from service.api.deps import AppState, ModelDep, SessionDep, StateDep
from service.api.uploads import Upload
from service.storage import idempotency, retry
from service.storage.db import IdempotencyKey

log = logging.getLogger("welltempered.service")

#: The header a replayed answer carries (the name Stripe and others use; the draft
#: leaves it to the server).
REPLAYED = "Idempotent-Replayed"

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Any string unique to this request (a UUID). A retry of the same "
        "request (route, path, query and body) with the key within "
        "WELLTEMPERED_IDEMPOTENCY_KEY_SECONDS gets the first answer again, with "
        "Idempotent-Replayed: true, and is not applied twice: retry with it after a "
        "timeout or a 503 whose 'applied' is 'unknown'. The key with a different request "
        "is a 422 (idempotency-key-reused); while the first request with it is in "
        "progress, a 409 (idempotency-key-in-flight, with Retry-After).",
    ),
]

_CHUNK = 1 << 20


def body_sha256(body: bytes | bytearray | memoryview | Upload) -> str:
    """The sha256 of a body as read: the buffer of a JSON body, or the file an upload
    was spooled to, read a chunk at a time (a multipart upload: its ``file`` field); a body
    spooled split, :meth:`NpzBody.digest` (its member hashed once, as it arrived)."""
    if isinstance(body, Upload):
        if body.npz is None:
            body = body.json
        elif isinstance(body.npz, NpzBody):
            return body.npz.digest()
        else:
            with open(body.npz, "rb") as f:
                return hashlib.file_digest(f, "sha256").hexdigest()
    return hashlib.sha256(body).hexdigest()


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route declares (its own and its dependencies')."""
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def fingerprint(request: Request, body_digest: str) -> tuple[str, str]:
    """The request's route (``POST /v1/models/{model}/datasets``) and fingerprint: the
    sha256 of the route, its path parameters, the query parameters the route declares
    (others change nothing), and the body's digest."""
    route = request.scope["route"]
    template = f"{request.method} {route.path}"
    names = _query_names(route.dependant)
    query = sorted((k, v) for k, v in request.query_params.multi_items() if k in names)
    document = {
        "route": template,
        "path": request.path_params,
        "query": query,
        "body": body_digest,
    }
    return template, hashlib.sha256(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass
class Claim:
    """The request's ``Idempotency-Key``, claimed: ``replay`` is the stored answer of a
    retry (send it, do nothing), else :meth:`store` the answer with the write. Without
    a key both are no-ops."""

    key: str | None = None
    replay: JSONResponse | None = None
    attempt: idempotency.Attempt | None = None
    stored: bool = False

    def store(
        self,
        session: Session,
        answer: Any,
        *,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        """The answer, in the write's transaction, before its commit."""
        if self.attempt is None:
            return
        idempotency.complete(
            session, self.attempt, status_code, jsonable_encoder(answer), headers or {}
        )
        self.stored = True


def replayed(row: IdempotencyKey) -> JSONResponse:
    """The stored answer of the first request with the key."""
    return JSONResponse(
        row.response,
        status_code=row.status_code or 200,
        headers={**(row.headers or {}), REPLAYED: "true"},
    )


#: Seconds a failed request keeps trying to free its key (each try on a fresh
#: connection, waits growing from 0.1 s: :func:`service.storage.retry.until_reachable`).
RELEASE_SECONDS = 5.0


def _release_once(state: AppState, attempt: idempotency.Attempt) -> None:
    with state.sessions() as session:
        idempotency.release(session, attempt)


def _release(state: AppState, request_session: Session, attempt: idempotency.Attempt) -> None:
    # The request's transaction first: it may hold the key's row (an answer stored before
    # a failed commit), which the release would wait for. Then a session of its own: the
    # request's may be broken by the failure being handled.
    # Tries spread over a few seconds: when connections are being cut, the one the
    # release gets may be cut too (three tries in a row all were, under a cut every
    # 50 ms), and a key left in flight answers the client's retries 409 until its
    # lease passes.
    try:
        request_session.rollback()
    except Exception as exc:
        if not retry.is_transient(exc):
            raise
    try:
        retry.until_reachable(
            _release_once, state, attempt, wait_seconds=RELEASE_SECONDS,
            what=f"freeing Idempotency-Key {attempt.key!r}",
        )
    except Exception as exc:
        if not retry.is_transient(exc):
            raise
        # The database is gone: the key stays in flight until its lease passes.
        log.warning("could not release Idempotency-Key %r (%s)", attempt.key, type(exc).__name__)


def idempotent(body: Callable[..., Any]) -> Any:
    """The ``Annotated`` dependency of a route whose body is what ``body`` (a dependency)
    gives: bytes, or an :class:`~service.api.uploads.Upload`."""

    def claim(
        request: Request,
        state: StateDep,
        model: ModelDep,
        session: SessionDep,
        content: Annotated[Any, Depends(body)],
        key: IdempotencyKeyHeader = None,
    ) -> Iterator[Claim]:
        if key is None:
            yield Claim()
            return
        route, print_ = fingerprint(request, body_sha256(content))
        settings = state.settings
        found = idempotency.begin(
            session,
            model.namespace,
            key,
            model_id=model.id,
            route=route,
            fingerprint=print_,
            ttl=settings.idempotency_key_seconds,
            lease=settings.idempotency_lease_seconds,
        )
        if isinstance(found, IdempotencyKey):
            yield Claim(key, replay=replayed(found))
            return
        claimed = Claim(key, attempt=found)
        try:
            yield claimed
        except BaseException:
            _release(state, session, found)
            raise
        if not claimed.stored:  # answered without storing (a handler's bug): free the key
            _release(state, session, found)

    return Annotated[Claim, Depends(claim)]


async def json_body(request: Request) -> bytes:
    """The body of a route whose body FastAPI parsed (already read: no second copy)."""
    return await request.body()


#: The dependency of the routes whose body is a JSON model (fits, imports).
IdempotentJson = idempotent(json_body)
