"""The service's closed lists and names, and the rule of the text tenants store, each
written once.

The tables' CHECK constraints (:mod:`service.storage.db`), the request and
response schemas (:mod:`service.api.schemas`), the CLI and the tests import them
from here. A list another package owns is derived, never copied: the fit
methods are :data:`calibrators.METHODS` plus ``"auto"``, the score kinds are
:data:`calibrators.validation.KINDS`. Nothing of the service is imported here.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

import calibrators
from calibrators.validation import KINDS

__all__ = [
    "ALIAS_PATTERN",
    "ALLOWED_FORMAT_CHARACTERS",
    "ARGMAX_CHANGED",
    "ARGMAX_POLICIES",
    "AUTO",
    "BIDI_CONTROLS",
    "DEFAULT_ALIAS",
    "DEFAULT_ARGMAX_POLICY",
    "DEFAULT_NAMESPACE",
    "DURATION_UNITS",
    "FITTED",
    "FROM_PARAMS",
    "IDEMPOTENCY_STATES",
    "KEY_STATES",
    "KINDS",
    "LOOP_DEFAULTS",
    "LOOP_STATES",
    "LOOP_STEPS",
    "LOOP_TRIGGERS",
    "MAX_CLASS_NAMES_BYTES",
    "MAX_CLASS_NAME_CHARS",
    "MAX_DESCRIPTION_CHARS",
    "MAX_ID",
    "MAX_KEY_DESCRIPTION_CHARS",
    "MAX_LOOP_HOLDOUT",
    "MAX_LOOP_MARGIN",
    "MAX_RETENTION_DAYS",
    "METHODS",
    "METRICS_NAMESPACE",
    "METRICS_SCOPE",
    "MIN_LOOP_HOLDOUT",
    "NAMESPACE_PATTERN",
    "NAME_PATTERN",
    "NLL_WORSE",
    "REJECTION_REASONS",
    "SCOPES",
    "SCORE_DTYPES",
    "STATUSES",
    "TENANT_SCOPES",
    "UNFINISHED",
    "VERSION_SOURCES",
    "check_names",
    "check_text",
    "format_duration",
    "longest_name_bytes",
    "parse_duration",
]

#: The method of a fit that tries every calibrator and keeps the best held-out NLL.
AUTO = "auto"
#: What a fit may ask for: one of :data:`calibrators.METHODS`, or :data:`AUTO`.
METHODS: tuple[str, ...] = (*calibrators.METHODS, AUTO)

#: ``?dtype=`` of a binary body: scores numpy has no dtype for, sent as raw bit patterns
#: (service.api.codecs reads them).
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

#: Why a version is ``rejected`` (its ``rejected_for``; each comes with a sentence in
#: its ``rejection``): it changed held-out predicted classes under ``argmax_policy``
#: ``require``, or its held-out NLL is worse than the uncalibrated scores' beyond the
#: tolerance of :mod:`service.jobs.evaluation` (whatever the policy).
ARGMAX_CHANGED = "argmax-changed"
NLL_WORSE = "nll-worse-than-uncalibrated"
REJECTION_REASONS = (ARGMAX_CHANGED, NLL_WORSE)

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

#: The recalibration loop (:mod:`service.jobs.loop`). What started a run: a request
#: (``POST .../loop/runs``) or a drift verdict on a feedback post (the model opts in).
LOOP_TRIGGERS = ("request", "drift")
#: A run's state: its candidate is being fitted, then its outcome. ``waiting``: the
#: candidate beat production by the margin but the model does not promote
#: automatically: it waits for the user to move the alias.
LOOP_STATES = ("fitting", "promoted", "waiting", "not-promoted", "failed")
#: The steps of a run, each one event the user lists (``GET .../loop/events``).
LOOP_STEPS = ("started", "candidate-fitted", "evaluated", "promoted", "not-promoted", "failed")
#: The loop's defaults, each documented in docs/api.md: kept rows at most
#: (``retention_rows``) and for at most ``retention_days``; the share of the kept rows
#: held back to compare the candidate with production (``holdout``); the NLL (nats per
#: row) by which the candidate must beat production to be promoted (``margin``).
LOOP_DEFAULTS = {"retention_rows": 50_000, "retention_days": 30, "holdout": 0.3, "margin": 0.01}
#: Bounds of the loop's settings: a retention within a year; a holdout that leaves
#: rows on both sides; a margin of at most 1 nat per row.
MAX_RETENTION_DAYS = 366
MIN_LOOP_HOLDOUT, MAX_LOOP_HOLDOUT = 0.1, 0.9
MAX_LOOP_MARGIN = 1.0

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


# ---------------------------------------------------------------------------
# Text a tenant stores and the service echoes (class names, descriptions).
# Checked on write, at the edge (the request schemas, the CLI): rows stored before
# these rules still load and serve. docs/api.md, "Text a model stores", says why.

#: Longest class name, in characters: a name is a label, not a document. Its UTF-8
#: is at most 4 times as many bytes (512), what a predict answer repeats per row.
MAX_CLASS_NAME_CHARS = 128
#: All class names of a model together, in UTF-8 bytes (64 KiB): a thousand names
#: (ImageNet's classes) of 64 bytes each fit; a vocabulary of tens of thousands of tokens is
#: served by index. Every model read carries them, so a page of GET /v1/models
#: (at most 1,000 models) stays within 64 MiB of names.
MAX_CLASS_NAMES_BYTES = 64 * 1024
#: Longest model description, in characters.
MAX_DESCRIPTION_CHARS = 1024
#: Longest API key description, in characters (the ``api_keys.description`` column).
MAX_KEY_DESCRIPTION_CHARS = 256

#: Bidirectional formatting characters (Unicode category Cf): each reorders the text
#: displayed around it, so "cat\u202egod" reads as another name (CVE-2021-42574).
BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
#: The only format characters (Cf) allowed: the zero-width non-joiner and joiner,
#: which Persian, the Indic scripts and emoji sequences (a family, a profession) need.
#: Every other one is invisible (soft hyphen, zero-width space, word joiner, byte
#: order mark, the tag characters that can spell hidden text, ...) and refused.
ALLOWED_FORMAT_CHARACTERS = frozenset("\u200c\u200d")

_REFUSED = {
    "Cc": "a control character (a name or description is one line of printable text)",
    "Zl": "a line separator (a name or description is one line of text)",
    "Zp": "a paragraph separator (a name or description is one line of text)",
    "Cs": "a lone surrogate (not a character: UTF-8 cannot encode it)",
    "Cf": "an invisible format character (only U+200C and U+200D, the zero-width "
    "non-joiner and joiner that some scripts and emoji need, are allowed)",
}
_BIDI = (
    "a bidirectional formatting character (U+061C, U+200E, U+200F, U+202A to U+202E, "
    "U+2066 to U+2069), which reorders the text displayed around it"
)


def _shown(value: str, most: int = 40) -> str:
    """``value`` as a short Python literal for a message (escapes what it refuses)."""
    return repr(value) if len(value) <= most else f"{value[:most]!r}... ({len(value)} characters)"


def _refused(char: str) -> str | None:
    """Why ``char`` may not be in stored text, or None."""
    if char in BIDI_CONTROLS:
        return _BIDI
    category = unicodedata.category(char)
    if category == "Cf" and char in ALLOWED_FORMAT_CHARACTERS:
        return None
    return _REFUSED.get(category)


def check_text(value: str, what: str, max_chars: int, *, name: bool = False) -> str:
    """``value`` if it may be stored as ``what``, else a ``ValueError`` that names
    ``what``, the limit or the refused character's code point.

    One line of at most ``max_chars`` characters, without control characters (Cc),
    line or paragraph separators (Zl, Zp), lone surrogates (Cs), bidirectional
    formatting characters (:data:`BIDI_CONTROLS`) or other format characters (Cf)
    except :data:`ALLOWED_FORMAT_CHARACTERS`. A ``name`` is also not empty and has no
    whitespace at either end (``"cat "`` would look like ``"cat"``). Combining marks,
    any script, emoji, private-use and unassigned code points are text.

    >>> check_text("chat noir", "class_names[0]", 128, name=True)
    'chat noir'
    >>> check_text("cat\\u202egod", "class_names[0]", 128)
    Traceback (most recent call last):
    ...
    ValueError: class_names[0] must not contain a bidirectional formatting character (U+061C, U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069), which reorders the text displayed around it. Got U+202E at character 3 of 'cat\\u202egod'.
    """  # noqa: E501
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string. Got {type(value).__name__}.")
    if len(value) > max_chars:
        raise ValueError(f"{what} must have at most {max_chars} characters. Got {len(value)}.")
    if name and not value.strip():
        raise ValueError(f"{what} must not be empty or only whitespace. Got {value!r}.")
    if not value.isprintable():  # the common case, printable text, costs one C loop
        for at, char in enumerate(value):
            reason = _refused(char)
            if reason is not None:
                raise ValueError(
                    f"{what} must not contain {reason}. "
                    f"Got U+{ord(char):04X} at character {at} of {_shown(value)}."
                )
    if name and value != value.strip():
        raise ValueError(
            f"{what} must not begin or end with whitespace (it would look like another "
            f"name). Got {_shown(value)}."
        )
    return value


def check_names(names: list[str], what: str = "class_names") -> list[str]:
    """``names`` if they may be stored as a model's class names, else a ``ValueError``.

    Each is a name of at most :data:`MAX_CLASS_NAME_CHARS` characters
    (:func:`check_text`); all of them together are at most
    :data:`MAX_CLASS_NAMES_BYTES` bytes of UTF-8; no two are the same text once in
    Unicode normal form C (``"e\\u0301"`` and ``"\\u00e9"`` are both "é").

    >>> check_names(["cat", "cat"])
    Traceback (most recent call last):
    ...
    ValueError: class_names must be distinct: class_names[1] is class_names[0]. Got 'cat'.
    """
    for i, value in enumerate(names):
        check_text(value, f"{what}[{i}]", MAX_CLASS_NAME_CHARS, name=True)
    total = sum(len(value.encode()) for value in names)
    if total > MAX_CLASS_NAMES_BYTES:
        raise ValueError(
            f"{what} must have at most {MAX_CLASS_NAMES_BYTES} bytes of UTF-8 in all "
            f"(label a larger vocabulary by index). Got {total}."
        )
    seen: dict[str, int] = {}
    for i, value in enumerate(names):
        first = seen.setdefault(unicodedata.normalize("NFC", value), i)
        if first == i:
            continue
        if names[first] == value:
            raise ValueError(
                f"{what} must be distinct: {what}[{i}] is {what}[{first}]. Got {_shown(value)}."
            )
        raise ValueError(  # the same text spelt with other code points
            f"{what} must be distinct: {what}[{i}] is {what}[{first}] in Unicode normal "
            f"form C. Got {names[first]!a} and {value!a}."
        )
    return names


def longest_name_bytes(names: Iterable[str] | None) -> int:
    """The longest UTF-8 length of ``names`` in bytes; 0 for None or none. What an answer
    that names one class per row costs per row, at most (stored names: any length).

    >>> longest_name_bytes(["cat", "chat", "猫"]), longest_name_bytes(None)
    (4, 0)
    """
    return max((len(name.encode("utf-8", "surrogatepass")) for name in names or ()), default=0)
