"""Reference outputs of the four calibrators, frozen before the calibrator-base refactor.

Run ONCE, before a refactor of ``calibrators/`` that must not change any number::

    .venv/bin/python -m tests.calibrators.make_reference_outputs

It writes ``tests/calibrators/data/reference_outputs.npz`` (refusing to overwrite it
without ``--force``): the inputs, and for every case of :data:`CASES` the fitted
``weight`` / ``bias``, the ``to_params()`` JSON without its timing, the
``predict_proba`` outputs on held-out rows (float64 and float32 input) and the four
ONNX Runtime outputs of ``to_onnx()``. ``test_reference_outputs.py`` recomputes all
of it with the current code (:func:`compute`) and asserts bit-identical equality.

Do not regenerate the file after a refactor: that would make the test compare the new
code with itself. Regenerate it only for a change that is *meant* to change numbers,
and say so in the commit; ``--cases NAME ...`` recomputes only those cases and keeps
every other key as it is (bit for bit), recording the machine it ran on as
``<case>/dispatch`` (:func:`dispatch`; a case without it was written on
:data:`FROZEN_DISPATCH`).

History: params format 2 (issue 21) changed vector and matrix scaling's features to
the centred log-ratio; their six cases were recomputed with ``--cases``. The other
cases' numbers are the original ones; their ``params_json`` gained format 2's keys
(``"format"`` 2 and ``"kind"``, the case's kind) written into the frozen JSON, not
recomputed. The format 1 params and ``predict_proba`` of the six vector and matrix
cases are kept as ``format-1/<case>/...``: params of format 1 still load and predict
what they did.
Issue 21 also recomputed the three temperature cases (``--cases``, on an AVX2 machine):
the fit now ends at float64's root (relative gradient about 2e-17, where it stopped at
8.7e-14 under tol = 1e-10), which moved beta by 2.2e-13 (7.9e-12 for the entropy
target), and its fit_info names the float32 start and the extrapolated last step.
Issue 21's rescale of the logits by a power of two (temperature scaling at any scale)
recomputed the three temperature cases again (``--cases``): beta moved by at most
1.9e-16 (relative), and fit_info gained ``rescale_exponent``.
Issue 21's penalty searches (the penalty pulls towards temperature scaling) recomputed
the nine vector, matrix and dirichlet cases (``--cases``); the format 1 keys, the
inputs and every other case are kept as they were.
Issue 21's row sums by einsum in temperature scaling's passes (branch svsfast)
recomputed the three temperature cases (``--cases``): beta moved by at most 1.9e-16
(relative; not at all for temperature-logits), the probabilities by at most 7e-15.

The file was generated on the project's pinned environment (numpy, scipy, OpenBLAS and
ONNX Runtime of ``.venv``); another BLAS or CPU may round the ODIR fits differently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tests.oracles import softmax

PATH = Path(__file__).resolve().parent / "data" / "reference_outputs.npz"

#: The machine the file was first written on: numpy's SIMD dispatch and OpenBLAS's
#: kernels (see :func:`dispatch`).
FROZEN_DISPATCH = "AVX512_SKX/SkylakeX"

#: Rows fitted on; the rest of the N = 300 rows are held out (N != K, K = 5 >= 3).
N_ROWS, N_CLASSES, N_FIT = 300, 5, 240

#: (case name, method, kind, options). Explicit penalties exercise one solve; the
#: default options exercise the cross-validated search over the default grid.
CASES: tuple[tuple[str, str, str, dict], ...] = (
    ("temperature-logits", "temperature", "logits", {}),
    ("temperature-probabilities", "temperature", "probabilities", {}),
    ("temperature-entropy", "temperature", "logits", {"target_entropy": 0.8}),
    ("vector-logits", "vector", "logits", {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("vector-probabilities", "vector", "probabilities", {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("vector-cv", "vector", "logits", {}),
    ("matrix-logits", "matrix", "logits", {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("matrix-probabilities", "matrix", "probabilities", {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("matrix-cv", "matrix", "logits", {"grid": [1.0, 100.0, 10.0, 100.0], "seed": 3}),
    ("dirichlet-logits", "dirichlet", "logits", {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("dirichlet-probabilities", "dirichlet", "probabilities",
     {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("dirichlet-cv", "dirichlet", "logits", {}),
)

#: Keys of ``fit_info`` that depend on the clock, not on the numbers.
TIMING_KEYS = ("seconds",)


def dataset() -> dict[str, np.ndarray]:
    """The fixed inputs: logits, labels and their probabilities (one held-out zero)."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, N_CLASSES, N_ROWS)
    logits = rng.normal(size=(N_ROWS, N_CLASSES)) * 2.0
    logits[np.arange(N_ROWS), labels] += 1.5
    probabilities = softmax(logits)
    probabilities[N_FIT + 1, (labels[N_FIT + 1] + 1) % N_CLASSES] = 0.0  # a log of -inf
    probabilities[N_FIT + 1] /= probabilities[N_FIT + 1].sum()
    return {"logits": logits, "labels": labels, "probabilities": probabilities}


def compute(name: str, method: str, kind: str, options: dict,
            data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Everything recorded for one case, keyed ``<name>/<what>``, with the current code."""
    import calibrators
    from tests.calibrators.helpers import onnx_outputs

    scores = data[kind]
    fit_scores, held = scores[:N_FIT], scores[N_FIT:]
    cal = calibrators.create(method, **options).fit(fit_scores, data["labels"][:N_FIT], kind=kind)
    params = cal.to_params()
    for key in TIMING_KEYS:
        (params.get("fit_info") or {}).pop(key, None)
    if kind == "probabilities":
        with np.errstate(divide="ignore"):
            fed = np.log(held.astype(np.float32))
    else:
        fed = held.astype(np.float32)
    probs, confidence, label, entropy = onnx_outputs(cal.to_onnx(), fed).values()
    out = {
        "weight": np.asarray(params["weight"], dtype=np.float64),
        "bias": np.asarray([] if params["bias"] is None else params["bias"], dtype=np.float64),
        "params_json": np.array(json.dumps(params, sort_keys=True)),
        "predict_proba": cal.predict_proba(held, kind=kind),
        "predict_proba_float32": cal.predict_proba(held.astype(np.float32), kind=kind),
        "onnx_probabilities": probs,
        "onnx_confidence": confidence,
        "onnx_label": label,
        "onnx_entropy": entropy,
    }
    return {f"{name}/{key}": value for key, value in out.items()}


def dispatch() -> str:
    """This machine's numpy SIMD dispatch (the widest of AVX512_SKX, AVX2) and
    OpenBLAS kernels, e.g. ``"AVX512_SKX/SkylakeX"``: the exp, log and dot products
    the frozen numbers were rounded by."""
    import scipy.linalg  # noqa: F401  (its OpenBLAS too, if it has its own)
    from numpy._core._multiarray_umath import __cpu_features__
    from threadpoolctl import threadpool_info

    simd = next((f for f in ("AVX512_SKX", "AVX2") if __cpu_features__.get(f)), "other")
    blas = sorted({str(i.get("architecture")) for i in threadpool_info()
                   if i["internal_api"] == "openblas"})
    return f"{simd}/{'+'.join(blas) or 'none'}"


def compute_all() -> dict[str, np.ndarray]:
    """The inputs (``input/...``) and every case's outputs, as saved in :data:`PATH`."""
    data = dataset()
    out = {f"input/{key}": value for key, value in data.items()}
    for case in CASES:
        out.update(compute(*case, data))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.add_argument("--cases", nargs="+", metavar="NAME",
                        help="recompute only these cases of the existing file")
    args = parser.parse_args(argv)
    if args.cases:
        unknown = set(args.cases) - {c[0] for c in CASES}
        if unknown or not PATH.exists():
            print(f"unknown cases {sorted(unknown)} or no {PATH}", file=sys.stderr)
            return 1
        with np.load(PATH, allow_pickle=False) as f:
            out = {key: f[key] for key in f.files}
        inputs = {key: out[f"input/{key}"] for key in dataset()}
        for case in CASES:
            if case[0] in args.cases:
                out.update(compute(*case, inputs))
                out[f"{case[0]}/dispatch"] = np.array(dispatch())
        np.savez_compressed(PATH, **out)
        print(f"recomputed {', '.join(args.cases)} in {PATH}")
        return 0
    if PATH.exists() and not args.force:
        print(f"{PATH} exists; it is frozen (see the module docstring). --force to overwrite.",
              file=sys.stderr)
        return 1
    PATH.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(PATH, **compute_all())
    print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
