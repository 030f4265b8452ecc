"""Limits and back-pressure, beyond the body sizes of :mod:`service.api.uploads`.

Rows per predict and per dataset (413), classes per model (422), fits waiting
or running (429 with ``Retry-After``) and requests per API key (429 with
``Retry-After``). The fit count is read from the database, so it is the same
for every worker process and replica.

Requests per API key
--------------------
A token bucket per key (:class:`RateLimiter`): it holds at most
``WELLTEMPERED_RATE_LIMIT_BURST`` tokens, gains
``WELLTEMPERED_RATE_LIMIT_PER_SECOND`` tokens a second (by elapsed monotonic
time) and a request takes one; with none left the answer is 429 with
``Retry-After``, the whole seconds until one token is back (at least 1). A
refused request takes nothing. A key is sustained at the rate and may send a
burst of that many requests at once after being idle. The default rate, 0,
turns the limit off.

:meth:`service.security.auth.Authenticator.authenticate` applies it once the key is
known and not expired: an unknown key is still a 401, every request of a known key counts
(a 403 too), and the open routes (``/healthz``, ``/readyz``, ``/metrics``),
which need no key, are never limited. With ``WELLTEMPERED_AUTH=off`` there is
no key to count against, so there is no limit either (``serve`` then listens
on loopback only).

The limit is *per process*: the buckets live in the memory of each worker, so
with ``serve --workers N`` (or N replicas) a key gets up to N times the rate
and N times the burst. Sharing the buckets needs a store every worker reaches
on every request, which this service does not have: the database is off the
predict path when warm, and a database round trip would cost more than the
request. Redis (an atomic refill-and-take script per key) would be the next
step; meanwhile, set the rate per worker (the wanted total divided by N).

A bucket is keyed by the key's id (never the key), lives in an
:class:`~collections.OrderedDict` ordered by last use and costs O(1) per
request. A bucket unused for ``burst / rate`` seconds is full again, and a full
bucket behaves exactly like a missing one (a new key starts full), so each
request drops up to two full buckets from the least recently used end: memory
is bounded by the keys used in about the last ``burst / rate`` seconds (and
only keys found in the database get a bucket). No lock:
:meth:`RateLimiter.take` runs on the event loop (``authorize`` is async) and
never yields.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from sqlalchemy.orm import Session

from service.errors import ContentTooLarge, InvalidInput, TooManyRequests
from service.storage import fits, usage

#: Seconds a client is told to wait when the fit queue is full.
FIT_RETRY_AFTER_SECONDS = 30
#: Idle buckets dropped by one :meth:`RateLimiter.take` at most (O(1) per request;
#: each request adds at most one bucket, so two keep the idle ones from piling up).
_DROPS_PER_TAKE = 2


def check_rows(rows: int, limit: int, what: str) -> None:
    if what == "dataset":  # rows per dataset is a quota: its refusal names it
        usage.check_dataset_rows(rows, limit)
        return
    if rows > limit:
        raise ContentTooLarge(
            f"A {what} request holds at most {limit} rows (WELLTEMPERED_MAX_"
            f"{what.upper()}_ROWS); split it. Got {rows}.",
            max_rows=limit,
        )


def check_classes(num_classes: int, limit: int) -> None:
    if num_classes > limit:
        raise InvalidInput(
            f"num_classes must be at most {limit} (WELLTEMPERED_MAX_CLASSES). Got {num_classes}."
        )


def check_fit_queue(session: Session, namespace: str, per_namespace: int, limit: int) -> None:
    """429 when the namespace has ``per_namespace`` fits queued or running, or all
    namespaces together ``limit``: the answer names the limit that was hit."""
    mine = fits.count_unfinished(session, namespace)
    if mine >= per_namespace:
        raise TooManyRequests(
            f"namespace {namespace!r} has {mine} fits queued or running, its limit "
            f"(WELLTEMPERED_MAX_QUEUED_FITS_PER_NAMESPACE) is {per_namespace}: wait for one "
            "to finish, or cancel one.",
            retry_after=FIT_RETRY_AFTER_SECONDS,
            namespace=namespace,
            limit=per_namespace,
        )
    busy = fits.count_unfinished(session)
    if busy >= limit:
        raise TooManyRequests(
            f"{busy} fits are queued or running in all namespaces, the limit "
            f"(WELLTEMPERED_MAX_QUEUED_FITS) is {limit}: try again later.",
            retry_after=FIT_RETRY_AFTER_SECONDS,
            limit=limit,
        )


class RateLimiter:
    """Token buckets per API key, in this process: ``rate`` a second, ``burst`` at once.

    Parameters
    ----------
    rate : float
        Tokens gained per second (the sustained requests per second), > 0.
    burst : int
        Capacity of a bucket (requests at once after an idle time), >= 1.
    clock : callable () -> float, default :func:`time.monotonic`
        Seconds from any fixed origin, never decreasing. An attribute: tests
        replace it.
    on_refused : callable (namespace: str) -> None, optional
        Called by :meth:`check` for each refused request, with the key's
        namespace (the app counts it in
        ``welltempered_rate_limited_requests_total``).

    Examples
    --------
    >>> now = [0.0]
    >>> limiter = RateLimiter(rate=2.0, burst=2, clock=lambda: now[0])
    >>> [limiter.take("k") for _ in range(3)]
    [0.0, 0.0, 0.5]
    >>> now[0] = 0.5
    >>> limiter.take("k"), limiter.take("k")
    (0.0, 0.5)
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str], None] | None = None,
    ):
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(
                f"rate must be a finite number of requests per second > 0. Got {rate!r}."
            )
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError(f"burst must be an int >= 1. Got {burst!r}.")
        self.rate = float(rate)
        self.burst = burst
        self.clock = clock
        self.on_refused = on_refused
        self._capacity = float(burst)
        # key -> [tokens, time of the last take], least recently used first
        self._buckets: OrderedDict[Hashable, list[float]] = OrderedDict()

    def __len__(self) -> int:
        """Buckets held now."""
        return len(self._buckets)

    def take(self, key: Hashable) -> float:
        """Take a token of ``key``'s bucket: 0.0, or (refused) the seconds until one is back."""
        now = self.clock()
        buckets = self._buckets
        rate, capacity = self.rate, self._capacity
        for _ in range(_DROPS_PER_TAKE):
            if not buckets:
                break
            oldest = next(iter(buckets.values()))
            if oldest[0] + (now - oldest[1]) * rate < capacity:
                break  # the least recently used is not full yet: the others wait
            buckets.popitem(last=False)
        bucket = buckets.get(key)
        if bucket is None:
            tokens = capacity
            bucket = buckets[key] = [tokens, now]
        else:
            tokens = min(capacity, bucket[0] + (now - bucket[1]) * rate)
            bucket[1] = now
            buckets.move_to_end(key)
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return 0.0
        bucket[0] = tokens
        return (1.0 - tokens) / rate

    def check(self, key_id: Hashable, namespace: str, prefix: str | None) -> None:
        """Count one request of the key ``key_id`` (of ``namespace``, shown as ``prefix``);
        429 with ``Retry-After`` when over."""
        wait = self.take(key_id)
        if not wait:
            return
        if self.on_refused is not None:
            self.on_refused(namespace)
        retry = max(1, math.ceil(wait))
        raise TooManyRequests(
            f"The API key {prefix}... is over its rate limit of {self.rate:g}/s "
            f"with bursts of {self.burst} (WELLTEMPERED_RATE_LIMIT_PER_SECOND, "
            f"WELLTEMPERED_RATE_LIMIT_BURST; per worker process): retry in {retry} s.",
            retry_after=retry,
            rate_limit_per_second=self.rate,
            rate_limit_burst=self.burst,
        )
