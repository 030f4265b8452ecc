"""API keys: who is calling (a namespace) and what they may do (a scope).

The model
---------
A key is ``wt_`` + 43 url-safe characters from :func:`secrets.token_urlsafe`
(256 random bits). Only its sha256 is stored (:class:`service.storage.db.ApiKey`); the
key itself is printed once, when created. A slow password hash (bcrypt,
argon2) exists to make *guessing* a low-entropy secret expensive; a 256-bit
random key cannot be guessed whatever the hash costs, and a leaked table of
sha256 digests gives nothing to invert. So a fast hash is enough, and it keeps
the hot path (predict) cheap. A key is found by its digest (a unique index);
the digest is then compared again with :func:`hmac.compare_digest`, so no
comparison of secret material is timing dependent in Python.

Tenant scopes are hierarchical: ``predict`` (predict, feedback, every read) <
``write`` (upload, fit, aliases, models) < ``admin`` (manage the keys of its
namespace). A key may do what its scope and every lower scope allow. The
``metrics`` scope stands apart: ``GET /metrics`` carries the series of every
namespace (names, versions, accuracy, traffic), so no tenant key may read it and
a metrics key may read nothing else. Metrics keys belong to the namespace
:data:`~service.vocabulary.METRICS_NAMESPACE`, which no tenant can have.

Every route gets one dependency, :func:`service.api.auth.authorize` (installed on
the app's router, so a route added later is covered too: deny by default), which
asks :meth:`Authenticator.authenticate` for the scope the route's budget declares
(:mod:`service.server.budget`); it answers 401 (missing, unknown, revoked or expired
key; with ``WWW-Authenticate: Bearer``) or 403 (scope too low) as
problem+json, and returns the caller's :class:`Principal`, which the model
lookups use: another namespace's model is not found, with the same 404 as a
missing one. Open routes: ``/healthz``, ``/readyz`` and the Open Inference
Protocol's ``/v2/health/live`` and ``/v2/health/ready`` (probes carry no keys, and
these say nothing about any tenant), ``/docs`` and ``/openapi.json`` (the API's
shape is public). ``/metrics`` on the API's address needs a ``metrics`` key (401
without one, like every keyed route); a scraper without a key uses the metrics
listener instead, bound to loopback by default (``WELLTEMPERED_METRICS_ADDRESS``,
:mod:`service.server.exporter`).

Once a key is known and not expired, and before its scope is checked, the
request is counted against the key's rate limit (429 with ``Retry-After``; a
token bucket per key and per process, :class:`service.security.limits.RateLimiter`,
when ``WELLTEMPERED_RATE_LIMIT_PER_SECOND`` > 0). Unknown keys are a 401
first, and the open routes are never limited.

With ``WELLTEMPERED_AUTH=off`` every request is an ``admin`` of the namespace
``default``, with no rate limit (there is no key to count against);
``welltempered serve`` then refuses a non-loopback address.
Keys never reach a log: nothing here logs the header, and error details name
at most a key's id and prefix.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio.to_thread
from sqlalchemy.orm import sessionmaker

from service.errors import Forbidden, Unauthorized
from service.security.limits import RateLimiter
from service.settings import Settings
from service.storage import keys as key_rows
from service.storage.db import as_utc
from service.storage.retry import retry_read
from service.vocabulary import DEFAULT_NAMESPACE, METRICS_SCOPE, TENANT_SCOPES

KEY_PREFIX = "wt_"
#: Characters of a key shown by ``keys list`` and in errors: "wt_" + 8 random ones.
SHOWN_CHARS = 11
#: The tenant hierarchy; the metrics scope has no rank (:meth:`Principal.allows`).
RANK = {scope: i for i, scope in enumerate(TENANT_SCOPES)}


@dataclass(frozen=True)
class Principal:
    """The caller: a namespace and a scope (``key_id`` None when auth is off or open)."""

    namespace: str
    scope: str
    key_id: int | None = None
    prefix: str | None = None

    def allows(self, scope: str) -> bool:
        """Tenant scopes by rank; the metrics scope only itself, and only by itself."""
        if METRICS_SCOPE in (scope, self.scope):
            return scope == self.scope
        return RANK[self.scope] >= RANK[scope]


ANONYMOUS = Principal(DEFAULT_NAMESPACE, "predict")
AUTH_OFF = Principal(DEFAULT_NAMESPACE, "admin")


def new_key() -> str:
    """A fresh key: ``wt_`` + 256 random bits, url-safe base64 (46 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class _Entry:
    digest: str
    principal: Principal
    expires_at: datetime | None


class KeyCache:
    """digest -> key row snapshot, trusted for ``ttl`` seconds (unknown keys are not cached)."""

    def __init__(self, ttl: float, size: int = 10_000):
        self.ttl = ttl
        self.size = size
        self._entries: dict[str, tuple[float, _Entry]] = {}
        self._lock = threading.Lock()

    def get(self, digest: str) -> _Entry | None:
        hit = self._entries.get(digest)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        return None

    def put(self, entry: _Entry) -> None:
        with self._lock:
            if len(self._entries) >= self.size:
                self._entries.clear()
            self._entries[entry.digest] = (time.monotonic() + self.ttl, entry)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _lookup(sessions, digest: str) -> _Entry | None:
    with sessions() as session:
        row = key_rows.live_key(session, digest)
        if row is None or not hmac.compare_digest(row.key_sha256, digest):
            return None
        principal = Principal(row.namespace, row.scope, row.id, row.prefix)
        return _Entry(digest, principal, as_utc(row.expires_at))


def bearer(header: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header (401 for anything else)."""
    if not header:
        raise Unauthorized("This endpoint needs an API key: send Authorization: Bearer <key>.")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Send the API key as Authorization: Bearer <key>.")
    return key


class Authenticator:
    """Per-app auth state: on/off, the key cache and the rate limiter (None: no limit).

    ``on_rate_limited(namespace)`` is called for each request the limit refuses.
    """

    def __init__(self, settings: Settings, on_rate_limited: Callable[[str], None] | None = None):
        self.enabled = settings.auth == "on"
        self.cache = KeyCache(settings.key_cache_seconds)
        self.limiter: RateLimiter | None = None
        if self.enabled and settings.rate_limit_per_second > 0:
            self.limiter = RateLimiter(
                settings.rate_limit_per_second,
                settings.rate_limit_burst,
                on_refused=on_rate_limited,
            )

    async def authenticate(
        self, header: str | None, need: str | None, sessions: sessionmaker
    ) -> Principal:
        """The caller of a request with the ``Authorization`` ``header`` to an operation
        that needs the scope ``need`` (None: open): 401, 429 or 403, or its
        :class:`Principal`."""
        if not self.enabled:
            return AUTH_OFF
        if need is None:
            return ANONYMOUS
        digest = key_digest(bearer(header))  # from here on, only the digest
        entry = self.cache.get(digest)
        if entry is None:
            # A read: once more on a fresh connection if the first one was dropped.
            entry = await anyio.to_thread.run_sync(retry_read, _lookup, sessions, digest)
            if entry is None:
                raise Unauthorized("The API key is unknown or revoked.")
            self.cache.put(entry)
        if entry.expires_at is not None and entry.expires_at <= datetime.now(UTC):
            raise Unauthorized(f"The API key {entry.principal.prefix}... has expired.")
        principal = entry.principal
        if self.limiter is not None:  # all the limit costs when it is off
            self.limiter.check(principal.key_id, principal.namespace, principal.prefix)
        if not principal.allows(need):
            raise Forbidden(
                f"This operation needs the {need!r} scope; the key {principal.prefix}... has "
                f"{principal.scope!r}."
            )
        return principal
