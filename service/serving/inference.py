"""Predictions through ONNX Runtime: one session per calibrator version, cached.

A fitted version is immutable, so its session is built once per process from
the stored params (``calibrators.from_params(params).to_onnx()``) and reused;
``InferenceSession.run`` is thread-safe, so the handlers (plain ``def``, in the
thread pool) share it. Intra-op threads come from the settings: several
requests in parallel already use the cores.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import anyio.to_thread
import numpy as np
import onnxruntime as ort
from sqlalchemy.orm import sessionmaker

import calibrators
from calibrators import topk
from calibrators.numerics import row_chunks
from calibrators.validation import KINDS, PROBABILITY_FLOOR, CalibrationInputError
from service.errors import InvalidInput
from service.storage.registry import resolve_served
from service.storage.retry import retry_read
from service.vocabulary import longest_name_bytes

#: The outputs of every calibrator's graph (calibrators.onnx_export).
OUTPUTS = ("probabilities", "label", "confidence", "entropy")
#: The outputs :func:`top_k` adds when a request asks for the k largest probabilities.
TOP_K_OUTPUTS = ("top_k_indices", "top_k_probabilities")
#: Scores of one ONNX Runtime call, at most (64 Ki: 256 KiB of float32; one row when K
#: is larger). A bigger batch runs in row chunks written into the answer's arrays, so
#: the graph's intermediate tensors cost a chunk, not the batch (at K = 49,152 a
#: 1,000-row batch held about 3 times its input); every graph is row-wise, so the
#: answer is the same. ONNX Runtime's arena keeps the largest chunk's intermediates for
#: the session's life, and small ones stay in the CPU's caches: against 4 Mi a chunk,
#: 4,096 x 1,000 ran in 27-31 instead of 80-142 ms, the arena 22 instead of 295 MiB
#: (bench/README.md, "Serving against peers").
RUN_ELEMENTS = 1 << 16


def version_key(row) -> tuple:
    """The key of a calibrator version's session: its id and creation time. The id alone
    is not enough: SQLite gives a deleted row's id to the next row when it was the
    largest, and a session built for a deleted version must never serve its successor."""
    return (row.id, row.created_at)


class SessionCache:
    """LRU of ``InferenceSession`` keyed by :func:`version_key`."""

    def __init__(self, threads: int, size: int):
        self.size = size
        self.options = ort.SessionOptions()
        self.options.intra_op_num_threads = threads
        self.options.inter_op_num_threads = 1
        self.options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._sessions: OrderedDict[Hashable, ort.InferenceSession] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Hashable, threading.Lock] = {}

    def get(self, version_id: Hashable, load_params: Callable[[], dict]) -> ort.InferenceSession:
        with self._lock:
            session = self._sessions.get(version_id)
            if session is not None:
                self._sessions.move_to_end(version_id)
                return session
            building = self._building.setdefault(version_id, threading.Lock())
        with building:  # one build per version, even under concurrent first requests
            with self._lock:
                session = self._sessions.get(version_id)
            if session is None:
                onnx = onnx_bytes(load_params())
                session = ort.InferenceSession(
                    onnx, self.options, providers=["CPUExecutionProvider"]
                )
                with self._lock:
                    self._sessions[version_id] = session
                    while len(self._sessions) > self.size:
                        self._sessions.popitem(last=False)
        with self._lock:
            self._building.pop(version_id, None)
        return session

    def discard(self, version_ids) -> None:
        """Drop the sessions of the versions with these ids (deleted versions)."""
        ids = set(version_ids)
        with self._lock:
            for key in [k for k in self._sessions if (k[0] if isinstance(k, tuple) else k) in ids]:
                del self._sessions[key]


@dataclass(frozen=True)
class Served:
    """What predict needs about the version it serves; immutable, so cacheable.

    ``namespace`` is the model's (``models.namespace``), carried so the metrics of the
    rows it serves are labelled by tenant as well as by model name.
    """

    namespace: str
    model: str
    num_classes: int
    version: int
    #: :func:`version_key` of its row: what the served counts are kept under.
    version_key: tuple
    session: ort.InferenceSession
    #: The model's class names as an object array (index it with labels), or None.
    class_names: np.ndarray | None = None
    #: The longest of them in UTF-8 bytes (0 without names): what an answer that names
    #: each row's class costs per row at most, to bound its size before computing it.
    #: Stored names written before their limits may be longer than a name may be now.
    max_name_bytes: int = 0
    #: The kinds of scores it serves (:func:`input_kinds` of its session): both, or for
    #: vector and matrix params of format 1 the kind they were fitted on.
    input_kinds: tuple[str, ...] = KINDS
    #: For a version fitted on top-k rows (``calibrators.topk``), the width k of the rows
    #: its graph takes (its metadata's ``k``); None: it serves full (N, K) scores.
    topk_k: int | None = None


class ServingCache:
    """(model, alias | version) -> :class:`Served`, without touching the database when warm.

    Every entry lives ``ttl`` seconds: an alias can move, and a version (immutable
    while it exists) can be deleted, as can its model. A PUT or DELETE in this
    process drops the model's entries at once (:meth:`invalidate`, :meth:`forget`);
    another worker process sees the change within ``ttl``. Renewing an entry is one
    query; the ONNX session is reused (:class:`SessionCache`). Lookups that fail
    (404/409) are not cached.
    """

    def __init__(self, sessions: sessionmaker, onnx: SessionCache, ttl: float, size: int = 4096):
        self.sessions = sessions
        self.onnx = onnx
        self.ttl = ttl
        self.size = size
        self._entries: dict[tuple, tuple[float, Served]] = {}
        #: The lookup in flight for a key: requests that miss it meanwhile wait for it.
        self._pending: dict[tuple, asyncio.Task] = {}
        #: Bumped by :meth:`invalidate`: a lookup that started before is not kept.
        self._generation = 0

    async def get(
        self, model: str, alias: str | None, version: int | None, namespace: str
    ) -> Served:
        key = (model, alias, version, namespace)
        hit = self._entries.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        # One lookup per key at a time. When an entry expires under load, every request
        # that arrives before it is renewed would otherwise query too, each in a thread
        # fighting the event loop for the GIL: with 4 clients on 1 x 1,000 predicts,
        # about a tenth of the server's CPU (bench/README.md, "Serving through
        # http.client"). Shielded: a waiter that is cancelled leaves the lookup to others.
        loop = asyncio.get_running_loop()
        pending = self._pending.get(key)
        if pending is None or pending.get_loop() is not loop:
            pending = self._pending[key] = loop.create_task(self._lookup(key))
            pending.add_done_callback(functools.partial(self._settled, key))
        return await asyncio.shield(pending)

    async def _lookup(self, key: tuple) -> Served:
        generation = self._generation
        served = await anyio.to_thread.run_sync(retry_read, self._resolve, *key)
        if generation == self._generation:  # not invalidated meanwhile: keep it
            if len(self._entries) >= self.size:
                self._entries.clear()
            self._entries[key] = (time.monotonic() + self.ttl, served)
        return served

    def _settled(self, key: tuple, task: asyncio.Task) -> None:
        if self._pending.get(key) is task:
            del self._pending[key]
        if not task.cancelled():
            task.exception()  # its waiters had it (a 404 is not an unhandled error)

    def _resolve(self, name: str, alias: str | None, version: int | None, namespace: str) -> Served:
        with self.sessions() as session:
            model, row = resolve_served(session, name, alias, version, namespace)
            onnx = self.onnx.get(version_key(row), lambda: version_params(row))
            meta = onnx.get_modelmeta().custom_metadata_map
            top = meta.get("format") == "topk"
            return Served(
                namespace=model.namespace,
                model=model.name,
                num_classes=model.num_classes,
                version=row.version,
                version_key=version_key(row),
                session=onnx,
                class_names=(
                    None if model.class_names is None else np.array(model.class_names, object)
                ),
                max_name_bytes=longest_name_bytes(model.class_names),
                input_kinds=() if top else input_kinds(onnx),
                topk_k=int(meta["k"]) if top else None,
            )

    def invalidate(self, model: str, namespace: str) -> None:
        """Forget the model's entries, and lookups in flight (what they find is not kept,
        and a request from now on looks up again)."""
        self._generation += 1
        for key in [k for k in self._entries if k[0] == model and k[3] == namespace]:
            self._entries.pop(key, None)
        for key in [k for k in self._pending if k[0] == model and k[3] == namespace]:
            self._pending.pop(key, None)

    def forget(self, model: str, namespace: str, version_ids=()) -> None:
        """After a delete: drop the model's entries and the deleted versions' sessions."""
        self.invalidate(model, namespace)
        self.onnx.discard(version_ids)


def onnx_bytes(params: dict) -> bytes:
    """The graph of a version's params: a calibrator's, or for top-k params
    (``calibrators.topk``) :meth:`~calibrators.topk.TopKTemperature.to_onnx` at the k
    and V it was fitted on."""
    if params.get("format") == topk.PARAMS_FORMAT:
        return topk.TopKTemperature.from_params(params).to_onnx()
    return calibrators.from_params(params).to_onnx()


def fused_onnx(model: bytes, params: dict, output: str | None, kind: str | None) -> bytes:
    """A classifier's ONNX then a version's calibrator, as one model
    (:func:`calibrators.fuse.fuse`; FuseError, a 422, for a model it cannot take). A
    top-k version's graph takes top-k log-probabilities, no classifier's scores: 422."""
    from calibrators.fuse import fuse

    if params.get("format") == topk.PARAMS_FORMAT:
        raise InvalidInput(
            "A top-k version cannot be fused with a classifier: its graph takes the top-k "
            f"log-probabilities a language model gives ({topk.INPUT_NAME}), not full scores. "
            "Download its graph (GET .../onnx) and feed it those."
        )

    return fuse(model, calibrators.from_params(params), output=output,
                kind=kind).SerializeToString()


def version_params(row) -> dict:
    """A version's stored params, with its ``kind`` column where they do not say (format
    1 did not record it): what the serving rule of format 1 needs."""
    params = row.params
    if params.get("kind") is None:
        params = {**params, "kind": row.kind}
    return params


def input_kinds(session: ort.InferenceSession) -> tuple[str, ...]:
    """The kinds of scores a session's graph gives its one answer for: its metadata's
    ``input_kinds`` (``Calibrator.to_onnx``)."""
    return tuple(session.get_modelmeta().custom_metadata_map["input_kinds"].split(","))


def check_input_kind(served_kinds: tuple[str, ...], kind: str, what: str) -> None:
    """422 (CalibrationInputError) unless ``kind`` is one of ``served_kinds``.

    Only vector and matrix versions of params format 1 take one kind: their map reads the
    raw logits, so its answer moves with their per-row constant, and it is served only
    for the kind they were fitted on."""
    if kind in served_kinds:
        return
    (needed,) = served_kinds
    raise CalibrationInputError(
        f"{what} was fitted on {needed} by a map of params format 1 that reads raw logits, "
        f"so it has one answer for {needed} only: send {needed}, or refit it (a new fit "
        f"serves both kinds with one answer). Got {kind}."
    )


def as_onnx_input(scores: np.ndarray, kind: str, first_row: int = 0) -> np.ndarray:
    """float32 logits for the graph; probabilities go in as their log (zeros floored).
    ``first_row``: the request's row number of ``scores[0]`` (for a chunk's message)."""
    if kind == "probabilities":
        return np.log(np.maximum(scores, PROBABILITY_FLOOR), dtype=np.float32)
    if scores.dtype == np.float32 and scores.flags.c_contiguous:
        return scores  # what the graph takes (JSON logits are read as float32)
    with np.errstate(over="ignore"):  # float64 beyond float32's range: refused just below
        logits = np.ascontiguousarray(scores, dtype=np.float32)
    if scores.dtype != np.float32 and not np.isfinite(logits).all():
        row = int(np.flatnonzero(~np.isfinite(logits).all(axis=1))[0])
        raise CalibrationInputError(
            "logits must fit in float32 (magnitude below 3.4e38), the precision of the "
            f"served graph. Got {scores[row][np.abs(scores[row]).argmax()]!r} at row "
            f"{first_row + row}."
        )
    return logits


def run(session: ort.InferenceSession, logits: np.ndarray) -> dict[str, np.ndarray]:
    n, k = logits.shape
    if n * k <= RUN_ELEMENTS:
        values = session.run(list(OUTPUTS), {"logits": logits})
        return dict(zip(OUTPUTS, values, strict=True))
    out: dict[str, np.ndarray] = {}
    for rows in row_chunks(n, k, RUN_ELEMENTS):
        values = session.run(list(OUTPUTS), {"logits": logits[rows]})
        for name, value in zip(OUTPUTS, values, strict=True):
            if name not in out:
                out[name] = np.empty((n, *value.shape[1:]), dtype=value.dtype)
            out[name][rows] = value
    return out


def run_chunks(
    session: ort.InferenceSession, scores: np.ndarray, kind: str
) -> Iterator[tuple[slice, dict[str, np.ndarray]]]:
    """The graph's outputs for consecutive row chunks of validated ``scores`` (about
    :data:`RUN_ELEMENTS` each, converted by :func:`as_onnx_input` one at a time): for a
    caller that reduces them (feedback), so that neither the graph's input nor its
    (n, K) outputs of the whole batch are ever held."""
    n, k = scores.shape
    for rows in row_chunks(n, k, RUN_ELEMENTS):
        yield rows, run(session, as_onnx_input(scores[rows], kind, rows.start))


def run_topk(session: ort.InferenceSession, logprobs: np.ndarray) -> dict[str, np.ndarray]:
    """A top-k version's graph on validated log-probabilities (N, k): ``probabilities``
    (N, k) and ``tail`` (N,), float32, in row chunks of about :data:`RUN_ELEMENTS`."""
    n, k = logprobs.shape
    names = list(topk.OUTPUT_NAMES)
    out = {"probabilities": np.empty((n, k), np.float32), "tail": np.empty(n, np.float32)}
    for rows in row_chunks(n, k, RUN_ELEMENTS):
        values = session.run(names, {topk.INPUT_NAME: logprobs[rows].astype(np.float32)})
        for name, value in zip(names, values, strict=True):
            out[name][rows] = value
    return out


def check_topk_width(fitted: int, k: int, what: str) -> None:
    """422 unless top-k rows of width ``k`` are what a version fitted on rows of width
    ``fitted`` takes (``what`` names it): its tail model depends on k."""
    if k != fitted:
        raise CalibrationInputError(
            f"{what} was fitted on top-{fitted} rows; its tail model depends on k, so it "
            f"serves rows of {fitted} log-probabilities. Got rows of {k}."
        )


def check_top_k(k: int, num_classes: int) -> None:
    """422 unless ``1 <= k <= num_classes``."""
    if not 1 <= k <= num_classes:
        raise InvalidInput(
            f"top_k must be an integer from 1 to the number of classes, {num_classes}. Got {k}."
        )


def top_k(probabilities: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The ``k`` largest probabilities of each row and their class indices.

    Parameters
    ----------
    probabilities : ndarray of shape (n_samples, n_classes)
    k : int
        In ``[1, n_classes]``; a larger ``k`` raises :class:`service.errors.InvalidInput`.

    Returns
    -------
    dict
        ``top_k_indices`` int64 and ``top_k_probabilities`` (the input's dtype), each of
        shape (n_samples, k), largest first; equal probabilities in class order (the
        order of a stable sort, also at the k-th place). One ``argpartition`` pass,
        O(n_classes) per row, so a 262,144-class vocabulary is never sorted.

    >>> out = top_k(np.array([[0.1, 0.4, 0.1, 0.4]]), 3)
    >>> out["top_k_indices"].tolist(), out["top_k_probabilities"].tolist()
    ([[1, 3, 0]], [[0.4, 0.4, 0.1]])
    """
    n, num_classes = probabilities.shape
    check_top_k(k, num_classes)
    if n * num_classes > RUN_ELEMENTS:  # argpartition's copy and indices: a chunk's
        parts = [_top_k(probabilities[rows], k) for rows in row_chunks(n, num_classes)]
        return {name: np.concatenate([p[name] for p in parts]) for name in TOP_K_OUTPUTS}
    return _top_k(probabilities, k)


def _top_k(probabilities: np.ndarray, k: int) -> dict[str, np.ndarray]:
    num_classes = probabilities.shape[1]
    index = np.argpartition(probabilities, num_classes - k, axis=1)[:, num_classes - k :]
    value = np.take_along_axis(probabilities, index, axis=1)
    # Which of several probabilities equal to the k-th largest argpartition keeps is
    # arbitrary: rows with such a tie take the lowest indices (rare; one row at a time).
    kth = value.min(axis=1)
    kept = (value == kth[:, None]).sum(axis=1)
    tied = (probabilities == kth[:, None]).sum(axis=1)
    for row in np.flatnonzero(tied > kept):
        p = probabilities[row]
        above = np.flatnonzero(p > kth[row])
        index[row] = np.concatenate([above, np.flatnonzero(p == kth[row])[: k - above.size]])
        value[row] = p[index[row]]
    order = np.lexsort((index, -value), axis=1)
    return {
        "top_k_indices": np.take_along_axis(index, order, axis=1).astype(np.int64, copy=False),
        "top_k_probabilities": np.take_along_axis(value, order, axis=1),
    }
