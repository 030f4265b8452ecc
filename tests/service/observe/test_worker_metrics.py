"""A dedicated ``welltempered worker`` exports the fits it ran on its own metrics
listener (WELLTEMPERED_WORKER_METRICS_ADDRESS, service/observe/metrics.py): fit
durations and its array read cache, no database gauges, no tenant; a real worker
process, the API in this process."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from service import cli
from service.api.app import create_app
from service.storage.arrays import ArrayStore
from tests.service.helpers import create_model, families, fit, logits_data, make_settings, upload
from tests.service.servers import Worker, free_port

pytestmark = [pytest.mark.slow, pytest.mark.process]

pytest.importorskip("fsspec")

TEMPERATURE = (("method", "temperature"),)


def run_worker_command(monkeypatch, **settings: str) -> int:
    """``welltempered worker`` in this process (it returns before it runs any fit)."""
    for name, value in settings.items():
        monkeypatch.setenv(f"WELLTEMPERED_{name}", value)
    return cli.main(["worker"])


def scrape(address: str) -> tuple[str, dict]:
    r = httpx.get(f"http://{address}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return r.text, families(r.text)


def test_a_worker_serves_the_metrics_of_its_fits(pg_schema, tmp_path, monkeypatch, capsys):
    from service.storage import migrate

    migrate.upgrade(pg_schema)
    store = f"local://{tmp_path / 'object-store'}"  # so the worker's fits use its cache
    address = f"127.0.0.1:{free_port()}"
    mp_dir = tmp_path / "worker-prometheus"  # multiprocess mode, as in the image
    mp_dir.mkdir()
    api = make_settings(pg_schema, tmp_path / "api", run_fits=False, array_store=store)
    with (
        Worker(
            pg_schema,
            tmp_path / "worker",
            array_store=store,
            fit_executor="process",
            worker_metrics_address=address,
            environ={"PROMETHEUS_MULTIPROC_DIR": str(mp_dir)},
        ) as worker,
        TestClient(create_app(api)) as c,
    ):
        create_model(c, "m", 4)
        ds = upload(c, "m", *logits_data(n=300, seed=3))["id"]
        for _ in range(2):
            assert fit(c, "m", ds)["status"] == "succeeded"

        text, got = scrape(address)
        assert got["welltempered_fit_duration_seconds_count"][TEMPERATURE] == 2
        # the first fit downloaded both arrays, the second read the worker's copies
        assert got["welltempered_array_cache_misses_total"][()] == 2
        assert got["welltempered_array_cache_hits_total"][()] == 2
        cached = ArrayStore(tmp_path / "worker").read_cache.usage()
        assert got["welltempered_array_cache_bytes"][()] == cached > 0
        # no database gauges, so no tenant: the API replicas export those
        assert "welltempered_fit_jobs" not in got and "welltempered_database_up" not in got
        assert "namespace=" not in text and '"m"' not in text
        assert any(p.name.startswith("histogram_") for p in mp_dir.iterdir())
        # this process (the API) ran no fit
        assert TEMPERATURE not in families(c.get("/metrics").text).get(
            "welltempered_fit_duration_seconds_count", {}
        )

        # a second worker cannot take the same address: it refuses to start
        assert (
            run_worker_command(
                monkeypatch,
                DATABASE_URL=pg_schema,
                DATA_DIR=str(tmp_path / "other"),
                WORKER_METRICS_ADDRESS=address,
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "cannot listen for metrics" in err and "WORKER_METRICS_ADDRESS" in err, err

        assert worker.terminate() == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{address}/metrics", timeout=5)


def test_a_malformed_worker_metrics_address_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code = run_worker_command(
        monkeypatch,
        DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:1/none",
        WORKER_METRICS_ADDRESS="no-port",
    )
    assert code == 2
    assert "WELLTEMPERED_WORKER_METRICS_ADDRESS is host:port" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
