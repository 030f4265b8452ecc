"""Database faults: which errors are the connection's, reads retried once, and whether
a request's writes were applied when its connection failed.

A pooled connection can die at any moment: the server restarts, a proxy or an
operator (``pg_terminate_backend``) cuts it. The engine checks a connection when it
leaves the pool (``pool_pre_ping``, :func:`service.storage.db.make_engine`), which
catches connections that died while idle, but not one that dies while a request uses
it. What then:

- :func:`is_transient` tells such failures (a dropped or refused connection, the
  server shutting down, a deadlock, a full pool) from bugs: they are worth one more
  try, or a 503, never a 500.
- :func:`end_session` ends a request's session without raising: a rollback on a
  connection that died must not break an answer already decided.
- :func:`retry_read` runs a read that opens its own session again, once, on a fresh
  connection. The API replays a whole ``GET`` the same way
  (:mod:`service.server.faults`).
- :func:`until_reachable` runs a process's start-up steps again after a transient
  failure, for a bounded time: under uvicorn's supervisor a worker whose start-up
  fails stops the whole server (its other workers too), so a connection cut while a
  worker starts must not end it.
- A write cannot simply be repeated: if the connection died during ``COMMIT``
  without an answer, the change may or may not be in the database (an error the
  server sends in reply to ``COMMIT`` means it did not commit). :func:`recording` and the listeners
  :func:`track_writes` puts on the engine keep a :class:`WriteLog` of the
  transactions of the current request (a context variable, so the threads a request
  runs in report into it), and :meth:`WriteLog.applied` says ``"no"``, ``"yes"`` or
  ``"unknown"``: what the 503 tells the caller.

The SQLAlchemy documentation's "Dealing with Disconnects" describes the pessimistic
check (pre-ping) and why an error in the middle of a transaction cannot be retried
transparently: only the caller knows the unit of work to repeat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy import Engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session

log = logging.getLogger("welltempered.database")

T = TypeVar("T")

#: Seconds a caller is asked to wait before retrying after a database fault.
RETRY_AFTER_SECONDS = 1


def is_transient(exc: BaseException) -> bool:
    """A failure of the connection or the server, not of the request: worth a retry.

    SQLAlchemy marks an error it recognises as a disconnect
    (``connection_invalidated``, the connection is then discarded); the driver's
    ``OperationalError`` covers the rest of what is not the statement's fault (refused
    connections, admin shutdown, deadlocks, serialization failures); a pool that
    gives no connection within its timeout is one too.
    """
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, OperationalError | PoolTimeoutError)


def end_session(session: Session) -> None:
    """Close ``session`` and never raise: the end of a request's session.

    Closing rolls back a transaction still open, on the connection it holds. If that
    connection died meanwhile (the server restarted, ``pg_terminate_backend``), the
    rollback raises; but nothing of an uncommitted transaction survives a dead
    connection anyway, and the request's answer is decided, perhaps already sent
    (FastAPI ends a ``yield`` dependency after the response has started). So the
    failure is logged and the connection discarded, not raised into the answer.
    """
    try:
        session.close()
    except Exception as exc:
        log.warning(
            "a session's rollback at its end failed (%s): its connection is discarded",
            type(exc).__name__,
        )
        try:
            session.invalidate()
        except Exception:  # pragma: no cover - the connection is gone either way
            log.debug("discarding a failed session's connection failed too", exc_info=True)


def retry_read(fn: Callable[..., T], *args, attempts: int = 2, **kwargs) -> T:
    """``fn(*args, **kwargs)``, called again (up to ``attempts`` calls in all) after a
    transient failure. ``fn`` must only read, and open its own session or connection,
    so the next call gets a fresh one."""
    for attempt in range(1, attempts + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if attempt >= attempts or not is_transient(exc):
                raise
            log.info("a read lost its database connection (%s): retrying", type(exc).__name__)
    raise AssertionError("unreachable")  # pragma: no cover


def until_reachable(
    fn: Callable[..., T],
    *args,
    wait_seconds: float,
    what: str,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``fn(*args)``, called again after each transient failure (:func:`is_transient`)
    until ``wait_seconds`` have passed since the first call; then the failure is raised.
    The waits between calls grow from 0.1 s to 2 s. Other errors are raised at once.

    For steps that can be repeated: reads, and writes in a transaction of their own
    (a failed one is rolled back). ``what`` names the step in the log.

    >>> calls = []
    >>> def flaky():
    ...     calls.append(1)
    ...     if len(calls) < 3:
    ...         raise OperationalError("SELECT 1", {}, Exception("connection cut"))
    ...     return "up"
    >>> until_reachable(flaky, wait_seconds=10, what="a check", sleep=lambda s: None)
    'up'
    >>> len(calls)
    3
    """
    deadline = clock() + wait_seconds
    pause = 0.1
    attempt = 1
    while True:
        try:
            return fn(*args)
        except Exception as exc:
            if not is_transient(exc) or clock() + pause > deadline:
                raise
            log.warning(
                "%s failed (%s, attempt %d): the database is unreachable; trying again in "
                "%.1f s (for up to %g s in all)", what, type(exc).__name__, attempt, pause,
                wait_seconds,
            )
        sleep(pause)
        pause = min(2.0, pause * 2)
        attempt += 1


@dataclass
class WriteLog:
    """The writing transactions of one request: committed, or with a commit whose
    outcome is unknown (its connection failed during ``COMMIT``). A transaction that
    ran only ``SELECT`` statements changes nothing, so its commit is not counted."""

    committed: int = 0
    #: The connection a COMMIT of a writing transaction was sent on, while it has not
    #: failed (confirmed by the next transaction's start, or by the request's end).
    committing: object | None = None
    unconfirmed: bool = False
    #: Connections whose current transaction ran a statement other than a SELECT.
    writing: set = field(default_factory=set)

    def applied(self) -> str:
        """``"unknown"``, ``"yes"`` (something was committed) or ``"no"``.

        >>> WriteLog().applied(), WriteLog(committed=1).applied()
        ('no', 'yes')
        >>> WriteLog(committed=1, unconfirmed=True).applied()
        'unknown'
        """
        if self.unconfirmed:
            return "unknown"
        return "yes" if self.committed or self.committing is not None else "no"


_current: ContextVar[WriteLog | None] = ContextVar("welltempered_write_log", default=None)


class recording:
    """A fresh :class:`WriteLog` for the transactions run in this context (and the
    threads started from it) until the block ends.

    A class, not a ``@contextmanager`` generator: it wraps every request. With the
    replay closure a POST never uses, the generator's machinery was two thirds of the
    fault middleware's 43,000 instructions per 1 x 1,000 prediction (bench/README.md,
    "The JSON gap, third round").

    >>> with recording() as writes:
    ...     _current.get() is writes
    True
    >>> _current.get() is None
    True
    """

    __slots__ = ("_token", "writes")

    def __enter__(self) -> WriteLog:
        self.writes = WriteLog()
        self._token = _current.set(self.writes)
        return self.writes

    def __exit__(self, *exc_info) -> None:
        _current.reset(self._token)


class unrecorded:
    """Transactions in this block are not the request's change, and stay out of its
    :class:`WriteLog`: the bookkeeping of an ``Idempotency-Key`` (its in-flight row,
    committed before the write, deleted after a failure) must not turn the ``applied``
    of a failed write into ``"yes"``.

    >>> with recording() as writes, unrecorded():
    ...     _current.get() is None
    True
    """

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _current.set(None)

    def __exit__(self, *exc_info) -> None:
        _current.reset(self._token)


def _on_begin(conn) -> None:
    writes = _current.get()
    if writes is None:
        return
    if writes.committing is conn:  # its previous COMMIT returned
        writes.committing = None
        writes.committed += 1
    writes.writing.discard(conn)


def _on_execute(conn, cursor, statement, parameters, context, executemany) -> None:
    writes = _current.get()
    if writes is not None and not statement.lstrip()[:6].upper().startswith("SELECT"):
        writes.writing.add(conn)  # conservative: anything but a SELECT may write


def _on_commit(conn) -> None:
    writes = _current.get()
    if writes is None or conn not in writes.writing:
        return  # a read-only transaction: its commit applies nothing
    writes.writing.discard(conn)
    if writes.committing is not None:  # another connection's COMMIT returned
        writes.committed += 1
    writes.committing = conn


def _on_error(context) -> None:
    if context.is_pre_ping:
        # A connection whose ping fails for any reason is not handed out: it is
        # discarded and the pool opens a new one (whose failure to connect is then the
        # error). psycopg's ping first switches autocommit on, and on a connection the
        # server cut while it sat in the pool that raises "can't change 'autocommit'
        # now", a ProgrammingError that SQLAlchemy does not see as a disconnect: it
        # escaped as a 500 (test_db_faults, every 50 ms, POST feedback).
        context.is_disconnect = True
        return
    writes = _current.get()
    if writes is None:
        return
    if writes.committing is not None and writes.committing is context.connection:
        # The COMMIT itself failed. If the server answered it with an error (a SQLSTATE:
        # admin shutdown of an idle backend, a serialization failure), the transaction
        # did not commit; if the connection broke without an answer, nobody knows.
        writes.committing = None
        answered = getattr(context.original_exception, "sqlstate", None) is not None
        writes.unconfirmed = writes.unconfirmed or not answered


def track_writes(engine: Engine) -> None:
    """Report the engine's transactions to the :class:`WriteLog` of the current context
    (nothing happens outside :func:`recording`)."""
    event.listen(engine, "begin", _on_begin)
    event.listen(engine, "before_cursor_execute", _on_execute)
    event.listen(engine, "commit", _on_commit)
    event.listen(engine, "handle_error", _on_error)
