"""`welltempered migrate | serve [--demo]`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service import cli, demo
from service.api.app import create_app
from service.settings import Settings
from service.storage import migrate
from service.storage.db import CalibratorVersion, make_engine


def test_migrate_command(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", url)
    assert cli.main(["migrate"]) == 0
    engine = make_engine(url)
    try:
        assert migrate.current_revision(engine) == migrate.head_revision(url)
    finally:
        engine.dispose()
    assert "head" in capsys.readouterr().out


def test_keys_refuses_to_create_a_sqlite_file_elsewhere(tmp_path, monkeypatch, capsys):
    # issue 13: `keys create` run from another directory silently made a new database
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WELLTEMPERED_DATABASE_URL", raising=False)
    where = tmp_path / "welltempered.sqlite3"  # the default URL, relative
    create = ["keys", "create", "--namespace", "team", "--scope", "write"]
    assert cli.main(create) == 2
    err = capsys.readouterr().err
    assert str(where) in err and "welltempered migrate" in err and "--create-database" in err
    assert not where.exists()
    assert cli.main(["keys", "list"]) == 2 and not where.exists()
    # with the flag, before or after the action, it creates (and migrates) it, and says so
    assert cli.main([*create, "--create-database"]) == 0
    assert f"welltempered keys: database SQLite {where} (new)" in capsys.readouterr().err
    where.unlink()
    assert cli.main(["keys", "--create-database", *create[1:]]) == 0
    captured = capsys.readouterr()
    assert f"welltempered keys: database SQLite {where} (new)" in captured.err
    assert captured.out.strip().splitlines()[-1].startswith("wt_")  # the key: last line
    assert where.exists()
    assert cli.main(["keys", "list"]) == 0
    assert f"welltempered keys: database SQLite {where}\n" in capsys.readouterr().err


def test_revoking_an_unknown_key_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", f"sqlite:///{tmp_path / 'k.sqlite3'}")
    assert cli.main(["migrate"]) == 0
    capsys.readouterr()
    assert cli.main(["keys", "revoke", "99"]) == 2  # like every other usage error
    assert "99" in capsys.readouterr().err


def usage_error(capsys, argv: list[str]) -> str:
    """What ``welltempered argv`` says on stderr when argparse refuses it (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv,says",
    [
        (["serve", "--workers", "0"], "--workers: expected an integer >= 1. Got 0."),
        (["serve", "--workers", "-1"], "--workers: expected an integer >= 1. Got -1."),
        (["serve", "--workers", "two"], "--workers: expected an integer >= 1. Got 'two'."),
        (["serve", "--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
        (["worker", "--concurrency", "0"], "--concurrency: expected an integer >= 1. Got 0."),
        (["worker", "--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
    ],
)
def test_bad_options_are_usage_errors(capsys, argv, says):
    # issue 24: `serve --workers 0` started a server, `--log-level loud` a traceback
    assert says in usage_error(capsys, argv)


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"welltempered {importlib.metadata.version('welltempered')}\n"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option, default in [("--host", "127.0.0.1"), ("--port", 8000), ("--workers", 1),
                            ("--log-level", "info")]:
        assert re.search(rf"{option} [^-]*\(default: {re.escape(str(default))}\)", text), option
    assert "(default: None)" not in text and "(default: False)" not in text


def test_migrate_and_gc_say_which_database(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'w.sqlite3'}"
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", url)
    monkeypatch.setenv("WELLTEMPERED_DATA_DIR", str(tmp_path / "data"))
    assert cli.main(["gc"]) == 2  # never a new database
    assert not (tmp_path / "w.sqlite3").exists()
    assert cli.main(["migrate"]) == 0  # migrate creates it
    assert f"database SQLite {tmp_path / 'w.sqlite3'} (new)" in capsys.readouterr().err
    assert cli.main(["gc"]) == 0
    assert f"welltempered gc: database SQLite {tmp_path / 'w.sqlite3'}" in capsys.readouterr().err


def test_a_database_label_never_shows_a_password():
    label = cli.database_label("postgresql+psycopg://team:s3cret@db.internal:5432/calib")
    assert "s3cret" not in label and "db.internal:5432/calib" in label
    assert cli.missing_sqlite_file("postgresql+psycopg://team@db/calib") is None
    assert cli.missing_sqlite_file("sqlite://") is None  # in memory


def test_parser_has_the_commands():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert {"serve", "migrate", "fit"} <= set(sub.choices)


def test_serve_refuses_an_unmigrated_postgres(pg_schema, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", pg_schema)
    monkeypatch.setenv("WELLTEMPERED_DATA_DIR", str(tmp_path / "data"))
    assert cli.main(["serve", "--port", "1"]) == 2
    assert "welltempered migrate" in capsys.readouterr().err


@pytest.mark.parametrize("store", ["folder", "object store"])
def test_demo_is_ready_and_idempotent(tmp_path, monkeypatch, store):
    monkeypatch.chdir(tmp_path)
    update = {"fit_executor": "thread", "auth": "off"}  # as `serve --demo` on loopback
    if store == "object store":  # the demo's fit reads its arrays from there too
        pytest.importorskip("fsspec")
        update["array_store"] = f"local://{tmp_path / 'object-store'}"
    settings = demo.demo_settings(Settings()).model_copy(update=update)
    engine = make_engine(settings.database_url)
    try:
        migrate.ensure_schema(engine, settings.database_url)
        assert demo.install(settings, engine) == 1
        assert demo.install(settings, engine) == 1  # a restart adds nothing
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(CalibratorVersion)) == 1
    finally:
        engine.dispose()
    assert (tmp_path / demo.DEMO_DIR / "demo.sqlite3").exists()
    _, _, logits, _ = demo.digits_logits()
    with TestClient(create_app(settings)) as c:
        v = c.get(f"/v1/models/{demo.MODEL}/calibrators/1").json()
        assert v["status"] == "succeeded"
        assert v["metrics"]["after"]["nll"] < v["metrics"]["before"]["nll"]
        r = c.post(f"/v1/models/{demo.MODEL}/predict", json={"logits": logits[:3].tolist()})
        assert r.status_code == 200, r.text
        assert r.json()["labels"] == logits[:3].argmax(1).tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.process
@pytest.mark.slow
def test_serve_demo_process(tmp_path):
    """The README's `make run`: a real uvicorn process answers predict at once."""
    port = _free_port()
    exe = Path(sys.executable).with_name("welltempered")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "service.cli"]
    proc = subprocess.Popen(
        [*cmd, "serve", "--demo", "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path,
        # the metrics listener on a free port: the default one may be taken here
        env={**os.environ, "WELLTEMPERED_METRICS_ADDRESS": f"127.0.0.1:{_free_port()}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "serve --demo did not become ready"
            time.sleep(0.2)
        row = [[0.0] * 9 + [5.0]]
        r = httpx.post(f"{base}/v1/models/digits-mlp/predict", json={"logits": row})
        assert r.status_code == 200, r.text
        assert r.json()["labels"] == [9] and r.json()["version"] == 1
        assert httpx.get(f"{base}/docs").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stdout.read().decode()


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_first_steps() -> tuple[str, str, dict, dict, str]:
    """From the README: the line to wait for, the ready-made model's predict (path, body,
    printed answer) and where the session's example data is written."""
    text = README.read_text()
    (ready,) = re.findall(r"In another terminal, once\s+`([^`]+)`\s+appears", text)
    match = re.search(
        r"curl -s -X POST localhost:8000(/v1/models/digits-mlp/predict) .*?"
        r"-d '([^']+)'\n(\{[^\n]*\})",
        text, re.S)
    (npz,) = re.findall(r"demo_npz\('([^']+)'\)", text)
    return ready, match.group(1), json.loads(match.group(2)), json.loads(match.group(3)), npz


def test_readme_session_writes_no_file_into_the_repository():
    *_, npz = readme_first_steps()
    folder = Path(npz).parts[0]
    assert len(Path(npz).parts) > 1  # not the repository's root
    ignored = (README.parent / ".gitignore").read_text().splitlines()
    assert f"/{folder}/" in ignored


@pytest.mark.process
@pytest.mark.slow
def test_readme_first_steps(tmp_path):
    """`make run`, then in another terminal once the README's line appears, its
    digits-mlp prediction answers what the README prints."""
    ready, path, body, printed, _ = readme_first_steps()
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--demo", "--port", str(port)],
            cwd=tmp_path,
            env={**os.environ, "WELLTEMPERED_METRICS_ADDRESS": f"127.0.0.1:{_free_port()}"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        awaited = ready.replace(":8000", f":{port}")
        deadline = time.monotonic() + 180
        while awaited not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no {awaited!r} in:\n{log.read_text()}"
            time.sleep(0.2)
        answer = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=30).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert set(answer) == set(printed)
    assert answer["labels"] == printed["labels"] and answer["model"] == printed["model"]
    for key in ("probabilities", "confidence", "entropy"):
        np.testing.assert_allclose(answer[key], printed[key], rtol=1e-5, atol=1e-7)
