# syntax=docker/dockerfile:1
# The welltempered API: `welltempered serve` (uvicorn, several worker processes) on :8000.
# CPU only: the service needs numpy, scipy and onnxruntime; torch is a test-only
# dependency (pyproject.toml) and is not installed here.
# The same image runs `welltempered worker` (fits) and `welltempered migrate`. Build and
# run with docker-compose.yml (PostgreSQL, migrate step, API replicas behind HAProxy,
# workers, Prometheus, Grafana).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY calibrators ./calibrators
COPY service ./service
COPY migrations ./migrations
# A regular install into the venv: the Alembic migrations are package data
# (migrations/, installed as service.migrations), so `welltempered migrate` needs neither alembic.ini nor this
# source tree, which stays behind in this stage.
RUN pip install .

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    WELLTEMPERED_DATA_DIR=/data \
    PROMETHEUS_MULTIPROC_DIR=/tmp/welltempered-prometheus
RUN useradd --system --uid 10001 --user-group --no-create-home welltempered \
    && mkdir -p /data /keys /tmp/welltempered-prometheus \
    && chown welltempered:welltempered /data /keys /tmp/welltempered-prometheus
# /keys: docker-compose.yml's first-key volume, writable by the service user (a new named
# volume takes the ownership of the image's folder it is mounted on).
COPY --from=build /opt/venv /opt/venv
COPY deploy/api/entrypoint.sh /usr/local/bin/welltempered-entrypoint
# Writable by the service user: relative paths (the default SQLite file, `--demo`) land here.
WORKDIR /data
USER welltempered
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
# Sets up PROMETHEUS_MULTIPROC_DIR (wiped before start-up), then runs the command.
ENTRYPOINT ["welltempered-entrypoint"]
# WELLTEMPERED_DATABASE_URL comes from the environment (docker-compose.yml).
CMD ["welltempered", "serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
