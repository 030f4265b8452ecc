"""Peak memory of a real server while it handles hostile bodies: the cases of
test_memory.py, also runnable against another checkout to measure "before":

    .venv/bin/python -m tests.security.memory [CASE...]       # this checkout
    cd /tmp/before && PYTHONPATH=/tmp/before /work/main/.venv/bin/python -m tests.security.memory

(the second: an older tree, e.g. ``git archive <commit>``, with this tests/security
copied in; CASE: words of the case functions' names, e.g. ``accepted``)

Each case resets the server's peak RSS (``/proc/<pid>/clear_refs``, Linux) and
samples ``VmRSS`` every 2 ms while the request runs; the peak is the larger of
the sampled maximum and ``VmHWM``, minus the RSS just before the request.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.security import payloads as pl
from tests.service.servers import Server

MiB = 1 << 20
K = 10
MODEL = "bombs"
#: A language-model vocabulary (SmolLM2's), for the uploads of issue 13.
VOCAB_K = 49_152
VOCAB_MODEL = "vocab"


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


class RssMonitor:
    """The peak RSS growth of process ``pid`` while a function runs; after
    :meth:`measure`, ``anon_growth`` is the peak growth of its anonymous memory
    (``RssAnon``: allocations, without the pages of files it maps, such as a
    memory-mapped dataset)."""

    def __init__(self, pid: int, interval: float = 0.002):
        self.pid = pid
        self.interval = interval
        self.anon_growth = 0

    def rss(self) -> int:
        return _status_kib(self.pid, "VmRSS") * 1024

    def _rss_and_anon(self) -> tuple[int, int]:
        """``VmRSS`` and ``RssAnon`` in bytes, from one read of the status file."""
        fields = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon"):
                    fields[name] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["RssAnon"]

    def _reset_peak(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def measure(self, fn: Callable[[], object]) -> tuple[object, int, int]:
        """``fn()``, the RSS before it, and the peak growth (bytes) while it ran."""
        time.sleep(0.2)  # let the previous request's memory settle
        hwm = self._reset_peak()
        before, anon_before = self._rss_and_anon()
        peak, anon_peak = before, anon_before
        done = threading.Event()

        def sample() -> None:
            nonlocal peak, anon_peak
            while not done.is_set():
                try:
                    rss, anon = self._rss_and_anon()
                except (OSError, LookupError, KeyError):
                    return
                peak, anon_peak = max(peak, rss), max(anon_peak, anon)
                time.sleep(self.interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            result = fn()
            time.sleep(0.05)
        finally:
            done.set()
            sampler.join()
        if hwm:
            peak = max(peak, _status_kib(self.pid, "VmHWM") * 1024)
        self.anon_growth = anon_peak - anon_before
        return result, before, peak - before


def raw_request(port: int, path: str, headers: dict[str, str], chunks: Iterable[bytes],
                limit: int) -> tuple[int, bytes]:
    """POST a chunked body by hand, stopping as soon as the server answers or closes, or
    after ``limit`` bytes; the status (0: none) and the start of the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Transfer-Encoding: chunked",
                 *(f"{k}: {v}" for k, v in headers.items())]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer, sent, stop = b"", 0, False
        for chunk in chunks:
            if not chunk:  # a chunk of 0 bytes would end the body
                continue
            view = memoryview(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            while view and not stop:
                readable, writable, _ = select.select([sock], [sock], [], 5)
                if readable:
                    try:
                        answer += sock.recv(65536)
                    except OSError:
                        pass
                    stop = True
                elif writable:
                    try:
                        n = sock.send(view)
                    except OSError:
                        stop = True
                        break
                    view, sent = view[n:], sent + n
            if stop or sent > limit:
                break
        else:
            sock.sendall(b"0\r\n\r\n")
        sock.settimeout(30)
        while b"\r\n\r\n" not in answer:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            answer += data
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
        return status, answer[:2000]
    finally:
        sock.close()


@dataclass
class Case:
    name: str
    body_bytes: int  # the bytes sent (or declared)
    status: int  # expected
    run: Callable[[Server], tuple[int, bytes]]
    #: Run once before measuring: an accepted batch of a new size grows ONNX Runtime's
    #: arena once (a cost of serving that size, not of the body).
    warm: bool = False
    #: Bytes of the arrays an accepted upload stores (its scores as float32 or float64,
    #: its labels as int64): what its peak is compared with.
    array_bytes: int | None = None


def _post(server: Server, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    with server.client() as c:
        r = c.post(path, content=body, headers={"content-type": content_type})
        return r.status_code, r.content[:2000]


def _bomb_case() -> Case:
    # issue 12: a 2.0 MB .npz with shape (-1, 10) took the server from 205 to 4,273 MiB.
    bomb = pl.npy_bomb((-1, K), 1 << 30)
    return Case("npz bomb, shape (-1, 10), 1 GiB of zeros", len(bomb), 400,
                lambda s: _post(s, f"/v1/models/{MODEL}/datasets", bomb,
                                "application/octet-stream"))


def _zero_npz_case() -> Case:
    # A valid all-zero .npz declaring more rows than max_dataset_rows (1,000,000 by default).
    rows = 10_000_001
    member = pl.deflated_member("logits.npy", pl.npy_header((rows, K)), 64 << 20)
    body = pl._merge(member, {"labels.npy": pl.npy((10,), "<i8")})
    return Case(f"npz of zeros, {rows:,} x {K} declared", len(body), 413,
                lambda s: _post(s, f"/v1/models/{MODEL}/datasets", body,
                                "application/octet-stream"))


def _endless_npy_case() -> Case:
    header = pl.npy_header((1000, K))
    return Case("endless chunked .npy predict, (1000, 10) declared", 0, 400,
                lambda s: raw_request(s.port, f"/v1/models/{MODEL}/predict",
                                      {"Content-Type": "application/x-npy"},
                                      pl.endless(header, 1 << 20), 2 << 30))


def _endless_npy_over_rows_case() -> Case:
    header = pl.npy_header((10**7, K))
    return Case("endless chunked .npy predict, 10,000,000 rows declared", 0, 413,
                lambda s: raw_request(s.port, f"/v1/models/{MODEL}/predict",
                                      {"Content-Type": "application/x-npy"},
                                      pl.endless(header, 1 << 20), 2 << 30))


def _endless_garbage_case() -> Case:
    return Case("endless chunked garbage predict (no .npy header)", 0, 400,
                lambda s: raw_request(s.port, f"/v1/models/{MODEL}/predict",
                                      {"Content-Type": "application/x-npy"},
                                      pl.endless(b"", 1 << 20), 2 << 30))


def _json_rows(rows: int, seed: int = 0) -> bytes:
    z = np.random.default_rng(seed).normal(size=(rows, K))
    return json.dumps({"logits": z.tolist()}).encode()


def _json_over_limit_case() -> Case:
    # issue 12: a 59 MiB JSON predict over the row limit peaked at 938 MiB.
    body = _json_rows(300_000)
    return Case(f"JSON predict of 300,000 rows ({len(body) / MiB:.0f} MiB), Content-Length",
                len(body), 413,
                lambda s: _post(s, f"/v1/models/{MODEL}/predict", body, "application/json"))


def _json_over_limit_chunked_case() -> Case:
    body = _json_rows(300_000)
    pieces = [body[i : i + MiB] for i in range(0, len(body), MiB)]
    return Case(f"JSON predict of 300,000 rows ({len(body) / MiB:.0f} MiB), chunked",
                len(body), 413,
                lambda s: raw_request(s.port, f"/v1/models/{MODEL}/predict",
                                      {"Content-Type": "application/json"}, pieces, 2 << 30))


def _json_short_rows_case() -> Case:
    rows = 150_000
    body = b'{"logits": [' + b",".join([b"[0,1,0,1,0,1,0,1,0,2]"] * rows) + b"]}"
    return Case(f"JSON predict of {rows:,} short rows ({len(body) / MiB:.1f} MiB), under the "
                "byte limit", len(body), 413,
                lambda s: _post(s, f"/v1/models/{MODEL}/predict", body, "application/json"))


def _json_accepted_case() -> Case:
    body = _json_rows(100_000, seed=1)
    return Case(f"JSON predict of 100,000 x 10 ({len(body) / MiB:.0f} MiB), accepted",
                len(body), 200,
                lambda s: _post(s, f"/v1/models/{MODEL}/predict", body, "application/json"),
                warm=True)


def _npy_accepted_case() -> Case:
    body = pl.array_npy(np.random.default_rng(2).normal(size=(100_000, K)))
    return Case(f"npy predict of 100,000 x 10 float64 ({len(body) / MiB:.0f} MiB), accepted",
                len(body), 200,
                lambda s: _post(s, f"/v1/models/{MODEL}/predict", body, "application/x-npy"),
                warm=True)


def _npz_accepted_case() -> Case:
    rng = np.random.default_rng(3)
    rows = 1_000_000
    scores = pl.array_npy(rng.normal(size=(rows, K)))
    body = pl.npz({"logits.npy": scores, "labels.npy": pl.array_npy(rng.integers(0, K, rows))})
    return Case(f"npz dataset of {rows:,} x 10 float64 ({len(body) / MiB:.0f} MiB), accepted",
                len(body), 201,
                lambda s: _post(s, f"/v1/models/{MODEL}/datasets", body,
                                "application/octet-stream"))


def _vocab_npz(dtype: str, rows: int, seed: int) -> tuple[bytes, int]:
    """A .npz of ``rows`` x VOCAB_K ``dtype`` logits and their labels, and the bytes of
    its arrays as the service reads them (float32 scores, or float64; int64 labels)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, VOCAB_K), dtype=np.float32).astype(dtype)
    y = rng.integers(0, VOCAB_K, rows)
    body = pl.npz({"logits.npy": pl.array_npy(z), "labels.npy": pl.array_npy(y)})
    return body, rows * VOCAB_K * (8 if dtype == "float64" else 4) + rows * 8


def _vocab_npz_case(dtype: str, rows: int = 1_360) -> Case:
    body, stored = _vocab_npz(dtype, rows, seed=4)
    return Case(f"npz dataset of {rows:,} x {VOCAB_K:,} {dtype} ({len(body) / MiB:.0f} MiB), "
                "accepted", len(body), 201,
                lambda s: _post(s, f"/v1/models/{VOCAB_MODEL}/datasets", body,
                                "application/octet-stream"), array_bytes=stored)


def _vocab_feedback_case(dtype: str, rows: int = 1_360) -> Case:
    """Feedback as a .npz: the rows are calibrated by the version that served them and
    folded into the monitoring statistics; compared with its arrays as read (float32
    scores, int64 labels), as an upload is with the arrays it stores."""
    body, arrays = _vocab_npz(dtype, rows, seed=7)
    return Case(f"npz feedback of {rows:,} x {VOCAB_K:,} {dtype} ({len(body) / MiB:.0f} MiB), "
                "accepted", len(body), 200,
                lambda s: _post(s, f"/v1/models/{VOCAB_MODEL}/feedback", body,
                                "application/octet-stream"), warm=True, array_bytes=arrays)


def _vocab_feedback_float32_case() -> Case:
    return _vocab_feedback_case("float32")


def _vocab_feedback_float16_case() -> Case:
    return _vocab_feedback_case("float16")


def _vocab_float32_case() -> Case:
    return _vocab_npz_case("float32")


def _vocab_float16_case() -> Case:
    return _vocab_npz_case("float16")


def _vocab_predict_case(query: str, accept: str) -> Case:
    rows = 1_000
    body = pl.array_npy(np.random.default_rng(5).standard_normal((rows, VOCAB_K), np.float32))

    def run(s: Server) -> tuple[int, bytes]:
        with s.client() as c:
            r = c.post(f"/v1/models/{VOCAB_MODEL}/predict{query}", content=body,
                       headers={"content-type": "application/x-npy", "accept": accept})
            return r.status_code, r.content[:2000]

    return Case(f"npy predict of {rows:,} x {VOCAB_K:,} float32 ({len(body) / MiB:.0f} MiB)"
                f"{query}, answer {accept}, accepted", len(body), 200, run, warm=True)


def _vocab_predict_top_k_case() -> Case:
    return _vocab_predict_case("?top_k=5", "application/json")


def _vocab_predict_npy_case() -> Case:
    return _vocab_predict_case("", "application/x-npy")


def _v2_binary_case() -> Case:
    """Open Inference Protocol infer, binary tensor data in and out: the whole rows come
    back as raw float32 after the JSON header."""
    rows = 1_000
    z = np.random.default_rng(6).standard_normal((rows, VOCAB_K), np.float32)
    head = json.dumps({
        "inputs": [{"name": "logits", "shape": [rows, VOCAB_K], "datatype": "FP32",
                    "parameters": {"binary_data_size": z.nbytes}}],
        "parameters": {"binary_data_output": True},
    }).encode()
    body = head + z.tobytes()
    del z

    def run(s: Server) -> tuple[int, bytes]:
        with s.client() as c:
            r = c.post(f"/v2/models/{VOCAB_MODEL}/infer", content=body,
                       headers={"content-type": "application/octet-stream",
                                "inference-header-content-length": str(len(head))})
            return r.status_code, r.content[:2000]

    return Case(f"v2 binary infer of {rows:,} x {VOCAB_K:,} float32 ({len(body) / MiB:.0f} MiB)"
                ", binary outputs, accepted", len(body), 200, run, warm=True)


CASES = [
    _bomb_case,
    _zero_npz_case,
    _endless_npy_case,
    _endless_npy_over_rows_case,
    _endless_garbage_case,
    _json_over_limit_case,
    _json_over_limit_chunked_case,
    _json_short_rows_case,
    _json_accepted_case,
    _npy_accepted_case,
    _npz_accepted_case,
    _vocab_float32_case,
    _vocab_float16_case,
    _vocab_predict_top_k_case,
    _vocab_predict_npy_case,
    _v2_binary_case,
    _vocab_feedback_float32_case,
    _vocab_feedback_float16_case,
]


def prepare(server: Server) -> None:
    """Model ``bombs`` (10 classes), temperature-fitted, with the default alias."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, K, 500)
    z = rng.normal(size=(500, K)) * 2
    z[np.arange(500), y] += 2
    with server.client() as c:
        assert c.post("/v1/models", json={"name": MODEL, "num_classes": K,
                                          "argmax_policy": "off"}).status_code == 201
        r = c.post(f"/v1/models/{MODEL}/datasets", json={"logits": z.tolist(),
                                                         "labels": y.tolist()})
        assert r.status_code == 201, r.text
        r = c.post(f"/v1/models/{MODEL}/calibrators",
                   json={"dataset_id": r.json()["id"], "method": "temperature"})
        version = r.json()["version"]
        for _ in range(600):
            status = c.get(f"/v1/models/{MODEL}/calibrators/{version}").json()["status"]
            if status not in ("queued", "running"):
                break
            time.sleep(0.1)
        assert status == "succeeded", status
        r = c.put(f"/v1/models/{MODEL}/aliases/production", json={"version": version})
        assert r.status_code == 200, r.text
        # The first predict loads the ONNX Runtime session: not a cost of any body.
        r = c.post(f"/v1/models/{MODEL}/predict", json={"logits": z[:2].tolist()})
        assert r.status_code == 200, r.text
        r = c.post("/v1/models", json={"name": VOCAB_MODEL, "num_classes": VOCAB_K,
                                       "argmax_policy": "off"})
        assert r.status_code == 201, r.text
        _serve_vocab(c, rng)


def _serve_vocab(c, rng: np.random.Generator) -> None:
    """A temperature fit of model ``vocab`` on 64 rows, with the default alias."""
    y = rng.integers(0, VOCAB_K, 64)
    z = rng.standard_normal((64, VOCAB_K), np.float32)
    z[np.arange(64), y] += 10
    body = pl.npz({"logits.npy": pl.array_npy(z), "labels.npy": pl.array_npy(y)})
    r = c.post(f"/v1/models/{VOCAB_MODEL}/datasets", content=body,
               headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    r = c.post(f"/v1/models/{VOCAB_MODEL}/calibrators",
               json={"dataset_id": r.json()["id"], "method": "temperature"})
    version = r.json()["version"]
    for _ in range(600):
        status = c.get(f"/v1/models/{VOCAB_MODEL}/calibrators/{version}").json()["status"]
        if status not in ("queued", "running"):
            break
        time.sleep(0.1)
    assert status == "succeeded", status
    r = c.put(f"/v1/models/{VOCAB_MODEL}/aliases/production", json={"version": version})
    assert r.status_code == 200, r.text


def measure(server: Server, case: Case) -> dict:
    monitor = RssMonitor(server.proc.pid)
    if case.warm:
        case.run(server)
    (status, answer), before, growth = monitor.measure(lambda: case.run(server))
    return {"case": case.name, "body": case.body_bytes, "arrays": case.array_bytes,
            "status": status,
            "expected": case.status, "rss_before": before, "growth": growth,
            "answer": answer.split(b"\r\n\r\n", 1)[-1][:300].decode("latin1")}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = Server(f"sqlite:///{tmp / 'r.sqlite3'}", tmp / "data", fit_executor="thread")
        with server:
            prepare(server)
            print(f"server pid {server.proc.pid}, PYTHONPATH={os.environ.get('PYTHONPATH', '')}")
            print("| case | body | arrays stored | status | RSS before | peak growth |")
            print("| --- | ---: | ---: | --- | ---: | ---: |")
            for make in CASES:
                if sys.argv[1:] and not any(word in make.__name__ for word in sys.argv[1:]):
                    continue
                row = measure(server, make())
                stored = f"{row['arrays'] / MiB:.1f} MiB" if row["arrays"] else ""
                print(f"| {row['case']} | {row['body'] / MiB:.1f} MiB | {stored} | {row['status']} "
                      f"(expected {row['expected']}) | {row['rss_before'] / MiB:.0f} MiB | "
                      f"{row['growth'] / MiB:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
