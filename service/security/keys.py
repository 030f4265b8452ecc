"""API key management: create (the key is shown once), list (never the key), revoke.

Used by ``welltempered keys ...`` (same settings, hence same database, as
``serve``) and by the admin routes in :mod:`service.api.routers.keys`. The rows
are read and written by :mod:`service.storage.keys`.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from service.errors import NotFound
from service.security.auth import SHOWN_CHARS, key_digest, new_key
from service.settings import Settings
from service.storage import keys as key_rows
from service.storage import migrate
from service.storage.db import ApiKey, as_utc, make_engine, utcnow
from service.vocabulary import (
    MAX_KEY_DESCRIPTION_CHARS,
    METRICS_NAMESPACE,
    METRICS_SCOPE,
    NAMESPACE_PATTERN,
    SCOPES,
    check_text,
    parse_duration,
)

_NAMESPACE = re.compile(NAMESPACE_PATTERN)


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE.match(namespace):
        raise ValueError(
            "a namespace is 1-64 characters A-Z a-z 0-9 . _ -, starting with a letter or "
            f"digit. Got {namespace!r}."
        )
    return namespace


def key_namespace(scope: str, namespace: str | None) -> str:
    """The namespace a new key of ``scope`` is stored under: the tenant's, checked, or
    :data:`~service.vocabulary.METRICS_NAMESPACE` for a metrics key (which has none)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}. Got {scope!r}.")
    if scope == METRICS_SCOPE:
        if namespace not in (None, METRICS_NAMESPACE):
            raise ValueError(
                "a metrics key reads the series of every namespace and belongs to none: "
                f"leave out the namespace. Got {namespace!r}."
            )
        return METRICS_NAMESPACE
    if namespace is None:
        raise ValueError(f"a {scope!r} key belongs to a namespace: give one. Got none.")
    return check_namespace(namespace)


def create_key(
    session: Session,
    namespace: str | None,
    scope: str,
    expires_in: timedelta | None = None,
    description: str | None = None,
) -> tuple[ApiKey, str]:
    """A new key row (committed) and the key itself: the only time it exists in clear.

    ``namespace`` is None for a metrics key (:func:`key_namespace`)."""
    namespace = key_namespace(scope, namespace)
    key = new_key()
    row = key_rows.add_key(
        session,
        prefix=key[:SHOWN_CHARS],
        digest=key_digest(key),
        namespace=namespace,
        scope=scope,
        description=description,
        expires_at=(utcnow() + expires_in) if expires_in is not None else None,
    )
    return row, key


def key_state(row: ApiKey, now: datetime | None = None) -> str:
    """One of :data:`service.vocabulary.KEY_STATES`."""
    now = now or datetime.now(UTC)
    expires = as_utc(row.expires_at)
    if row.revoked_at is not None:
        return "revoked"
    if expires is not None and expires <= now:
        return "expired"
    return "active"


# -- the CLI: welltempered keys create | list | revoke ----------------------------


def add_arguments(p: argparse.ArgumentParser, **common) -> None:
    """The actions of ``keys``; ``common`` goes to each action's parser (``parents``,
    ``formatter_class``)."""
    sub = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = sub.add_parser(
        "create", help="create a key; prints it once, on the last line", **common
    )
    create.add_argument(
        "--namespace", help="the tenant's namespace (every scope but metrics, which has none)"
    )
    create.add_argument(
        "--scope",
        required=True,
        choices=SCOPES,
        help=f"{METRICS_SCOPE!r}: GET /metrics only, every namespace's series (the scraper's)",
    )
    create.add_argument("--expires", help="lifetime, e.g. 30d, 12h (default: never)")
    create.add_argument("--description")
    ls = sub.add_parser("list", help="list keys (id, prefix, namespace, scope, state)", **common)
    ls.add_argument("--namespace")
    revoke = sub.add_parser("revoke", help="revoke a key by id", **common)
    revoke.add_argument("id", type=int)


def run(args: argparse.Namespace) -> int:
    settings = Settings()
    engine = make_engine(settings.database_url)
    try:
        try:
            migrate.ensure_schema(engine, settings.database_url)
        except migrate.NotMigrated as exc:
            print(f"welltempered keys: {exc}", file=sys.stderr)
            return 2
        with sessionmaker(engine, expire_on_commit=False)() as session:
            return _ACTIONS[args.keys_command](session, args)
    finally:
        engine.dispose()


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "never"
    return as_utc(moment).isoformat(timespec="seconds")


def _create(session: Session, args: argparse.Namespace) -> int:
    try:
        expires = timedelta(seconds=parse_duration(args.expires)) if args.expires else None
        description = args.description
        if description is not None:  # the rule of the API's KeyCreate
            check_text(description, "--description", MAX_KEY_DESCRIPTION_CHARS)
        row, key = create_key(session, args.namespace, args.scope, expires, description)
    except ValueError as exc:
        print(f"welltempered keys create: {exc}", file=sys.stderr)
        return 2
    until = _when(row.expires_at)
    print(
        f"created key id {row.id} ({row.prefix}...): namespace {row.namespace!r}, "
        f"scope {row.scope!r}, expires {until}"
    )
    print("the key is shown once, now (only its sha256 is stored):")
    print(key)
    return 0


def _list(session: Session, args: argparse.Namespace) -> int:
    print(f"{'id':>5}  {'prefix':<14} {'namespace':<20} {'scope':<8} {'state':<8} expires")
    for row in key_rows.list_keys(session, args.namespace):
        until = _when(row.expires_at)
        print(
            f"{row.id:>5}  {row.prefix + '...':<14} {row.namespace:<20} {row.scope:<8} "
            f"{key_state(row):<8} {until}"
        )
    return 0


def _revoke(session: Session, args: argparse.Namespace) -> int:
    try:
        key_rows.revoke_key(session, args.id)
    except NotFound as exc:
        print(f"welltempered keys revoke: {exc.detail}", file=sys.stderr)
        return 2
    print(f"key {args.id} revoked (servers stop accepting it within KEY_CACHE_SECONDS)")
    return 0


_ACTIONS = {"create": _create, "list": _list, "revoke": _revoke}
