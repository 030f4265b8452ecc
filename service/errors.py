"""The service's domain errors: what went wrong, in the service's own words.

Storage, jobs, security and the body parsers raise these; they know nothing of
HTTP. :mod:`service.server.problems` is the one place that maps each class (and
``calibrators.CalibrationInputError``) to an RFC 9457 problem: its status, type
and title, and the headers some of them need.

Every error has a ``detail`` (one sentence for the caller, saying what was
expected and what was got) and ``extra``: the members a problem adds to its body
(``argmax`` for a rejected version, ``max_rows`` for too many rows...).
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """Base class: ``detail`` for the caller, ``extra`` keyword arguments for the problem body."""

    def __init__(self, detail: str, **extra: Any):
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class MalformedBody(ServiceError):
    """A body that cannot be decoded at all (a corrupt .npz, a truncated multipart)."""


class MalformedJSON(MalformedBody):
    """A body that is not JSON."""


class InvalidInput(ServiceError):
    """Decoded, but not what the operation takes (a shape, a field, a window)."""


class FitTooLarge(InvalidInput):
    """A fit whose memory estimate exceeds the worker's budget, refused before it runs.

    ``extra``: ``method``, ``estimate_bytes``, ``budget_bytes`` and ``max_classes`` (the
    largest K whose estimate fits the budget at the same number of rows; 0 if none).
    """


class UnsupportedMediaType(ServiceError):
    """A body in a format the operation does not read."""


class ContentTooLarge(ServiceError):
    """A body, or rows in it, over a configured limit."""


class NotFound(ServiceError):
    """No such model, dataset, version, alias or key (or another namespace's)."""


class Conflict(ServiceError):
    """The operation clashes with the registry's state (a duplicate name...)."""


class NotReady(Conflict):
    """A version whose status does not allow the operation (not fitted, not succeeded)."""

    def __init__(self, detail: str, *, version_status: str):
        super().__init__(detail, version_status=version_status)
        self.version_status = version_status


class ArgmaxChanged(Conflict):
    """A rejected version: its calibration changed held-out predicted classes."""

    def __init__(self, detail: str, *, argmax: dict[str, Any] | None):
        super().__init__(detail, argmax=argmax)
        self.argmax = argmax


class Unauthorized(ServiceError):
    """No API key, or an unknown, revoked or expired one."""


class Forbidden(ServiceError):
    """A valid key whose scope does not allow the operation."""


class TooManyRequests(ServiceError):
    """Over a rate: the caller may retry after ``retry_after`` whole seconds."""

    def __init__(self, detail: str, *, retry_after: int, **extra: Any):
        super().__init__(detail, **extra)
        self.retry_after = retry_after


class IdempotencyKeyReused(ServiceError):
    """An ``Idempotency-Key`` already used for a different request (another route, model,
    query or body) within its lifetime: nothing was done. ``extra``: ``idempotency_key``."""


class IdempotencyKeyInFlight(Conflict):
    """The first request with this ``Idempotency-Key`` is still being processed: retry the
    same request after ``retry_after`` whole seconds. ``extra``: ``idempotency_key``."""

    def __init__(self, detail: str, *, retry_after: int, **extra: Any):
        super().__init__(detail, **extra)
        self.retry_after = retry_after


class InUse(Conflict):
    """A delete refused because something still needs the object: an alias points at a
    version, a fit is queued or running, a version was fitted on a dataset. ``extra``
    names them (``aliases``, ``versions``, ``fits``)."""


class QuotaExceeded(Conflict):
    """The namespace holds as much as a quota allows: the request would pass its limit.

    ``extra``: ``quota`` (its name), ``setting`` (the environment variable), ``limit``,
    ``usage`` (what the namespace holds now) and ``requested`` (what the request adds).
    Deleting something frees room; retrying unchanged does not help.
    """


class RequestOverQuota(ContentTooLarge):
    """One request larger than a quota allows whatever the namespace holds (a dataset
    with more rows than ``dataset_rows``, or more bytes than the namespace may store).
    ``extra`` as for :class:`QuotaExceeded`."""


class RequestTimeout(ServiceError):
    """A client too slow to send its request body (``WELLTEMPERED_BODY_TIMEOUT_SECONDS``,
    ``BODY_MIN_BYTES_PER_SECOND``): nothing of it was used, and the connection is closed."""


class DatabaseUnavailable(ServiceError):
    """The database connection failed during the request (dropped, refused, timed out).

    ``applied`` says whether the request's change was committed: ``"no"`` (nothing was
    written: retrying is safe), ``"yes"`` (committed before the failure) or
    ``"unknown"`` (the connection failed during the commit itself: retry with the same
    ``Idempotency-Key`` where the route takes one). The caller may retry after
    ``retry_after`` whole seconds.
    """

    def __init__(self, detail: str, *, applied: str, retry_after: int = 1):
        super().__init__(detail, applied=applied)
        self.applied = applied
        self.retry_after = retry_after
