"""The lean runtime (issue 13, item 5): `make run` installs the package's own
dependencies only; torch and the test tools are in the dev extra, which `make test`
installs (torch pinned in the Makefile); and the whole library and service import
with every dev-only package made unimportable."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


RUNTIME = _names(PYPROJECT["project"]["dependencies"])
DEV = _names(PYPROJECT["project"]["optional-dependencies"]["dev"]) - RUNTIME
#: The import names of the dev-only distributions whose import name differs.
IMPORT_NAMES = {"import-linter": "importlinter", "pyyaml": "yaml", "pytest-timeout":
                "pytest_timeout", "pytest-xdist": "xdist"}


def _recipe(target: str) -> str:
    """The recipe lines of a Makefile target (tab-indented lines after 'target:')."""
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)*)", MAKEFILE, re.M)
    assert match, target
    return match.group(1)


def test_torch_and_the_test_tools_are_dev_only():
    for name in ("torch", "pytest", "hypothesis", "netcal", "schemathesis", "tritonclient",
                 "ruff", "import-linter"):
        assert name in DEV and name not in RUNTIME, name


def test_make_run_installs_the_runtime_and_make_test_the_dev_extra():
    run = re.search(r"^run: (\S+)", MAKEFILE, re.M).group(1)
    assert run == "$(RUNTIME)"
    runtime = _recipe("$(RUNTIME)")
    assert "pip install -q -e .\n" in runtime and "TORCH" not in runtime
    dev = _recipe("$(STAMP)")
    assert "$(TORCH) -e '.[dev]'" in dev
    assert re.search(r"^TORCH := torch==2\.13\.0$", MAKEFILE, re.M)
    # make test runs after lint, which installs the dev extra
    assert re.search(r"^test: lint$", MAKEFILE, re.M)
    assert re.search(r"^lint: \$\(STAMP\)$", MAKEFILE, re.M)


BLOCKER = """
import importlib.abc, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))
OPTIONAL = set(sys.argv[2].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is a dev-only package")
sys.meta_path.insert(0, Block())
import calibrators, service
for package in (calibrators, service):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name not in OPTIONAL:
            __import__(info.name)
from service.api.app import create_app
from service.settings import Settings
create_app(Settings(database_url="sqlite://"))
print("imported")
"""


#: Modules of an optional extra (pyproject's [project.optional-dependencies]), not of
#: the runtime: the torch export needs the "torch" extra, and nothing else imports it.
OPTIONAL_MODULES = {"calibrators.torch_export": "torch"}


def test_optional_modules_belong_to_an_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert all(extra in extras for extra in OPTIONAL_MODULES.values())


def test_every_module_imports_without_the_dev_packages():
    blocked = {IMPORT_NAMES.get(n, n.replace("-", "_")) for n in DEV} - {"setuptools"}
    assert {"torch", "pytest", "hypothesis"} <= blocked
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, ",".join(sorted(blocked)), ",".join(OPTIONAL_MODULES)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-3000:]
