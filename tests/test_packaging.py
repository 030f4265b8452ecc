"""A regular install works, not only the editable one: the wheel carries the Alembic
migrations, and `welltempered migrate` run from it builds the schema with neither the
source tree nor alembic.ini in reach (what the Dockerfile's `pip install .` relies on).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from contextlib import closing
from pathlib import Path

import pytest

from service.storage import migrate
from service.storage.db import Base
from tests.helpers import WHEEL_SOURCES

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
MIGRATIONS = ROOT / "migrations"

#: Run by the .venv's interpreter with -I -S: no site-packages, no .pth files (so no
#: editable finder pointing at the repository), no PYTHON* variables, no cwd on
#: sys.path. argv[1:] is the new sys.path: the wheel's install, then the dependencies.
MIGRATE_FROM_THE_WHEEL = """
import json, sys
sys.path[:0] = sys.argv[1:]
import service.cli, service.storage.migrate
status = service.cli.main(["migrate"])
modules = sorted(
    m.__file__ for name, m in sys.modules.items()
    if name.split(".")[0] in ("service", "calibrators") and getattr(m, "__file__", None)
)
scripts = str(service.storage.migrate.script_location())
print(json.dumps({"status": status, "modules": modules, "scripts": scripts}))
"""


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, (
        f"{args[1:4]} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built offline from a copy of the sources: no build/ or *.egg-info in the repository."""
    src = tmp_path_factory.mktemp("src")
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    run(
        sys.executable,
        *("-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"),
        *("--wheel-dir", str(out), str(src)),
    )
    (path,) = out.glob("welltempered-*.whl")
    return path


def test_wheel_contains_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "service/" + p.relative_to(ROOT).as_posix()
        for p in MIGRATIONS.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    revisions = {n for n in expected if n.startswith("service/migrations/versions/")}
    assert revisions and all(n.endswith(".py") for n in revisions), revisions
    assert {"service/migrations/env.py", "service/migrations/script.py.mako"} <= expected
    assert expected - names == set()
    assert not any(n.startswith(("migrations/", "tests/")) for n in names)


def test_migrate_from_the_installed_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    run(
        sys.executable,
        *("-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)),
    )
    # The dependencies: this venv's site-packages, without its editable welltempered.
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    assert all(not (Path(d) / "service").exists() for d in deps)
    work = tmp_path / "work"  # the cwd: not the repository, no alembic.ini
    work.mkdir()
    db = work / "wheel.sqlite3"
    url = f"sqlite:///{db}"
    done = run(
        *(sys.executable, "-I", "-S", "-c", MIGRATE_FROM_THE_WHEEL, str(site), *deps),
        cwd=work,
        env={"PATH": os.environ.get("PATH", ""), "WELLTEMPERED_DATABASE_URL": url},
    )
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["status"] == 0
    # Everything came from the wheel: the modules and the migration scripts.
    assert report["modules"], "no welltempered module was imported"
    for path in [*report["modules"], report["scripts"]]:
        assert Path(path).is_relative_to(site), path
    assert "Running upgrade" in done.stderr  # `welltempered migrate` shows its progress

    with closing(sqlite3.connect(db)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        (version,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    assert version == migrate.head_revision(url)  # every revision of the repository ran
