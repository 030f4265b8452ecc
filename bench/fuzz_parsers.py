"""Coverage-guided fuzzing of the request-body parsers (.npy, .npz, JSON) with atheris.

The target is :func:`tests.security.harness.one_input`: its first byte picks the
format, the rest is the body, parsed exactly as the service parses it (a .npy
predict body in chunks, a .npz upload from a file, both also with ``?dtype=bfloat16``,
a JSON body of each route, and the JSON group parser compared with orjson). A crash
is any exception but a domain refusal (a 500 in the service), a parse slower than
``-timeout`` seconds, or the process passing ``-rss_limit_mb`` (an inflation).

Seeds are written from tests/security/payloads.py (valid bodies and the known
hostile ones) and from tests/security/corpus/. Crashers found are written under
``--artifacts``; minimise them and commit them to tests/security/corpus/<format>/
(without the selector byte), where test_corpus.py replays them.

    .venv/bin/pip install atheris
    .venv/bin/python bench/fuzz_parsers.py --seconds 300

Other arguments are passed to libFuzzer (``-jobs``, ``-max_len``...).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import atheris
except ImportError:
    sys.exit("bench/fuzz_parsers.py needs atheris: .venv/bin/pip install atheris")

with atheris.instrument_imports(include=["service", "calibrators", "tests.security", "zipfile"]):
    from tests.security import harness, payloads

CORPUS = ROOT / "tests" / "security" / "corpus"


def seeds() -> dict[str, list[bytes]]:
    """Valid bodies and hostile ones, per format."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 4))
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    y = np.arange(5) % 4
    npy = [
        payloads.array_npy(z),
        payloads.array_npy(z.astype(np.float32)),
        payloads.array_npy(np.asfortranarray(z)),
        payloads.array_npy(z.astype(">f8")),
        payloads.array_npy(p),
        payloads.npy((-1, 4)),
        payloads.npy((2, 4), version=(2, 0)),
        payloads.npy((2, 4), version=(3, 0)),
        payloads.npy_header((True, 4)),
    ]
    members = {"logits.npy": payloads.array_npy(z), "labels.npy": payloads.array_npy(y)}
    npz = [
        payloads.npz(members),
        payloads.npz(members, compression=8),
        payloads.npz({"predictions.npy": payloads.array_npy(p), "ground_truth.npy": y.tobytes()}),
        payloads.patch_members(payloads.npz(members), flags=1),
        payloads.npz(
            {"logits.npy": payloads.npy((-1, 4)), "labels.npy": payloads.npy((5,), "<i8")}
        ),
    ]
    js = [
        json.dumps({"logits": z.tolist(), "labels": y.tolist()}).encode(),
        json.dumps({"probabilities": p.tolist(), "labels": y.tolist(), "version": 1}).encode(),
        json.dumps({"logits": z.tolist()}, indent=2).encode(),
        b'{"logits": [[1, 2, 3, NaN]], "labels": [0]}',
        b'{"\\u006cogits": [[1, 2, 3, 4]], "labels": [true]}',
    ]
    # ?dtype=bfloat16: raw bit patterns (the top half of each float32), as <u2, <i2 and
    # |V2 (what np.save writes for ml_dtypes.bfloat16), and what that path refuses
    bits = (z.astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    labels = payloads.array_npy(y)
    bf16_npy = [
        payloads.array_npy(bits),
        payloads.array_npy(bits.view("<i2")),
        payloads.array_npy(bits.view("V2")),
        payloads.array_npy(np.asfortranarray(bits)),
        payloads.array_npy(z.astype(np.float32)),
        payloads.npy((5, 4), ">u2"),
        payloads.npy((1, 4), "<u2", np.array([0x3F80, 0x7FC0, 0x7F80, 0], "<u2").tobytes()),
        payloads.npy((-1, 4), "<u2"),
    ]
    bf16_npz = [
        payloads.npz({"logits.npy": payloads.array_npy(bits.view("V2")), "labels.npy": labels}),
        payloads.npz({"logits.npy": payloads.array_npy(bits), "labels.npy": labels}, 8),
        payloads.npz({"predictions.npy": payloads.array_npy(bits), "ground_truth.npy": labels}),
        payloads.npz({"logits.npy": payloads.array_npy(z.astype(np.float16)),
                      "labels.npy": labels}),
    ]
    out = {"npy": npy, "npz": npz, "json": js, "npy-bfloat16": bf16_npy,
           "npz-bfloat16": bf16_npz}
    for fmt in harness.FORMATS:
        for path in sorted((CORPUS / fmt).glob("*")):
            out[fmt].append(path.read_bytes())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--seconds", type=int, default=300, help="libFuzzer -max_total_time")
    workdir = Path(tempfile.gettempdir()) / "welltempered-fuzz"
    ap.add_argument("--workdir", type=Path, default=workdir)
    ap.add_argument("--rss-limit-mb", type=int, default=1536)
    ap.add_argument("--timeout", type=int, default=10, help="seconds per input")
    args, rest = ap.parse_known_args()
    corpus = args.workdir / "corpus"
    artifacts = args.workdir / "artifacts"
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    for fmt, bodies in seeds().items():
        selector = bytes([harness.FORMATS.index(fmt)])
        for body in bodies:
            data = selector + body
            (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)
    print(f"fuzzing for {args.seconds} s; corpus {corpus}, crashers to {artifacts}/", flush=True)
    started = time.monotonic()
    argv = [
        sys.argv[0],
        f"-max_total_time={args.seconds}",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-timeout={args.timeout}",
        "-max_len=65536",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/",
        *rest,
        str(corpus),
    ]
    atheris.Setup(argv, harness.one_input)
    try:
        atheris.Fuzz()
    finally:
        print(f"wall {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
