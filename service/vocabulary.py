"""The service's closed lists and names, each written once.

The tables' CHECK constraints (:mod:`service.storage.db`), the request and
response schemas (:mod:`service.api.schemas`), the CLI and the tests import them
from here. A list another package owns is derived, never copied: the fit
methods are :data:`calibrators.METHODS` plus ``"auto"``, the score kinds are
:data:`calibrators.validation.KINDS`. Nothing of the service is imported here.
"""

from __future__ import annotations

import re

import calibrators
from calibrators.validation import KINDS

__all__ = [
    "ALIAS_PATTERN",
    "ARGMAX_POLICIES",
    "AUTO",
    "DEFAULT_ALIAS",
    "DEFAULT_ARGMAX_POLICY",
    "DEFAULT_NAMESPACE",
    "DURATION_UNITS",
    "FITTED",
    "FROM_PARAMS",
    "IDEMPOTENCY_STATES",
    "KEY_STATES",
    "KINDS",
    "MAX_ID",
    "METHODS",
    "METRICS_NAMESPACE",
    "METRICS_SCOPE",
    "NAMESPACE_PATTERN",
    "NAME_PATTERN",
    "SCOPES",
    "SCORE_DTYPES",
    "STATUSES",
    "TENANT_SCOPES",
    "UNFINISHED",
    "VERSION_SOURCES",
    "format_duration",
    "parse_duration",
]

#: The method of a fit that tries every calibrator and keeps the best held-out NLL.
AUTO = "auto"
#: What a fit may ask for: one of :data:`calibrators.METHODS`, or :data:`AUTO`.
METHODS: tuple[str, ...] = (*calibrators.METHODS, AUTO)

#: ``?dtype=`` of a binary body: scores numpy has no dtype for, sent as raw bit patterns
#: (service.api.ingest reads them).
SCORE_DTYPES = ("bfloat16",)

#: What a model does with a calibrator that changes held-out predicted classes:
#: ``require`` stores it ``rejected`` (never served), ``warn`` serves it with a
#: warning, ``off`` serves it.
ARGMAX_POLICIES = ("require", "warn", "off")
DEFAULT_ARGMAX_POLICY = "require"

#: The life of a calibrator version (which is also its fit job). ``cancelled``: a
#: user stopped it (``POST .../cancel``) while it was queued or running.
STATUSES = ("queued", "running", "succeeded", "rejected", "failed", "cancelled")
#: Waiting for, or in, a fit worker.
UNFINISHED = ("queued", "running")
#: Fitted: params and hold-out metrics exist (only ``succeeded`` may be served).
FITTED = ("succeeded", "rejected")

#: The source of a version from posted parameters (``POST .../calibrators/import``):
#: queued like a fit, its job evaluates them instead of fitting.
FROM_PARAMS = "params"
#: Where a version's params come from: a fit here, or posted parameters (evaluated here).
VERSION_SOURCES = ("fit", FROM_PARAMS)

#: The scopes of a tenant's API keys, lowest first: each allows what the ones before it
#: allow, in the key's namespace. An ``admin`` key may create keys of these scopes.
TENANT_SCOPES = ("predict", "write", "admin")
#: The scope of the scraper's key: ``GET /metrics`` only, which carries every namespace's
#: series, so it is outside the tenant hierarchy (no tenant key reads /metrics, and a
#: metrics key reads nothing else). Created by the operator (``welltempered keys``).
METRICS_SCOPE = "metrics"
#: Every API key scope (the ``api_keys.scope`` CHECK constraint).
SCOPES = (*TENANT_SCOPES, METRICS_SCOPE)
KEY_STATES = ("active", "expired", "revoked")

#: An ``Idempotency-Key``'s row: its first request still being processed, or done (its
#: answer stored, committed with the request's write).
IN_FLIGHT, DONE = "in_flight", "done"
IDEMPOTENCY_STATES = (IN_FLIGHT, DONE)

#: The alias predict, feedback and monitoring use when the request names no version.
DEFAULT_ALIAS = "production"
#: The namespace of models created before namespaces existed, and with auth off.
DEFAULT_NAMESPACE = "default"

#: A model's name: URL-safe, 1 to 128 characters.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: An alias, and a namespace: URL-safe, 1 to 64 characters.
ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAMESPACE_PATTERN = ALIAS_PATTERN
#: The namespace stored on a metrics key: it reads the series of every namespace, and
#: no tenant's namespace can be spelt this way (:data:`NAMESPACE_PATTERN`), so no
#: tenant admin lists or revokes it.
METRICS_NAMESPACE = "*"
#: Ids and version numbers are 32-bit integers in the database: bound them at the
#: edge, or a huge number would become a driver error instead of a 404/422.
MAX_ID = 2**31 - 1

#: Seconds per unit of a duration (``30m``, ``7d``), largest last.
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION = re.compile(r"^([1-9][0-9]{0,6})([smhdw])$")


def parse_duration(text: str) -> int:
    """Seconds of a duration: a positive integer and one unit of s, m, h, d, w.

    Used for monitoring windows (``?window=7d``) and key lifetimes
    (``keys create --expires 30d``). No spaces, no leading zero, lower-case units.

    >>> parse_duration("90m"), parse_duration("7d")
    (5400, 604800)
    """
    match = _DURATION.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            "a duration is a positive integer followed by one unit of s, m, h, d, w "
            f"(e.g. 30m, 1h, 7d). Got {text!r}."
        )
    return int(match.group(1)) * DURATION_UNITS[match.group(2)]


def format_duration(seconds: int) -> str:
    """The shortest exact spelling of a duration, the inverse of :func:`parse_duration`.

    >>> format_duration(3600), format_duration(5400), format_duration(61)
    ('1h', '90m', '61s')
    """
    for unit in ("w", "d", "h", "m"):
        if seconds % DURATION_UNITS[unit] == 0:
            return f"{seconds // DURATION_UNITS[unit]}{unit}"
    return f"{seconds}s"
