"""A language model's real next-token logits through the service: upload, fit, predict.

    .venv/bin/python bench/lm_vocab.py [--n 2000] [--requests 300]

The scores are SmolLM2-135M's (K = 49,152) at ``--n`` token positions of Python's own
help texts, made by ``bench/lm_logits.py`` in its own virtual environment
(``--llm-python``, default ``/work/llm-venv/bin/python``; see that script for how to
make it) when the ``.npz`` is not in /tmp yet: the project's ``.venv`` never imports
llama-cpp. Everything else runs here, against a real ``welltempered serve``
(``tests/service/servers.py``: SQLite and a data folder in a temporary directory,
auth off, ``fit_executor=thread`` so that the fits run in the measured process,
``FIT_THREADS=2``) on a 127.0.0.x port. Each figure is printed beside its floor,
the same work done in this process without HTTP:

1. Upload: the float32 ``.npz`` streamed from disk (``Content-Length``, 1 MiB
   reads), then the same logits rounded to float16 (a second dataset). Seconds, and
   the server's peak RSS during the request (``VmRSS`` sampled every 2 ms and
   ``VmHWM`` after ``clear_refs``: ``tests/security/memory.py``) above its RSS
   before, against the arrays it stores (float32 scores + int64 labels). Floor:
   ``np.load`` of the same file and ``np.save`` of its arrays to a file in the
   server's data folder. Then the service's own steps of an upload, called here on
   the same file one after the other: where the seconds go.
2. Fits of each ``--methods`` on the float32 dataset (hold-out ``--holdout``, seed
   0): seconds from submission to a finished status (polled every 0.1 s), the
   server's ``fit_seconds``, its peak RSS growth, and the hold-out metrics the
   service reports before and after (NLL, top-label ECE with 15 bins, accuracy).
   The same metrics are recomputed here from the version's ``params``
   (``calibrators.from_params``) on the rows of ``calibrators.evaluation.holdout.split_indices``,
   and the method is fitted here on the fit rows: the floor.
3. Predict with ``?top_k=5`` through each fitted version: 1 and 64 rows (held-out
   rows), a JSON body with a JSON answer and a ``.npy`` body with a ``.npy`` answer,
   ``--requests`` sequential requests each on one keep-alive connection after 5
   warm-up ones; p50/p99. For contrast, 1 row without ``top_k`` (the whole
   vocabulary). Floor: ``predict_proba`` and ``argpartition`` of the same rows in
   this process. The answers are checked against the floor's.

The machine's load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import calibrators  # noqa: E402
from calibrators.evaluation import metrics  # noqa: E402
from calibrators.evaluation.holdout import split_indices  # noqa: E402
from tests.security.memory import RssMonitor  # noqa: E402
from tests.service.servers import Server  # noqa: E402

MiB = 1 << 20
MODEL = "smollm2"
TOP_K = 5
FINISHED = ("succeeded", "rejected", "failed", "cancelled")


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def ensure_logits(path: Path, n: int, llm_python: str) -> dict:
    """The metadata of ``path``, made first by ``bench/lm_logits.py`` if it is missing."""
    meta = path.with_suffix(".json")
    if not path.exists() or not meta.exists():
        cmd = [llm_python, str(ROOT / "bench" / "lm_logits.py"), "--n", str(n), "--out", str(path)]
        print("# " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads(meta.read_text())


def stream(path: Path, size: int = MiB):
    with open(path, "rb") as fh:
        while block := fh.read(size):
            yield block


def upload(client: httpx.Client, path: Path) -> tuple[httpx.Response, float]:
    """The answer to the upload of ``path``, and its seconds."""
    t0 = time.perf_counter()
    r = client.post(
        f"/v1/models/{MODEL}/datasets", content=stream(path),
        headers={"content-type": "application/octet-stream",
                 "content-length": str(path.stat().st_size)})
    return r, time.perf_counter() - t0


def upload_floor(path: Path, folder: Path) -> float:
    """Seconds to read the .npz and write its arrays as .npy files: no HTTP, no checks."""
    t0 = time.perf_counter()
    with np.load(path) as f:
        for name in ("logits", "labels"):
            target = folder / f"floor-{name}.npy"
            np.save(target, f[name])
            target.unlink()
    return time.perf_counter() - t0


def upload_breakdown(path: Path, folder: Path) -> dict[str, float]:
    """Seconds of the steps of the service's upload, called in this process on the file
    (the spooled body): read and validate the .npz, the dataset's metrics, write the
    files, hashed as they are written (``service/api/routers/datasets.py``)."""
    from service.api.codecs import npz, rules
    from service.settings import Settings
    from service.storage.arrays import ArrayStore

    out = {}
    with np.load(path) as f:
        k = f["logits"].shape[1]
    t0 = time.perf_counter()
    data = npz.labelled_from_npz(path, rules.bounds(Settings(), "dataset", k, MODEL))
    out["read and validate"] = time.perf_counter() - t0
    store = ArrayStore(folder)
    t0 = time.perf_counter()
    metrics.scores_report(data.scores, data.labels, data.kind)
    out["metrics (scores_report)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in (data.scores, data.labels):
        store.write(a)
    out["write (hashed as written, fsync)"] = time.perf_counter() - t0
    return out


def fit(client: httpx.Client, dataset_id: int, method: str, holdout: float) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = client.post(f"/v1/models/{MODEL}/calibrators",
                    json={"dataset_id": dataset_id, "method": method, "holdout": holdout})
    r.raise_for_status()
    url = f"/v1/models/{MODEL}/calibrators/{r.json()['version']}"
    while True:
        body = client.get(url).json()
        if body["status"] in FINISHED:
            return body, time.perf_counter() - t0
        time.sleep(0.1)


def figures(report: dict) -> str:
    return f"NLL {report['nll']:.4f}, ECE {report['ece']:.4f}, accuracy {report['accuracy']:.4f}"


def top_k(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest of each row, largest first: indices and values."""
    idx = np.argpartition(-p, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(p, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1), np.take_along_axis(vals, order, axis=1)


def latencies(client: httpx.Client, url: str, body: bytes, headers: dict, n: int) -> tuple:
    """``n`` sequential requests after 5 warm-up ones: seconds each, and the last answer."""
    for _ in range(5):
        r = client.post(url, content=body, headers=headers)
        r.raise_for_status()
    out = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        r = client.post(url, content=body, headers=headers)
        out[i] = time.perf_counter() - t0
        r.raise_for_status()
    return out, r


def floor_latency(cal, rows: np.ndarray, n: int, k: int | None) -> np.ndarray:
    out = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        p = cal.predict_proba(rows)
        if k is not None:
            top_k(p, k)
        out[i] = time.perf_counter() - t0
    return out


def answer_error(r: httpx.Response, cal, rows: np.ndarray, k: int | None) -> float:
    """Largest difference between the answer's probabilities and this process's."""
    p = cal.predict_proba(rows)
    if r.headers["content-type"].startswith("application/json"):
        body = r.json()
        if k is None:
            return float(np.abs(np.asarray(body["probabilities"]) - p).max())
        idx = np.asarray(body["top_k_indices"])
        got = np.asarray(body["top_k_probabilities"])
    else:
        arr = np.load(io.BytesIO(r.content), allow_pickle=False)
        if k is None:
            return float(np.abs(arr - p).max())
        idx, got = arr["index"], arr["probability"]
    _, want = top_k(p, k)
    # The indices may differ only among equal probabilities: compare those of the answer.
    return float(max(np.abs(got - want).max(), np.abs(np.take_along_axis(p, idx, 1) - got).max()))


def ms(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q) * 1e3)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2_000, help="token positions")
    parser.add_argument("--npz", type=Path, default=None,
                        help="default /tmp/welltempered-smollm2-N-float32.npz (made if missing)")
    parser.add_argument("--llm-python", default="/work/llm-venv/bin/python")
    parser.add_argument("--methods", default="temperature,pts")
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--requests", type=int, default=300, help="per predict case")
    parser.add_argument("--host", default="127.0.0.2")
    args = parser.parse_args(argv)
    path = args.npz or Path(f"/tmp/welltempered-smollm2-{args.n}-float32.npz")
    print(f"# bench/lm_vocab.py --n {args.n} --methods {args.methods} --requests {args.requests}: "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}; "
          f"load average {load_average()}", flush=True)
    meta = ensure_logits(path, args.n, args.llm_python)
    print(f"# logits: {meta['model']} (sha256 {meta['model_sha256'][:16]}..., "
          f"{meta['model_bytes'] / MiB:.1f} MiB), llama-cpp-python {meta['llama_cpp_python']}; "
          f"{meta['text']}: {meta['text_tokens']:,} tokens, {meta['n']:,} positions from "
          f"{meta['windows']} windows of {meta['context']} (stride {meta['stride']}), "
          f"{meta['tokens_evaluated'] / meta['eval_seconds']:.0f} tokens/s on "
          f"{meta['threads']} threads", flush=True)
    with np.load(path) as f:
        z, y = f["logits"], f["labels"]
    n, k = z.shape
    stored = n * k * 4 + n * 8
    accuracy = float((z.argmax(axis=1) == y).mean())
    print(f"# {n:,} x {k:,} {z.dtype} ({z.nbytes / MiB:.1f} MiB), top-1 accuracy of the model "
          f"{accuracy:.4f}; labels span {len(np.unique(y)):,} distinct tokens", flush=True)
    half = path.with_name(path.stem.replace("float32", "float16") + ".npz")
    if half == path:
        half = path.with_name(path.stem + "-float16.npz")
    np.savez(half, logits=z.astype(np.float16), labels=y)
    fit_rows, hold_rows = split_indices(n, args.holdout, 0)

    with tempfile.TemporaryDirectory(prefix="welltempered-lm-vocab-") as tmp:
        tmp = Path(tmp)
        server = Server(f"sqlite:///{tmp / 'r.sqlite3'}", tmp / "data", host=args.host,
                        fit_executor="thread", fit_threads="2")
        with server, server.client(timeout=600) as c:
            monitor = RssMonitor(server.proc.pid)
            print(f"# server pid {server.proc.pid} on {server.base}, RSS at rest "
                  f"{monitor.rss() / MiB:.0f} MiB", flush=True)
            r = c.post("/v1/models", json={"name": MODEL, "num_classes": k})
            r.raise_for_status()

            print("\n## Upload\n")
            print("| body | bytes | status | seconds | floor s | x floor | MiB/s | RSS before "
                  "MiB | peak growth MiB | growth / stored arrays | anon growth MiB |")
            print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            datasets = {}
            for label, file in (("float32", path), ("float16", half)):
                floor = upload_floor(file, tmp / "data")
                (resp, seconds), before, growth = monitor.measure(lambda f=file: upload(c, f))
                size = file.stat().st_size
                print(f"| .npz {label} | {size / MiB:.1f} MiB | {resp.status_code} | "
                      f"{seconds:.2f} | {floor:.2f} | {seconds / floor:.1f} | "
                      f"{size / MiB / seconds:.0f} | {before / MiB:.0f} | {growth / MiB:.0f} | "
                      f"{growth / stored:.2f} | {monitor.anon_growth / MiB:.0f} |", flush=True)
                if resp.status_code not in (200, 201):
                    print(f"upload failed: {resp.text[:2000]}")
                    raise SystemExit(1)
                datasets[label] = resp.json()
            for label, file in (("float32", path), ("float16", half)):
                steps = upload_breakdown(file, tmp / "breakdown")
                print(f"\n{label}, the upload's steps in this process: " + ", ".join(
                    f"{name} {sec:.2f} s" for name, sec in steps.items())
                    + f"; together {sum(steps.values()):.2f} s", flush=True)
            ds = datasets["float32"]
            print(f"\ndataset {ds['id']}: {ds['n']} x {ds['k']} {ds['dtype']}, service metrics of "
                  f"the raw scores: {figures(ds['metrics'])}; float16 dataset "
                  f"{datasets['float16']['id']}: {figures(datasets['float16']['metrics'])}")

            print(f"\n## Fit (hold-out {args.holdout:.0%}: {len(fit_rows)} fit rows, "
                  f"{len(hold_rows)} held out)\n")
            print("| method | status | seconds to done | fit_seconds | floor s | x floor | peak "
                  "growth MiB (RSS / anon) | before: NLL / ECE | after: NLL / ECE | here: after "
                  "NLL / ECE | accuracy before / after |")
            print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |")
            versions, local = {}, {}
            before_here = metrics.scores_report(z[hold_rows], y[hold_rows])
            for method in args.methods.split(","):
                (body, seconds), _, growth = monitor.measure(
                    lambda m=method: fit(c, ds["id"], m, args.holdout))
                t0 = time.perf_counter()
                calibrators.create(method).fit(z[fit_rows], y[fit_rows])
                floor = time.perf_counter() - t0
                if body["status"] != "succeeded":
                    print(f"| {method} | {body['status']} | {seconds:.1f} | | {floor:.1f} | | "
                          f"{growth / MiB:.0f} | {body.get('error') or body.get('rejection')} |")
                    continue
                versions[method] = body["version"]
                cal = local[method] = calibrators.from_params(body["params"])
                after_here = metrics.report(cal.predict_proba(z[hold_rows]), y[hold_rows])
                mb, ma = body["metrics"]["before"], body["metrics"]["after"]
                print(f"| {method} | {body['status']} | {seconds:.1f} | {body['fit_seconds']:.1f} "
                      f"| {floor:.1f} | {body['fit_seconds'] / floor:.2f} | {growth / MiB:.0f} / "
                      f"{monitor.anon_growth / MiB:.0f} | "
                      f"{mb['nll']:.4f} / {mb['ece']:.4f} | {ma['nll']:.4f} / {ma['ece']:.4f} | "
                      f"{after_here['nll']:.4f} / {after_here['ece']:.4f} | "
                      f"{mb['accuracy']:.4f} / {ma['accuracy']:.4f} |", flush=True)
                params = {key: v for key, v in body["params"].items() if not isinstance(v, list)}
                print(f"  {method}: params {json.dumps(params)[:300]}", flush=True)
            print(f"\nhere, before: {figures(before_here)} (the service's before is "
                  "computed from the same rows)")

            print(f"\n## Predict, ?top_k={TOP_K} ({args.requests} sequential requests per case)\n")
            print("| version | case | body KiB | answer KiB | p50 ms | p99 ms | floor p50 ms | "
                  "x floor | max abs diff |")
            print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for method, version in versions.items():
                cal = local[method]
                url = f"/v1/models/{MODEL}/predict?version={version}"
                for rows_n, fmt, kk, reqs in (
                    (1, "json", TOP_K, args.requests), (64, "json", TOP_K, args.requests),
                    (1, "npy", TOP_K, args.requests), (64, "npy", TOP_K, args.requests),
                    (1, "json", None, max(20, args.requests // 5)),
                    (1, "npy", None, max(20, args.requests // 5)),
                ):
                    rows = np.ascontiguousarray(z[hold_rows[:rows_n]])
                    if fmt == "json":
                        body = orjson.dumps({"logits": rows}, option=orjson.OPT_SERIALIZE_NUMPY)
                        headers = {"content-type": "application/json"}
                    else:
                        buf = io.BytesIO()
                        np.save(buf, rows)
                        body = buf.getvalue()
                        headers = {"content-type": "application/x-npy",
                                   "accept": "application/x-npy"}
                    q = url + (f"&top_k={kk}" if kk else "")
                    lat, last = latencies(c, q, body, headers, reqs)
                    base = floor_latency(cal, rows, min(reqs, 50), kk)
                    what = f"{rows_n} x {k:,} {fmt}" + ("" if kk else ", whole row")
                    print(f"| {method} | {what} | {len(body) / 1024:.0f} | "
                          f"{len(last.content) / 1024:.1f} | {ms(lat, 50):.1f} | "
                          f"{ms(lat, 99):.1f} | {ms(base, 50):.1f} | "
                          f"{ms(lat, 50) / ms(base, 50):.1f} | "
                          f"{answer_error(last, cal, rows, kk):.1e} |", flush=True)
            print(f"\n# server RSS at the end {monitor.rss() / MiB:.0f} MiB")
    half.unlink()
    print(f"# load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
