"""``welltempered``: serve, worker, migrate, fit (offline), keys, gc, fuse, triton. One function
per subcommand.

A new subcommand is one entry in :data:`COMMANDS`: a name, a help line, a
function that adds its arguments, and one that runs it and returns the exit code.
Each of those functions imports what its subcommand needs when it runs, for
start-up speed only, never to hide a cycle: this module is the top layer, and no
module of the service imports it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

#: The flag that lets a command other than serve and migrate create a SQLite file.
CREATE_FLAG = "--create-database"

#: What ``--log-level`` accepts: the standard library's level names, as uvicorn takes them.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where there is none to show (None, an
    off switch) or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a usage error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1. Got {text!r}.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1. Got {value}.")
    return value


def database_label(url: str) -> str:
    """The database a URL names, for a person: a SQLite file's absolute path, or the URL
    without its password."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        name = parsed.database or ":memory:"
        return f"SQLite {name if name == ':memory:' else os.path.abspath(name)}"
    return parsed.render_as_string(hide_password=True)


def missing_sqlite_file(url: str) -> str | None:
    """The absolute path of the SQLite file ``url`` names when it does not exist (a
    connection would create it), else None (it exists, is in memory, or not SQLite)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    name = parsed.database
    if parsed.get_backend_name() != "sqlite" or not name or name == ":memory:":
        return None
    return None if os.path.exists(name) else os.path.abspath(name)


def use_database(command: str, url: str, *, create: bool) -> bool:
    """Say on stderr which database ``command`` uses; False (and why, on stderr) when it
    is a SQLite file that does not exist and ``create`` is off: a command run from
    another directory must not silently start a new, empty database there."""
    missing = missing_sqlite_file(url)
    if missing is not None and not create:
        print(
            f"welltempered {command}: no SQLite database at {missing} "
            "(WELLTEMPERED_DATABASE_URL, relative to the current directory). Run it where "
            "the database is, set WELLTEMPERED_DATABASE_URL, or create one with "
            f"`welltempered migrate` (or add {CREATE_FLAG}).",
            file=sys.stderr,
        )
        return False
    created = " (new)" if missing is not None else ""
    print(f"welltempered {command}: database {database_label(url)}{created}", file=sys.stderr)
    return True


def start_metrics_listener(listener, command: str, setting: str, text: str) -> bool:
    """Start ``listener`` (a :class:`service.server.exporter.MetricsListener`) on the first
    free port of ``text``, the value of ``setting``, and log which; False, after saying
    why on stderr, when none is free (the command then exits 2). Serve and worker alike."""
    try:
        listener.start()
    except OSError as exc:
        print(
            f"welltempered {command}: cannot listen for metrics on {text.strip()} ({setting}: "
            "a port, or ports whose first free one each process of a host takes; empty for "
            f"no listener): {exc}",
            file=sys.stderr,
        )
        return False
    logging.info("%s: metrics listener on %s:%d (%s)", command, *listener.address, setting)
    return True


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--workers", type=positive_int, default=1, metavar="N", help="uvicorn worker processes"
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="start with model 'digits-mlp' calibrated and given the default alias "
        "(own SQLite file and data folder under ./welltempered-data/demo)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log threshold")
    p.add_argument(
        "--no-access-log",
        action="store_true",
        help="write no line per request (the access log; WELLTEMPERED_ACCESS_LOG=false)",
    )


def serve(args: argparse.Namespace) -> int:
    # Imported here for start-up speed, as in every function below (module docstring).
    import uvicorn
    from sqlalchemy.orm import sessionmaker

    from service import demo
    from service.api.app import create_app
    from service.observe import metrics
    from service.server import exporter, timeouts
    from service.settings import Settings
    from service.storage import array_refs, fits, migrate
    from service.storage.arrays import ArrayStore
    from service.storage.db import make_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    settings = Settings()
    if args.no_access_log:
        settings = settings.model_copy(update={"access_log": False})
    if args.demo:
        settings = demo.demo_settings(settings)
        if is_loopback(args.host):  # the demo on this machine only: no key needed
            settings = settings.model_copy(update={"auth": "off"})
    if settings.auth == "off" and not is_loopback(args.host):
        print(
            "welltempered serve: with WELLTEMPERED_AUTH=off anyone who can connect has admin "
            "rights, so serve binds only to a loopback address (127.0.0.1, ::1, localhost). "
            f"Got --host {args.host}.",
            file=sys.stderr,
        )
        return 2
    use_database("serve", settings.database_url, create=True)
    try:
        metrics_address = exporter.parse_ports(
            settings.metrics_address, "WELLTEMPERED_METRICS_ADDRESS"
        )
    except ValueError as exc:
        print(f"welltempered serve: {exc}", file=sys.stderr)
        return 2
    engine = make_engine(settings.database_url)
    try:
        migrate.ensure_schema(
            engine, settings.database_url, settings.startup_database_wait_seconds
        )
        if settings.is_sqlite:
            # The only process of this database file. Once, before any uvicorn worker
            # exists (several must not each do it): fits left running by a stopped
            # server are queued again, and every orphan file goes, however young.
            # PostgreSQL: other replicas and workers may be busy; nothing is touched.
            requeued = fits.requeue_running(sessionmaker(engine))
            if requeued:
                logging.warning("queued again %d fit(s) left running by a stopped server", requeued)
            array_refs.sweep(
                sessionmaker(engine),
                ArrayStore(settings.data_dir, settings.array_store),
                grace_seconds=0,
            )
        if args.demo:
            demo.install(settings, engine)
    except migrate.NotMigrated as exc:
        print(f"welltempered serve: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    settings = settings.model_copy(update={"recover_jobs": False})
    # uvicorn finishes in-flight requests on SIGTERM (at most shutdown_grace_seconds),
    # then re-raises the signal: this handler turns that into exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Every connection gets a deadline for its headers (service/api/timeouts.py).
    options: dict = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": False,  # the app writes its own (service/observe/access.py)
        "timeout_graceful_shutdown": settings.shutdown_grace_seconds,
        "http": timeouts.guarded_protocol(settings.header_timeout_seconds, settings.http_parser),
        "loop": settings.event_loop,
    }
    listener = None
    if args.workers > 1:
        # Workers are new processes: hand them the settings through the environment.
        for name, value in settings.model_dump(exclude_none=True).items():
            os.environ[f"WELLTEMPERED_{name.upper()}"] = str(value)
        # prometheus_client's multiprocess mode: the directory wiped once and in the
        # environment the workers start with (service/observe/metrics.py). A fixed
        # default place, so a server killed with SIGKILL leaves no stray directory.
        multiprocess_dir = metrics.export_multiprocess_dir(
            settings.data_dir / "prometheus-multiproc"
        )
        # The metrics listener lives here, in the parent: one for all workers, adding
        # up their files (service/server/exporter.py).
        if metrics_address is not None:
            listener = exporter.MetricsListener(
                metrics_address, settings, multiprocess_dir=multiprocess_dir
            )
        app = "service.api.app:app_from_env"
        options.update(factory=True, workers=args.workers)
    else:
        process_metrics = metrics.ServiceMetrics()
        if metrics_address is not None:
            listener = exporter.MetricsListener(metrics_address, settings, metrics=process_metrics)
        app = create_app(settings, process_metrics)
    if listener is not None:
        if not start_metrics_listener(
            listener, "serve", "WELLTEMPERED_METRICS_ADDRESS", settings.metrics_address
        ):
            return 2
        host, port = listener.address
        if not is_loopback(host):
            logging.warning(
                "the metrics listener on %s:%d answers anyone who can reach it with every "
                "namespace's series: keep that port on an internal network",
                host,
                port,
            )
    try:
        uvicorn.run(app, **options)
    finally:
        if listener is not None:
            listener.stop()
    return 0


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        metavar="N",
        help="fits run at once by this worker (default: WELLTEMPERED_FIT_WORKERS)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log threshold")


def worker(args: argparse.Namespace) -> int:
    """Run fits from the queue until SIGTERM/SIGINT (PostgreSQL only); serve their
    metrics on WELLTEMPERED_WORKER_METRICS_ADDRESS."""
    import asyncio
    import functools

    from sqlalchemy.orm import sessionmaker

    from service.jobs.queue import job_engine
    from service.observe import metrics, monitoring
    from service.server import exporter
    from service.settings import Settings
    from service.storage import migrate
    from service.storage.db import make_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    settings = Settings()
    if settings.is_sqlite:
        print(
            "welltempered worker: fit workers share a PostgreSQL database with the API "
            "(WELLTEMPERED_DATABASE_URL=postgresql+psycopg://...); with SQLite, `serve` runs "
            "the fits itself.",
            file=sys.stderr,
        )
        return 2
    concurrency = settings.fit_workers if args.concurrency is None else args.concurrency
    try:
        metrics_address = exporter.parse_ports(
            settings.worker_metrics_address, "WELLTEMPERED_WORKER_METRICS_ADDRESS"
        )
    except ValueError as exc:
        print(f"welltempered worker: {exc}", file=sys.stderr)
        return 2
    use_database("worker", settings.database_url, create=False)  # PostgreSQL: says which
    engine = make_engine(settings.database_url, application_name="welltempered-worker")
    listener = process_metrics = None
    try:
        migrate.ensure_schema(
            engine, settings.database_url, settings.startup_database_wait_seconds
        )
        # This process's metrics, as a one-worker serve has them (PROMETHEUS_MULTIPROC_DIR
        # set, as in the image: its files, service/observe/metrics.py): the fits this
        # worker ran, observed here when each ends, and what their reads did in the
        # array read cache, sent here by each fit's process.
        process_metrics = metrics.ServiceMetrics()
        process_metrics.mark_dead_workers()
        sessions = sessionmaker(engine, expire_on_commit=False)
        jobs = job_engine(
            settings,
            sessions,
            on_finished=functools.partial(
                monitoring.observe_finished_fit, process_metrics, sessions
            ),
            on_cache=functools.partial(monitoring.observe_array_cache, process_metrics),
        )
        listening = "no listener"
        if metrics_address is not None:
            listener = exporter.MetricsListener(
                metrics_address, settings, metrics=process_metrics, database_gauges=False
            )
            if not start_metrics_listener(
                listener,
                "worker",
                "WELLTEMPERED_WORKER_METRICS_ADDRESS",
                settings.worker_metrics_address,
            ):
                return 2
            listening = "{}:{}".format(*listener.address)
        logging.info(
            "worker %s: %d fit(s) at once, heartbeat every %g s, metrics on %s",
            jobs.name,
            concurrency,
            settings.worker_heartbeat_seconds,
            listening,
        )
        # SIGTERM/SIGINT: the job engine stops taking jobs, gives the running ones
        # WELLTEMPERED_FIT_GRACE_SECONDS, then hands them back; exit status 0.
        asyncio.run(jobs.run_worker(concurrency, install_signal_handlers=True))
    except migrate.NotMigrated as exc:
        print(f"welltempered worker: {exc}", file=sys.stderr)
        return 2
    finally:
        if listener is not None:
            listener.stop()
        if process_metrics is not None:
            process_metrics.mark_process_dead()
        engine.dispose()
    return 0


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


def migrate_command(args: argparse.Namespace) -> int:
    from service.settings import Settings
    from service.storage import migrate

    # Alembic's progress ("Running upgrade a -> b") on stderr; SQLAlchemy stays quiet.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s [%(name)s] %(message)s")
    logging.getLogger("alembic").setLevel(logging.INFO)
    settings = Settings()
    use_database("migrate", settings.database_url, create=True)
    migrate.upgrade(settings.database_url)
    print(f"database at revision {migrate.head_revision(settings.database_url)} (head)")
    return 0


def _fit_arguments(p: argparse.ArgumentParser) -> None:
    from service import offline

    offline.add_arguments(p)


def fit(args: argparse.Namespace) -> int:
    from service import offline

    return offline.run(args)


_CREATE_HELP = (
    "create (and migrate) the SQLite file of WELLTEMPERED_DATABASE_URL if it does not exist "
    "(otherwise that is an error)"
)


def _keys_arguments(p: argparse.ArgumentParser) -> None:
    from service.security import keys

    p.add_argument(CREATE_FLAG, action="store_true", help=_CREATE_HELP)
    # The same flag after the action (`keys create --create-database ...`). Its default is
    # SUPPRESS: a subcommand's default would overwrite the value given before the action.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument(
        CREATE_FLAG, action="store_true", default=argparse.SUPPRESS, help=_CREATE_HELP
    )
    keys.add_arguments(p, parents=[after], formatter_class=p.formatter_class)


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    from service import pair

    pair.add_arguments(p)


def compare(args: argparse.Namespace) -> int:
    from service import pair

    return pair.run(args)


def keys_command(args: argparse.Namespace) -> int:
    from service.security import keys
    from service.settings import Settings

    if not use_database("keys", Settings().database_url, create=args.create_database):
        return 2
    return keys.run(args)


def _gc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="leave orphan files younger than this (default: WELLTEMPERED_ORPHAN_GRACE_SECONDS; "
        "0 only when no server is running)",
    )


def gc_command(args: argparse.Namespace) -> int:
    from sqlalchemy.orm import sessionmaker

    from service.settings import Settings
    from service.storage import array_refs, loops, migrate
    from service.storage.arrays import ArrayStore
    from service.storage.db import make_engine

    settings = Settings()
    grace = settings.orphan_grace_seconds if args.grace is None else args.grace
    if grace < 0:
        print(f"welltempered gc: --grace must be >= 0. Got {grace}.", file=sys.stderr)
        return 2
    # Never a new database: a new one has no datasets to sweep against.
    if not use_database("gc", settings.database_url, create=False):
        return 2
    engine = make_engine(settings.database_url)
    try:
        migrate.ensure_schema(engine, settings.database_url)
        done = array_refs.sweep(
            sessionmaker(engine), ArrayStore(settings.data_dir, settings.array_store), grace
        )
        expired = loops.expire(sessionmaker(engine))
    except migrate.NotMigrated as exc:
        print(f"welltempered gc: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    print(
        f"removed {done.files_removed} orphan array file(s) ({done.bytes_removed} bytes), "
        f"{done.tmp_removed} temp file(s) and {done.rows_removed} stale row(s); kept "
        f"{done.young_kept} orphan(s) younger than {grace:g} s; dropped {expired} kept "
        "feedback post(s) past their model's retention "
        f"(database {settings.database_url.split('://', 1)[0]}, data in {settings.data_dir})"
    )
    return 0


def _fuse_arguments(p: argparse.ArgumentParser) -> None:
    from service import exports

    exports.add_fuse_arguments(p)


def fuse_command(args: argparse.Namespace) -> int:
    from service import exports

    return exports.fuse(args)


def _triton_arguments(p: argparse.ArgumentParser) -> None:
    from service import exports

    exports.add_triton_arguments(p)


def triton_command(args: argparse.Namespace) -> int:
    from service import exports

    return exports.triton(args)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost (what ``serve`` accepts with auth off)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = [
    Command("serve", "run the HTTP service (uvicorn)", _serve_arguments, serve),
    Command("worker", "run fits from the queue (PostgreSQL)", _worker_arguments, worker),
    Command("migrate", "upgrade the database to the latest schema", _no_arguments, migrate_command),
    Command("fit", "fit a calibrator offline from a .npz file", _fit_arguments, fit),
    Command(
        "compare",
        "is model B model A at another temperature? (two .npz files of scores)",
        _compare_arguments,
        compare,
    ),
    Command("keys", "create, list or revoke API keys", _keys_arguments, keys_command),
    Command(
        "gc",
        "remove orphan array files (no dataset names them) older than the grace period",
        _gc_arguments,
        gc_command,
    ),
    Command(
        "fuse",
        "write one ONNX model: a classifier's ONNX, then a calibrator",
        _fuse_arguments,
        fuse_command,
    ),
    Command(
        "triton",
        "write a calibrator (and an ensemble with a model) into a Triton model repository",
        _triton_arguments,
        triton_command,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="welltempered", description="Post-hoc calibration: library CLI and service."
    )
    version = importlib.metadata.version("welltempered")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(
            command.name, help=command.help, description=command.help, formatter_class=HelpFormatter
        )
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
