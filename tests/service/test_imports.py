"""Importing a module does nothing but define names.

Every module of ``calibrators`` and ``service`` is imported in one fresh Python
process, whose working directory, ``HOME`` and ``TMPDIR`` are new empty directories,
and the process's state is compared before and after: no file or directory
created, no collector added to prometheus_client's global ``REGISTRY``, no thread
started, the environment, the logging handlers, the signal handlers, the warning
filters and prometheus_client's ``_created`` switch unchanged. Engines, sessions,
ONNX Runtime sessions, metrics, settings and threads are built by the factories
(``create_app(settings)``, the lifespan, the CLI's subcommands), never by an import.

The modules are found on disk (:func:`pkgutil.iter_modules`), not by importing the
packages, so the state before is taken with none of them imported. The baseline
imports the third-party libraries first: what *they* do when imported (OpenBLAS
starting its threads, prometheus_client registering its process collectors) is
not ours to test; neither are the files they write (ONNX Runtime writes a device
id under ``~/.cache`` when imported and a file in ``TMPDIR`` at exit), so what is
left once the process has exited is compared with a control process that imports
the libraries only. ``service.migrations`` (Alembic's scripts, installed under
that name, run by Alembic) lives outside ``service/`` and is not walked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("calibrators", "service")

PROBE = """
    import importlib
    import importlib.util
    import json
    import logging
    import os
    import pkgutil
    import signal
    import sys
    import threading
    import warnings

    PACKAGES = {packages!r}


    def modules(name, path):
        yield name
        for info in pkgutil.iter_modules(path):
            child = f"{{name}}.{{info.name}}"
            if info.ispkg:
                yield from modules(child, [os.path.join(path[0], info.name)])
            else:
                yield child


    names = [
        module
        for package in PACKAGES
        for module in modules(package, importlib.util.find_spec(package).submodule_search_locations)
    ]

    # What the modules import from outside the project, imported first (see the docstring).
    import alembic.command, anyio, fastapi, numpy, onnx, onnxruntime, orjson  # noqa
    import prometheus_client  # noqa
    import pydantic, pydantic_settings, scipy.optimize, scipy.special, sklearn  # noqa
    import sqlalchemy, sqlalchemy.orm, starlette, threadpoolctl, uvicorn  # noqa
    import torch  # noqa (calibrators.torch_export: the torch extra)
    from prometheus_client import REGISTRY
    from prometheus_client import metrics as prometheus_metrics


    def files():
        out = []
        for top in (os.getcwd(), os.environ["HOME"], os.environ["TMPDIR"]):
            for parent, dirs, found in os.walk(top):
                out += [os.path.join(parent, n) for n in dirs + found]
        return sorted(out)


    def handlers():
        loggers = [logging.getLogger()] + [
            logger
            for logger in logging.Logger.manager.loggerDict.values()
            if isinstance(logger, logging.Logger)
        ]
        return sorted(f"{{lg.name}}: {{h!r}}" for lg in loggers for h in lg.handlers)


    def state():
        return {{
            "files": files(),
            "REGISTRY collectors": sorted(m.name for m in REGISTRY.collect()),
            "threads": sorted(t.name for t in threading.enumerate()),
            "native threads": len(os.listdir("/proc/self/task")),
            "environment": sorted(f"{{k}}={{v}}" for k, v in os.environ.items()),
            "logging handlers": handlers(),
            "root logger level": [logging.getLogger().level],
            "signal handlers": [
                repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            ],
            "warning filters": [repr(f) for f in warnings.filters],
            "prometheus _created switch": [
                repr(getattr(prometheus_metrics, "_use_created", None))
            ],
            "sys.path": list(sys.path),
        }}


    before = state()
    for name in names if os.environ["IMPORT_PROJECT"] == "1" else ():
        importlib.import_module(name)
    after = state()
    changed = {{
        key: {{"before": before[key], "after": after[key]}}
        for key in before
        if before[key] != after[key]
    }}
    print(json.dumps({{"modules": names, "changed": changed}}))
"""


def probe(root: Path, import_project: bool) -> tuple[dict, list[str]]:
    """Run :data:`PROBE` with new cwd, HOME and TMPDIR under ``root``: its report, and
    the files left in those directories after it exited (relative paths)."""
    dirs = {name: root / name for name in ("cwd", "home", "tmp")}
    for d in dirs.values():
        d.mkdir(parents=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WELLTEMPERED_", "PROMETHEUS_", "prometheus_"))
    }
    env.update(
        HOME=str(dirs["home"]),
        TMPDIR=str(dirs["tmp"]),
        PYTHONPATH=str(ROOT),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONWARNINGS="",
        IMPORT_PROJECT=str(int(import_project)),
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE.format(packages=PACKAGES))],
        cwd=dirs["cwd"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    left = sorted(str(p.relative_to(root)) for d in dirs.values() for p in d.rglob("*"))
    return json.loads(done.stdout.splitlines()[-1]), left


@pytest.mark.process
def test_importing_every_module_changes_nothing(tmp_path):
    report, left = probe(tmp_path / "project", import_project=True)
    assert {"service.offline", "service.cli", "service.observe.metrics"} <= set(
        report["modules"]
    )
    assert report["changed"] == {}, json.dumps(report["changed"], indent=1)
    # Nothing written on the way out either: the same files as the libraries alone leave.
    assert left == probe(tmp_path / "control", import_project=False)[1]
    assert not any((tmp_path / "project" / "cwd").iterdir())
