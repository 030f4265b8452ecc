"""JSON score bodies, parsed without a Python float per number.

A JSON body is bounded in bytes by what its rows can need (:func:`json_body_limit`);
its number arrays are parsed in groups of rows straight into a float64 array
(:func:`json_object`), so no list of Python floats the size of the body ever
exists; rows are counted before parsing. Pure: no web framework.
"""

from __future__ import annotations

import mmap
import re
from typing import Any

import numpy as np
import orjson

from calibrators import topk
from calibrators.validation import as_labels
from service.api.codecs.rules import (
    CHAT_KEYS,
    CHUNK_BYTES,
    JSON_SCORE_KEYS,
    SEQUENCE_KEY,
    TOPK_KEYS,
    Bounds,
    Labelled,
    TopKRows,
    check_not_probabilities,
    resolve_kind,
    shorten,
    validated_scores,
    validated_sequences,
    validated_topk,
)
from service.errors import ContentTooLarge, InvalidInput, MalformedJSON

#: A JSON body may take this many bytes per number and per row, plus a constant:
#: enough for any float64 written by json.dumps, indented or not.
JSON_BYTES_PER_VALUE = 48

JSON_BYTES_PER_ROW = 64

JSON_BYTES_CONSTANT = 64 * 1024

#: And, where a body may give each row's sequence id (datasets), this many bytes more per
#: row: room for an id of some tens of characters on every row (the limit is the whole
#: body's, so longer ids fit where the scores take less than their allowance).
JSON_BYTES_PER_SEQUENCE_ID = 64

#: JSON number arrays are parsed in groups of about this many bytes; bodies up to this
#: size are parsed by orjson in one go (their Python objects are a constant).
_JSON_GROUP_BYTES = 1 << 20


def json_body_limit(bounds: Bounds, max_json_bytes: int) -> int:
    """Largest JSON body the rows and K of ``bounds`` can need (and the JSON limit)."""
    per_row = bounds.num_classes * JSON_BYTES_PER_VALUE + JSON_BYTES_PER_ROW
    if bounds.sequences:
        per_row += JSON_BYTES_PER_SEQUENCE_ID
    return min(max_json_bytes, JSON_BYTES_CONSTANT + bounds.max_rows * per_row)


def topk_json_limit(bounds: Bounds, k: int, max_json_bytes: int) -> int:
    """Largest JSON body the rows of ``bounds`` can need as top-k rows of width ``k``
    (``k`` ids and ``k`` log-probabilities a row), and the JSON limit."""
    per_row = 2 * k * JSON_BYTES_PER_VALUE + JSON_BYTES_PER_ROW
    return min(max_json_bytes, JSON_BYTES_CONSTANT + bounds.max_rows * per_row)


def _count(body, byte: bytes, start: int = 0, end: int | None = None) -> int:
    """``body.count(byte, start, end)``, for a memory map too (which has no ``count``)."""
    end = len(body) if end is None else end
    if not isinstance(body, mmap.mmap):
        return body.count(byte, start, end)
    view = np.frombuffer(body, np.uint8)
    value = byte[0]
    total = sum(
        int(np.count_nonzero(view[at : min(at + CHUNK_BYTES, end)] == value))
        for at in range(start, end, CHUNK_BYTES)
    )
    del view
    return total


def _loads(body) -> Any:
    if isinstance(body, mmap.mmap):
        with memoryview(body) as view:
            return orjson.loads(view)
    return orjson.loads(body)


_NON_FINITE = (b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"Inf", b"-inf", b"-NaN")


def decode_json(body: bytes | bytearray | mmap.mmap) -> Any:
    try:
        return _loads(body)
    except orjson.JSONDecodeError as exc:
        at = exc.pos
        near = bytes(body[at : at + 9])
        if "infinity" in str(exc) or near.startswith(_NON_FINITE):
            raise InvalidInput(
                "Non-finite numbers are not allowed: JSON has no NaN or Infinity, and scores "
                f"must be finite. Got {near.decode('latin1')!r} near char {at}."
            ) from None
        raise MalformedJSON(f"The body is not valid JSON: {exc}.") from None


_WS = rb"[ \t\n\r]*"

_OPEN = re.compile(_WS + rb"\{" + _WS)

_KEY = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]{0,63})"' + _WS + rb":" + _WS)

_AFTER_VALUE = re.compile(_WS + rb"([,}])" + _WS)

_INTEGER = re.compile(rb"-?(?:0|[1-9][0-9]{0,17})(?![0-9.eE])")

_NUMERIC = re.compile(rb"[-+0-9.eE,\[\] \t\n\r]*")

_ROWS_END = re.compile(rb"\]" + _WS + rb"\]")

_SEPARATOR = re.compile(_WS + rb"," + _WS)

_SPACE = re.compile(_WS)

_LITERALS = re.compile(rb"true|false|null")

_ID = rb'(?:"[^"\\]*(?:\\.[^"\\]*)*"|-?[0-9]+)'

#: A flat JSON array of strings or integers (sequence ids), up to and including its ']'.
_FLAT_ARRAY = re.compile(
    rb"\[" + _WS + rb"(?:" + _ID + _WS + rb"(?:," + _WS + _ID + _WS + rb")*)?\]"
)


def _may_hold_literals(body) -> bool:
    """Whether ``true``, ``false`` or ``null`` occur in ``body``: numpy would read a true
    among numbers as 1.0, so their rows are checked item by item.

    Each literal has a ``u`` or an ``f``, and no JSON number does: two ``memchr`` scans
    rule them out in well under a microsecond for a 1 x 1,000 body, where the regular
    expression alone took three times as long as parsing it (bench/README.md).

    >>> _may_hold_literals(b'{"logits": [[1.5e-3, -2]]}'), _may_hold_literals(b'[true]')
    (False, True)
    """
    if body.find(b"u") < 0 and body.find(b"f") < 0:
        return False
    return _LITERALS.search(body) is not None


def _numbers(text: bytes) -> np.ndarray | None:
    """``text``, a JSON array, as float64; None unless it parses to numbers of one shape."""
    try:
        arr = np.asarray(orjson.loads(text), dtype=np.float64)
    except (orjson.JSONDecodeError, ValueError, TypeError):
        return None
    return arr


def _array_2d(body, start: int, end: int, bounds: Bounds) -> np.ndarray | None:
    """The rows between ``start`` (a row's '[') and ``end`` (after the last row's ']'),
    parsed in groups of rows into one preallocated (N, K) float64 array."""
    n = _count(body, b"[", start, end)
    bounds.check_rows(n)
    out = None
    filled = 0
    pos = start
    while pos < end:
        cut = body.find(b"]", min(pos + _JSON_GROUP_BYTES, end - 1), end)
        block = _numbers(b"[" + bytes(body[pos : cut + 1]) + b"]")
        if block is None or block.ndim != 2 or filled + len(block) > n:
            return None
        if out is None:
            out = np.empty((n, block.shape[1]))
        elif block.shape[1] != out.shape[1]:
            return None
        out[filled : filled + len(block)] = block
        filled += len(block)
        pos = cut + 1
        if pos < end:
            sep = _SEPARATOR.match(body, pos)
            if sep is None or body[sep.end() : sep.end() + 1] != b"[":
                return None
            pos = sep.end()
    return out if filled == n else None


def _array_1d(body, start: int, end: int, bounds: Bounds) -> np.ndarray | None:
    """The numbers between ``start`` and ``end`` (a 1-D array's ']'), in groups."""
    if body.find(b"[", start, end) >= 0:
        return None
    n = _count(body, b",", start, end) + 1
    bounds.check_rows(n)
    out = np.empty(n)
    filled = 0
    pos = start
    while pos < end:
        cut = body.find(b",", pos + _JSON_GROUP_BYTES, end)
        cut = end if cut < 0 else cut
        block = _numbers(b"[" + bytes(body[pos:cut]) + b"]")
        if block is None or block.ndim != 1 or filled + len(block) > n:
            return None
        out[filled : filled + len(block)] = block
        filled += len(block)
        pos = cut + 1
    return out if filled == n else None


def _array(body, pos: int, bounds: Bounds) -> tuple[np.ndarray, int] | None:
    """The number array whose '[' is at ``pos``, and the position after it; None unless it
    is a plain 1-D or 2-D array of numbers."""
    limit = _NUMERIC.match(body, pos + 1).end()
    inner = _SPACE.match(body, pos + 1).end()
    first = body[inner : inner + 1]
    if first == b"]":
        return np.empty(0), inner + 1
    if first == b"[":
        close = _ROWS_END.search(body, inner, limit)
        if close is None:
            return None
        arr = _array_2d(body, inner, close.start() + 1, bounds)
        return None if arr is None else (arr, close.end())
    close = body.find(b"]", inner, limit)
    if close < 0:
        return None
    arr = _array_1d(body, inner, close, bounds)
    return None if arr is None else (arr, close + 1)


def plain_object(body, allowed: set[str], bounds: Bounds) -> dict[str, Any] | None:
    """A JSON object of plain keys whose values are number arrays or integers, parsed
    without a Python object per number; None for anything else (:func:`json_object` then
    reads it with orjson). What it returns is what orjson's parse would give, with the
    arrays as float64 (bench/fuzz_parsers.py compares the two)."""
    m = _OPEN.match(body)
    if m is None:
        return None
    pos, out = m.end(), {}
    if body[pos : pos + 1] == b"}":
        return out if _SPACE.match(body, pos + 1).end() == len(body) else None
    while True:
        m = _KEY.match(body, pos)
        if m is None:
            return None
        key = m.group(1).decode()
        if key in out or key not in allowed:
            return None
        pos = m.end()
        if key == SEQUENCE_KEY:  # strings or integers: a Python object per row, not per value
            m = _FLAT_ARRAY.match(body, pos)
            if m is None:
                return None
            out[key], pos = orjson.loads(m.group()), m.end()
        elif body[pos : pos + 1] == b"[":
            parsed = _array(body, pos, bounds)
            if parsed is None:
                return None
            out[key], pos = parsed
        else:
            m = _INTEGER.match(body, pos)
            if m is None:
                return None
            out[key], pos = int(m.group()), m.end()
        m = _AFTER_VALUE.match(body, pos)
        if m is None:
            return None
        pos = m.end()
        if m.group(1) == b"}":
            return out if pos == len(body) else None


def _quotes_only_in_keys(body, keys: int) -> bool:
    """Whether ``body``, a JSON object of ``keys`` keys, has no ``"`` but its keys' own
    (two each): then none of its values holds a string. One ``memchr`` per quote.

    >>> _quotes_only_in_keys(b'{"logits": [[1, 2]]}', 1), _quotes_only_in_keys(b'{"a": ["1"]}', 1)
    (True, False)
    """
    at = -1
    for _ in range(2 * keys + 1):
        at = body.find(b'"', at + 1)
        if at < 0:
            return True
    return False


def _only_numbers(
    key: str, value: Any, scan: bool, no_strings: bool = False, float32: bool = False
) -> Any:
    """A parsed array of numbers as float64. true/false/null are looked for when ``scan``
    (a 422: numpy would read true as 1.0 next to a float); strings, ragged or nested
    arrays are left as they are, for the core's message.

    ``no_strings`` (the body holds none, :func:`_quotes_only_in_keys`) and no ``scan``:
    numbers and lists are all there is, and numpy converts them to float64 in one pass
    (what :func:`_numbers` does for large bodies), without first discovering a dtype:
    a third of the conversion's time for a 1 x 1,000 predict. With ``float32`` (logits
    for the served graph, which computes in float32) they are converted to float32
    instead, the rounding of a float64 array cast to float32; a number past float32's
    range leaves them float64, for the serving path's message.
    """
    if not isinstance(value, list):
        return value
    if no_strings and not scan:
        try:
            if float32:
                with np.errstate(over="raise"):
                    return np.asarray(value, dtype=np.float32)
            return np.asarray(value, dtype=np.float64)
        except FloatingPointError:
            return np.asarray(value, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):
            pass  # ragged, nested or out of range: the checks below word it
    for row in value if scan else ():
        items = row if isinstance(row, list) else (row,)
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int | float | list):
                raise InvalidInput(
                    f"{key} must be a numeric array: JSON numbers only (read as float64), "
                    f"no strings, true, false or null. Got {shorten(item)}."
                )
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        return value
    return arr.astype(np.float64, copy=False) if arr.dtype.kind in "fiu" else value


def json_object(
    body: bytes | bytearray,
    allowed_keys: set[str],
    bounds: Bounds,
    float32_keys: tuple[str, ...] = (),
) -> dict:
    """The body as a JSON object with no keys but ``allowed_keys`` (400 if not JSON, else
    422); number arrays become float64 arrays (those of ``float32_keys`` float32 where
    they fit: :func:`_only_numbers`), rows limited by ``bounds`` (413)."""
    if len(body) > _JSON_GROUP_BYTES:
        plain = plain_object(body, allowed_keys, bounds)
        if plain is not None:
            return plain
    # Small bodies, and anything else (escaped keys, other value types, errors): orjson,
    # once the body is known to hold no more numbers than the row limit allows.
    allowed = bounds.max_rows * (bounds.num_classes + 2) + 64
    # Every number takes a byte: a body no longer than that cannot hold too many, and
    # then its commas and brackets need no counting (a 1 x 1,000 predict, every time).
    values = 0 if len(body) <= allowed else _count(body, b",") + _count(body, b"[")
    if values > allowed:
        raise ContentTooLarge(
            f"The JSON body holds up to {values} numbers, more than {bounds.max_rows} rows of "
            f"{bounds.num_classes} classes can need (WELLTEMPERED_MAX_"
            f"{bounds.what.upper()}_ROWS); split it.",
            max_rows=bounds.max_rows,
        )
    obj = decode_json(body)
    if not isinstance(obj, dict):
        raise InvalidInput(f"The body must be a JSON object. Got a {type(obj).__name__}.")
    unknown = set(obj) - allowed_keys
    if unknown:
        raise InvalidInput(
            f"Unknown field(s) {shorten(sorted(unknown))}; expected {sorted(allowed_keys)!r}."
        )
    scan = _may_hold_literals(body)
    plain = _quotes_only_in_keys(body, len(obj))
    raw = ("version", SEQUENCE_KEY)
    return {
        k: _only_numbers(k, v, scan, plain, k in float32_keys) if k not in raw else v
        for k, v in obj.items()
    }


def score_key(obj: dict, allowed: tuple[str, ...]) -> str:
    """The one key of ``allowed`` that ``obj`` holds (422 for none or several)."""
    present = [k for k in allowed if k in obj]
    if len(present) != 1:
        raise InvalidInput(
            f"The body must hold exactly one of {', '.join(map(repr, allowed))}. "
            f"Got {sorted(obj)!r}."
        )
    return present[0]


_JSON_FIX = "Send them under the key 'probabilities'."


def _json_scores(obj: dict, bounds: Bounds, kind: str | None) -> tuple[np.ndarray, str, bool]:
    # JSON numbers are finite (orjson refuses NaN, Infinity and numbers past float64's
    # range), so the scores' finiteness needs no check here.
    if bounds.dtype is not None:
        raise InvalidInput(
            f"?dtype={bounds.dtype} says how a binary body's raw scores are read; a JSON body "
            "holds numbers. Drop ?dtype, or send a .npy/.npz."
        )
    key = score_key(obj, JSON_SCORE_KEYS)
    kind, explicit = resolve_kind(kind, key, f"key {key!r}")
    scores = validated_scores(obj[key], kind, bounds.num_classes, bounds.model, finite=True)
    bounds.check_rows(scores.shape[0])
    return scores, kind, explicit


def scores_from_json(
    body: bytes | bytearray, bounds: Bounds, kind: str | None = None
) -> tuple[np.ndarray, str]:
    """``{"logits" | "probabilities": [[...]]}`` for predict: logits as float32 where they
    fit (the served graph's precision; probabilities stay float64, their log is taken
    first)."""
    obj = json_object(body, set(JSON_SCORE_KEYS), bounds, float32_keys=("logits",))
    scores, kind, explicit = _json_scores(obj, bounds, kind)
    check_not_probabilities(scores, kind, explicit, _JSON_FIX)
    return scores, kind


def labelled_from_json(
    body: bytes | bytearray,
    bounds: Bounds,
    kind: str | None = None,
    extra_keys: tuple[str, ...] = (),
) -> tuple[Labelled, dict[str, Any]]:
    """``{"logits" | "probabilities": [[...]], "labels": [...], <extra_keys>?}`` (and,
    where ``bounds.sequences``, optionally ``"sequence_ids": [...]``): the validated rows,
    and the values of ``extra_keys`` the body holds. Where ``bounds.unlabelled`` the
    labels may be left out (their ``labels`` is then None)."""
    sequence_key = (SEQUENCE_KEY,) if bounds.sequences else ()
    obj = json_object(body, {*JSON_SCORE_KEYS, "labels", *sequence_key, *extra_keys}, bounds)
    if "labels" not in obj and not bounds.unlabelled:
        score_key(obj, JSON_SCORE_KEYS)
        raise InvalidInput("The body must hold 'labels', one class index per row.")
    scores, kind, explicit = _json_scores(obj, bounds, kind)
    labels = (
        as_labels(obj["labels"], scores.shape[0], scores.shape[1]) if "labels" in obj else None
    )
    check_not_probabilities(scores, kind, explicit, _JSON_FIX)
    sequences = (
        validated_sequences(obj[SEQUENCE_KEY], scores.shape[0], bounds.max_bytes)
        if SEQUENCE_KEY in obj
        else None
    )
    return Labelled(scores, labels, kind, sequences), {k: obj[k] for k in extra_keys if k in obj}


#: The most bytes of a JSON body of top-k rows in the chat-completions shape: it is read
#: as Python objects (token strings, an object per alternative: about 6 times its bytes),
#: unlike number arrays; send more rows as arrays (``topk_ids``, ``topk_logprobs``) or as
#: a ``.npz``.
MAX_CHAT_JSON_BYTES = 16 << 20


def is_topk(body) -> bool:
    """Whether a JSON body holds top-k rows (its keys name them), before it is parsed."""
    return any(body.find(f'"{key}"'.encode()) >= 0 for key in (topk.LOGPROBS, "top_logprobs"))


def topk_from_json(body, bounds: Bounds, *, labelled: bool) -> TopKRows:
    """Top-k rows from JSON: ``{"topk_ids": [[...]], "topk_logprobs": [[...]],
    "vocab_size": V}`` (with ``labelled``, ``labels`` and optionally ``sequence_ids``), or
    the chat-completions shape (:data:`~service.api.codecs.rules.CHAT_KEYS`, optionally
    ``vocabulary`` and ``vocab_size``), whose labels are each position's own ``token``.
    ``vocab_size`` may be left out of a predict's body (the model's K)."""
    if body.find(b'"top_logprobs"') >= 0:
        return _chat_rows(body, bounds)
    ids_key, lp_key, v_key = TOPK_KEYS
    extra = ("labels", SEQUENCE_KEY) if labelled else ()
    obj = json_object(body, {*TOPK_KEYS, *extra}, bounds)
    needed = (ids_key, lp_key, v_key, "labels") if labelled else (ids_key, lp_key)
    missing = [k for k in needed if k not in obj]
    if missing:
        raise InvalidInput(
            f"A JSON body of top-k rows holds {', '.join(needed)}. Got {shorten(sorted(obj))}."
        )
    return validated_topk(
        _integers(obj[ids_key], ids_key), obj[lp_key], obj.get(v_key, bounds.num_classes),
        bounds, labels=obj.get("labels"), sequences=obj.get(SEQUENCE_KEY),
    )


def _integers(value: Any, name: str) -> Any:
    """JSON numbers read as float64 back to int64 when every one is an exact integer;
    anything else as it was (``calibrators.topk.as_topk`` words the refusal)."""
    arr = np.asarray(value) if isinstance(value, list) else value
    if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
        return arr
    if not (np.isfinite(arr).all() and (arr == np.round(arr)).all()
            and (np.abs(arr) <= 2**53).all()):
        raise InvalidInput(f"{name} must be integers (token ids). Got {shorten(arr.tolist())}.")
    return arr.astype(np.int64)


def _chat_rows(body, bounds: Bounds) -> TopKRows:
    """The chat-completions shape (:func:`topk_from_json`): each of ``choices`` is one
    sequence (its index the sequence id), ``logprobs`` one sequence without an id."""
    if len(body) > MAX_CHAT_JSON_BYTES:
        raise ContentTooLarge(
            f"A JSON body of top-k rows in the chat-completions shape may take at most "
            f"{MAX_CHAT_JSON_BYTES} bytes (its tokens are read as Python objects). Got "
            f"{len(body)}: send the rows as topk_ids and topk_logprobs arrays, or as a .npz.",
            max_bytes=MAX_CHAT_JSON_BYTES,
        )
    obj = decode_json(body)
    allowed = {*CHAT_KEYS, "vocabulary", topk.VOCAB_SIZE}
    if not isinstance(obj, dict) or set(obj) - allowed or sum(k in obj for k in CHAT_KEYS) != 1:
        raise InvalidInput(
            f"A chat-completions body of top-k rows is an object with one of "
            f"{' or '.join(CHAT_KEYS)}, and optionally vocabulary and {topk.VOCAB_SIZE}. "
            f"Got {shorten(sorted(obj) if isinstance(obj, dict) else type(obj).__name__)}."
        )
    choices = obj["choices"] if "choices" in obj else [{"logprobs": obj["logprobs"]}]
    if not isinstance(choices, list) or not choices:
        raise InvalidInput(f"choices must be a non-empty list. Got {shorten(choices)}.")
    contents = []
    for i, choice in enumerate(choices):
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(content, list):
            raise InvalidInput(
                f"choice {i} must hold logprobs.content, a list of positions. "
                f"Got {shorten(choice)}."
            )
        contents.append(content)
    positions = sum(map(len, contents))
    bounds.check_rows(positions)
    vocabulary = obj.get("vocabulary")
    if vocabulary is not None and not (
        isinstance(vocabulary, list) and all(isinstance(t, str) for t in vocabulary)
    ):
        raise InvalidInput("vocabulary must be a list of token strings (id = index).")
    rows, labels, names = topk.from_chat_logprobs(
        [p for c in contents for p in c], obj.get(topk.VOCAB_SIZE, bounds.num_classes),
        vocabulary,
    )
    sequences = (
        np.repeat(np.arange(len(contents)), [len(c) for c in contents])
        if "choices" in obj else None
    )
    return validated_topk(rows.ids, rows.logprobs, rows.vocab_size, bounds, labels=labels,
                          sequences=sequences, names=names)
