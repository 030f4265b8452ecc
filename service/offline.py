"""Offline CLI: fit calibrators on a ``.npz`` file and compare them on held-out rows.

::

    welltempered fit FILE.npz --method temperature|vector|...|auto|all
                     [--kind logits|probabilities] [--holdout 0.2] [--seed 0] [--json OUT]
    welltempered fit --demo [--method ...]          # scikit-learn digits, no file needed
    python -m service.offline ...                # the same, without the service

Input
-----
The archive holds one score array and one label array:

* scores: ``logits`` (kind "logits"), or ``probabilities`` / netcal's
  ``predictions`` (kind "probabilities"). When both a logits and a probability
  array are present, ``logits`` is used unless ``--kind probabilities`` asks for
  the other. ``--kind`` also overrides what the name says when the file holds only
  one score array (e.g. ``--kind logits`` for a ``predictions`` array that holds
  logits).
* labels: ``labels`` or netcal's ``ground_truth``, integers in ``[0, K)``.
* optionally ``sequence_ids``: the sequence (text) of each row, integers or strings,
  when the rows are tokens of texts.

Split
-----
:func:`calibrators.evaluation.holdout.split_indices`, the rule the service uses too: the
same ``(N, holdout, seed)`` selects the same rows in both. ``--holdout 0.5`` on an
even ``N`` is the half/half convention of the shared CIFAR data. With
``sequence_ids`` the split is by sequence (no text on both sides), and the JSON
reports add the per-token and per-sequence NLL (``sequences``).

Output
------
A table on stdout, one row for the uncalibrated scores (softmax of the logits, or
the probabilities as given) and one per method, with the
:func:`calibrators.evaluation.metrics.report`
metrics on the held-out rows, the :func:`calibrators.evaluation.checks.argmax_report`
agreement and changes, and the fit time; then, per method, its key fitted numbers
and where the changed predictions came from. ``--json OUT`` writes the same
content (see :func:`compare`) as strict JSON (non-finite numbers become ``null``).

Exit codes: 0 on success, 2 for bad input (unreadable file, missing arrays,
invalid scores or labels, bad ``--holdout``...), with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from calibrators import METHODS, create, from_params
from calibrators.evaluation.checks import RANK_BUCKETS, argmax_report
from calibrators.evaluation.holdout import DEFAULT_HOLDOUT, check_holdout, split_indices
from calibrators.evaluation.metrics import report, sequence_nll_summary
from calibrators.validation import (
    KINDS,
    CalibrationInputError,
    as_scores_and_labels,
    to_probabilities,
)
from service.jobs import evaluation
from service.jobs.fitting import auto_candidates, lowest_nll, race_candidates
from service.vocabulary import AUTO, DEFAULT_ARGMAX_POLICY

__all__ = [
    "LABEL_ARRAYS",
    "SCORE_ARRAYS",
    "OfflineError",
    "add_arguments",
    "compare",
    "demo_npz",
    "format_report",
    "load_npz",
    "main",
    "run",
    "split_indices",
]

PROG = "welltempered fit"
#: Score array names, in order of preference, with the kind each name implies.
SCORE_ARRAYS = {
    "logits": "logits", "probabilities": "probabilities", "predictions": "probabilities"
}
#: What ``file`` says in the output of ``--demo`` (its temporary file is deleted).
DEMO_NAME = "demo: scikit-learn digits, logistic regression (temporary file)"
#: Label array names, in order of preference.
LABEL_ARRAYS = ("labels", "ground_truth")
#: The optional array of the sequence (text) of each row, when rows are tokens.
SEQUENCE_ARRAY = "sequence_ids"
#: ``--method all``: every method, compared (the service has no such method: a version is
#: one calibrator, and ``auto``'s answer lists every candidate's figures).
ALL = "all"
#: ``--method auto``: what the service's ``auto`` fits for a model of the default policy.
AUTO_CANDIDATES = auto_candidates(DEFAULT_ARGMAX_POLICY)


class OfflineError(ValueError):
    """A problem with the command line or the input file, reported in one line (exit 2)."""


# ---------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fit`` arguments to ``parser`` (a parser or a subcommand parser).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        Receives ``file``, ``--method``, ``--kind``, ``--holdout``, ``--seed``,
        ``--json`` and ``--demo``; :func:`run` reads them back.
    """
    parser.add_argument(
        "file", nargs="?", metavar="FILE.npz",
        help="arrays 'logits' or 'probabilities' (or 'predictions') and 'labels' "
        "(or 'ground_truth'); optional with --demo",
    )
    parser.add_argument(
        "--method", choices=(*METHODS, AUTO, ALL), default="temperature",
        help=f"calibrator to fit; {AUTO!r}: the service's choice (among the methods that keep "
        "every predicted class, the lowest NLL of a race over folds); "
        f"{ALL!r}: every method, compared (default: temperature)",
    )
    parser.add_argument(
        "--kind", choices=KINDS, default=None,
        help="what the scores are (default: what the array name says; "
        "logits when the file has both)",
    )
    parser.add_argument(
        "--holdout", type=float, default=DEFAULT_HOLDOUT, metavar="FRACTION",
        help=f"fraction of rows held out for evaluation, in (0, 1) (default: {DEFAULT_HOLDOUT})",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seed of numpy.random.default_rng(seed).permutation(N) (default: 0)",
    )
    parser.add_argument(
        "--json", metavar="OUT", default=None, help="also write the results as JSON to OUT"
    )
    parser.add_argument(
        "--demo", action="store_true",
        help="fit on the logits of a small scikit-learn model of the bundled digits data "
        "(written to a temporary file) instead of FILE",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``welltempered fit`` with parsed arguments (see :func:`add_arguments`).

    Returns
    -------
    int
        0 on success; 2 after a one-line message on stderr when the input is bad.
    """
    try:
        if args.demo and args.file is not None:
            raise OfflineError("give FILE.npz or --demo, not both.")
        if not args.demo and args.file is None:
            raise OfflineError("FILE.npz is required (or --demo for a built-in example).")
        check_holdout(args.holdout)
        methods = {ALL: METHODS, AUTO: AUTO_CANDIDATES}.get(args.method, (args.method,))
        if args.demo:
            with tempfile.TemporaryDirectory(prefix="welltempered-demo-") as tmp:
                path = demo_npz(Path(tmp) / "digits-logreg.npz")
                result = _run_file(path, methods, args)
                result["file"] = DEMO_NAME
        else:
            result = _run_file(Path(args.file), methods, args)
        print(format_report(result))
        if args.json is not None:
            _write_json(result, Path(args.json))
    except (OfflineError, CalibrationInputError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m service.offline``: parse ``argv`` and :func:`run`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Fit calibrators on a .npz file and compare them on held-out rows."
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


def _run_file(path: Path, methods, args: argparse.Namespace) -> dict[str, Any]:
    scores, labels, kind, names, sequences = load_npz(path, kind=args.kind)
    progress = sys.stderr.isatty()
    result = compare(
        scores, labels, kind=kind, methods=methods, holdout=args.holdout, seed=args.seed,
        progress=progress, sequences=sequences,
    )
    if args.method == AUTO:
        result["chosen"], result["selection"] = auto_choice(
            scores, labels, result, kind=kind, holdout=args.holdout, seed=args.seed,
            sequences=sequences,
        )
    return {"file": str(path), "arrays": names, **result}


def auto_choice(
    scores, labels, result: dict, *, kind: str, holdout: float, seed: int, sequences=None
) -> tuple[str, dict[str, Any]]:
    """What the service's ``auto`` would choose among the methods of ``result`` (what
    :func:`compare` gave for the same rows and split): the candidates the policies of a
    model of the default argmax policy allow on the held-out rows, raced over folds
    (:func:`service.jobs.fitting.race_candidates`). Returns the choice and each raced
    candidate's part in the race (empty when there was none to run)."""
    x, y = as_scores_and_labels(scores, labels, kind)
    _, hold = split_indices(y.shape[0], holdout, seed, groups=sequences)
    first = {}
    for name, m in result["methods"].items():
        checked = evaluation.evaluate(from_params(m["params"]), x[hold], y[hold], kind=kind,
                                      argmax_policy=DEFAULT_ARGMAX_POLICY)
        if checked["allowed"]:
            first[name] = checked["row_nll"]
    if len(first) < 2:
        nll = {name: m["report"]["nll"] for name, m in result["methods"].items()}
        return lowest_nll({name: nll[name] for name in first} or nll), {}
    return race_candidates(x, y, first, kind=kind, options={}, holdout=holdout, seed=seed,
                           sequences=sequences)


def _write_json(result: dict, out: Path) -> None:
    text = json.dumps(_finite(result), indent=1, allow_nan=False)
    try:
        out.write_text(text + "\n")
    except OSError as exc:
        raise OfflineError(f"cannot write --json {out}: {exc.strerror or exc}.") from None


def _finite(value):
    """``value`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ---------------------------------------------------------------------------
# input and split


def load_npz(path, *, kind: str | None = None):
    """Read the scores and labels of a ``.npz`` archive (see the module docstring).

    Parameters
    ----------
    path : str or Path
    kind : {"logits", "probabilities"}, optional
        What the scores are; by default what the array name says.

    Returns
    -------
    scores : ndarray of shape (n_samples, n_classes)
    labels : ndarray of shape (n_samples,)
    kind : {"logits", "probabilities"}
    names : dict
        ``{"scores": name, "labels": name}``, the arrays used (and ``"sequences"``).
    sequences : ndarray of shape (n_samples,) or None
        The archive's ``sequence_ids``: the sequence (text) of each row, when its
        rows are tokens; the split is then by sequence (see :func:`compare`).

    Raises
    ------
    OfflineError
        The file cannot be read as ``.npz`` or lacks a score or label array.
        The arrays themselves are validated later (CalibrationInputError).
    """
    path = Path(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise OfflineError(f"{path} is not a .npz archive. Got a single .npy array.")
        with loaded as archive:
            files = list(archive.files)
            score_name = _pick_scores(files, kind, path)
            label_name = next((n for n in LABEL_ARRAYS if n in files), None)
            if label_name is None:
                raise OfflineError(
                    f"{path} has no label array: expected 'labels' or 'ground_truth'. "
                    f"Got arrays {files}."
                )
            scores, labels = archive[score_name], archive[label_name]
            sequences = archive[SEQUENCE_ARRAY] if SEQUENCE_ARRAY in files else None
    except OfflineError:
        raise
    except FileNotFoundError:
        raise OfflineError(f"{path}: no such file.") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise OfflineError(f"cannot read {path} as .npz: {exc}.") from None
    if kind is None:
        kind = SCORE_ARRAYS[score_name]
    names = {"scores": score_name, "labels": label_name}
    if sequences is not None:
        names["sequences"] = SEQUENCE_ARRAY
    return scores, labels, kind, names, sequences


def _pick_scores(files: list[str], kind: str | None, path: Path) -> str:
    present = [n for n in SCORE_ARRAYS if n in files]
    if not present:
        raise OfflineError(
            f"{path} has no score array: expected 'logits', 'probabilities' or 'predictions'. "
            f"Got arrays {files}."
        )
    if kind is not None:
        matching = [n for n in present if SCORE_ARRAYS[n] == kind]
        if matching:
            return matching[0]
    return present[0]


# ---------------------------------------------------------------------------
# fitting and evaluation


def compare(scores, labels, *, kind: str = "logits", methods=METHODS,
            holdout: float = DEFAULT_HOLDOUT, seed: int = 0,
            progress: bool = False, sequences=None) -> dict[str, Any]:
    """Fit each method on one part of the rows and evaluate it on the other.

    Parameters
    ----------
    scores : array-like of shape (n_samples, n_classes)
        Logits, or probabilities with ``kind="probabilities"``.
    labels : array-like of shape (n_samples,)
        Integer class labels in ``[0, n_classes)``.
    kind : {"logits", "probabilities"}
    methods : sequence of str, default all of :data:`calibrators.METHODS`
    holdout : float, default=DEFAULT_HOLDOUT
        Fraction of rows held out (see :func:`calibrators.evaluation.holdout.split_indices`).
    seed : int, default 0
    sequences : array-like of shape (n_samples,), optional
        The sequence (text) of each row when rows are tokens: the split is then by
        sequence (no text on both sides), and each report gains ``sequences``
        (:func:`calibrators.evaluation.metrics.sequence_nll_summary` of the held-out rows).
    progress : bool, default False
        Say on stderr which method is being fitted.

    Returns
    -------
    dict
        JSON-serialisable: ``n``, ``n_classes``, ``kind``, ``holdout``, ``seed``,
        ``n_fit``, ``n_holdout``, ``uncalibrated`` (the
        :func:`~calibrators.evaluation.metrics.report` of the uncalibrated held-out
        probabilities) and ``methods``, mapping each method name to ``{"report",
        "argmax", "fit_seconds", "params"}``: the report of its held-out probabilities, the
        :func:`~calibrators.evaluation.checks.argmax_report` of the held-out scores against
        them, the seconds spent in ``fit`` and :meth:`~calibrators.base.Calibrator.to_params`.

    Raises
    ------
    CalibrationInputError
        Invalid scores, labels or kind, or a method cannot be fitted on the data
        (the message then starts with the method name).
    OfflineError
        Bad ``holdout`` or an empty part.
    """
    x, y = as_scores_and_labels(scores, labels, kind)
    n, k = x.shape
    fit_idx, test_idx = split_indices(n, holdout, seed, groups=sequences)
    x_fit, y_fit = x[fit_idx], y[fit_idx]
    x_test, y_test = x[test_idx], y[test_idx]
    seq_test = None if sequences is None else np.asarray(sequences)[test_idx]

    def summary(probs) -> dict[str, Any]:
        out = report(probs, y_test)
        if seq_test is not None:
            out["sequences"] = sequence_nll_summary(probs, y_test, seq_test)
        return out

    out: dict[str, Any] = {
        "n": int(n), "n_classes": int(k), "kind": kind, "holdout": float(holdout),
        "seed": int(seed), "n_fit": int(fit_idx.shape[0]), "n_holdout": int(test_idx.shape[0]),
        "n_sequences": None if sequences is None else len(np.unique(sequences)),
        "uncalibrated": summary(to_probabilities(x_test, kind)),
        "methods": {},
    }
    for method in methods:
        if progress:
            print(f"{PROG}: fitting {method} on {len(fit_idx)} rows...", file=sys.stderr)
        cal = create(method)
        started = time.perf_counter()
        try:
            cal.fit(x_fit, y_fit, kind=kind)
        except CalibrationInputError as exc:
            raise CalibrationInputError(f"{method}: {exc}") from None
        seconds = time.perf_counter() - started
        probs = cal.predict_proba(x_test, kind=kind)
        out["methods"][method] = {
            "report": summary(probs),
            "argmax": argmax_report(x_test, probs, kind=kind),
            "fit_seconds": seconds,
            "params": cal.to_params(),
        }
    return out


# ---------------------------------------------------------------------------
# the table

#: (header, key in the report, format); lower is better except accuracy.
_COLUMNS = (
    ("acc", "accuracy", "{:.4f}"),
    ("NLL", "nll", "{:.4f}"),
    ("NLL med", "nll_median", "{:.4f}"),
    ("NLL p95", "nll_p95", "{:.4f}"),
    ("ECE", "ece", "{:.4f}"),
    ("ECE-q", "ece_quantile", "{:.4f}"),
    ("cw-ECE", "classwise_ece", "{:.4f}"),
    ("Brier", "brier", "{:.4f}"),
    ("entropy", "entropy", "{:.4f}"),
)


def _fmt(template: str, value) -> str:
    return "-" if value is None else template.format(value)


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table of a :func:`compare` result (as printed by the CLI).

    Parameters
    ----------
    result : dict
        Output of :func:`compare`, optionally with ``file`` and ``arrays`` keys.

    Returns
    -------
    str
        Several lines, no trailing newline.
    """
    header = ["", *(c[0] for c in _COLUMNS), "agree", "changed", "fit s"]
    rows = []
    base = result["uncalibrated"]
    rows.append(["uncalibrated", *(_fmt(f, base[key]) for _, key, f in _COLUMNS), "-", "-", "-"])
    for name, m in result["methods"].items():
        rep, arg = m["report"], m["argmax"]
        rows.append([
            name, *(_fmt(f, rep[key]) for _, key, f in _COLUMNS),
            f"{arg['agreement']:.4f}", str(arg["changed"]),
            f"{m['fit_seconds']:.3f}",
        ])
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells):
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    lines = []
    if "file" in result:
        names = result.get("arrays")
        used = f" (arrays {names['scores']!r}, {names['labels']!r})" if names else ""
        lines.append(f"file: {result['file']}{used}")
    lines.append(
        f"{result['n']} rows x {result['n_classes']} classes, kind={result['kind']}; "
        f"fit on {result['n_fit']}, evaluated on {result['n_holdout']} held-out rows "
        f"(holdout={result['holdout']:g}, seed={result['seed']})"
    )
    lines.append("")
    lines.append(line(header))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in rows)
    lines.append("")
    lines.append(
        "Held-out metrics, lower is better except acc; ECE-q: equal-mass bins; cw-ECE: "
        f"classwise; {base['n_bins']} bins; NLL and entropy in nats; agree/changed: "
        "predicted class unchanged (fraction) / changed (rows)."
    )
    width = max((len(name) for name in result["methods"]), default=0)
    for name, m in result["methods"].items():
        fitted, changes = _describe(m)
        lines.append(f"{name.ljust(width)}  {fitted}")
        lines.append(f"{' ' * width}  {changes}")
    if "chosen" in result:
        lines.append(f"auto: {result['chosen']} (as the service chooses: the lowest NLL over "
                     "the held-out rows of a race over folds, see docs/design.md)")
    return "\n".join(lines)


def _figures(value) -> str:
    """A float, a list of floats or None, as the summary prints them."""
    if value is None:
        return "none"
    if isinstance(value, list):
        return "(" + ", ".join(f"{v:.4g}" for v in value) + ")"
    return f"{value:.6g}"


def _describe(m: dict[str, Any]) -> tuple[str, str]:
    """Two lines about one method: its fitted numbers, and the predictions it changed."""
    params, arg = m["params"], m["argmax"]
    info = params.get("fit_info") or {}
    if params["method"] == "temperature":
        fitted = f"T = {1.0 / params['weight']:.6g} (beta = {params['weight']:.6g})"
        status = f"{info.get('reason', '?')} after {info.get('passes', '?')} passes"
    elif "passes" in info:  # ets, pts: Newton searches counted in passes over the data
        fitted = ", ".join(
            f"{key} = {_figures(info[key])}"
            for key in ("temperature", "weights", "temperature_range", "reg") if key in info
        )
        status = f"{info.get('reason', '?')} after {info['passes']} passes"
    elif "multipliers" in info:  # svs, sms: multipliers of the paper's penalty rule
        cv = info.get("cross_validation")
        how = f" (chosen by {cv['n_folds']}-fold CV)" if cv else ""
        fitted = ", ".join(  # None: infinite, the identity on the features
            f"{key} = {'inf' if value is None else f'{value:g}'}"
            for key, value in info["multipliers"].items()
        ) + f" x the paper's rule{how}; T = {info['temperature']:.6g}"
        done = "converged" if info.get("converged") else "not converged"
        status = f"L-BFGS {done} in {info.get('iterations', '?')} iterations"
    else:
        parts = []
        if info.get("reg_lambda") is not None:
            parts.append(f"reg_lambda = {info['reg_lambda']:g}")
        if info.get("reg_mu", 0) is not None:
            parts.append(f"reg_mu = {info.get('reg_mu', 0):g}")
        cv = info.get("cross_validation")
        how = f" (chosen by {cv['n_folds']}-fold CV)" if cv else ""
        fitted = (", ".join(parts) or "temperature scaling") + how  # no penalty: iop kept it
        done = "converged" if info.get("converged") else "not converged"
        status = f"L-BFGS {done} in {info.get('iterations', '?')} iterations"
    ranks = ", ".join(f"{key}: {arg['changed_from_rank'][key]}" for key in RANK_BUCKETS)
    return (
        f"{fitted}; {status}",
        f"predicted class changed in {arg['changed']} of {arg['n']} rows; original rank of "
        f"the new class: {ranks} (rank 1 = tied for first)",
    )


# ---------------------------------------------------------------------------
# demo data


def demo_npz(path) -> Path:
    """Write logits of a small scikit-learn model of the digits data to ``path``.

    A multinomial logistic regression (weakly regularised, ``C=1000``, so it is
    over-confident, as real networks are) is trained on a stratified half of
    scikit-learn's bundled 8x8 digits (``load_digits``, no download); its
    ``decision_function`` (logits) on the other half, 899 rows x 10 classes,
    is saved with the labels. Deterministic.

    Parameters
    ----------
    path : str or Path
        Where to write the ``.npz`` (arrays ``logits`` float32 and ``labels`` int64); its
        folder is created if missing.

    Returns
    -------
    Path
        ``path``.
    """
    import warnings

    from sklearn.datasets import load_digits
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.5, random_state=0, stratify=y
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = LogisticRegression(C=1000.0, max_iter=5000).fit(x_train, y_train)
    logits = model.decision_function(x_test).astype(np.float32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # e.g. welltempered-data/ before `make run`
    with path.open("wb") as f:  # a file object: np.savez would append ".npz" to a name
        np.savez(f, logits=logits, labels=y_test.astype(np.int64))
    return path


if __name__ == "__main__":
    raise SystemExit(main())
