"""``welltempered compare A.npz B.npz``: is model B model A at another temperature?

Each file holds one model's scores on the same positions, in the same order (arrays
as ``welltempered fit`` reads them: ``logits``, or ``probabilities`` /
``predictions``; labels are not needed). The answer is
:func:`calibrators.evaluation.pair.temperature_explains`: the inverse temperature that
brings A closest to B in KL, how much of ``KL(B || A)`` it explains (and how much
beyond flattening A alone), top-1 agreement and the discordance within B's top-k.
A table on stdout, the JSON with ``--json OUT``. Exit status 0, or 2 with a one-line
message on stderr for a bad file or arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from calibrators import CalibrationInputError
from calibrators.evaluation.pair import temperature_explains
from calibrators.validation import KINDS

PROG = "welltempered compare"
#: Score arrays, in order of preference, and their kind.
SCORE_ARRAYS = {"logits": "logits", "probabilities": "probabilities",
                "predictions": "probabilities"}


class PairError(ValueError):
    """A bad file or argument, reported in one line (exit 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` arguments to ``parser``; :func:`run` reads them back."""
    parser.add_argument("a", metavar="A.npz", help="model A's scores (the one tempered)")
    parser.add_argument("b", metavar="B.npz", help="model B's scores on the same positions")
    parser.add_argument("--kind-a", choices=KINDS, default=None,
                        help="what A's scores are (default: what the array name says)")
    parser.add_argument("--kind-b", choices=KINDS, default=None,
                        help="what B's scores are (default: what the array name says)")
    parser.add_argument("--top-k", type=int, default=10, metavar="K",
                        help="B's top classes the rank agreement looks at (default: 10)")
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="also write the result as JSON to OUT")


def load_scores(path: Path, kind: str | None) -> tuple[np.ndarray, str]:
    """The first score array of ``path`` (see :data:`SCORE_ARRAYS`) and its kind."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise PairError(f"cannot read {path} as .npz: it is a single .npy array.")
        with loaded as archive:
            name = next((n for n in SCORE_ARRAYS if n in archive.files), None)
            if name is None:
                raise PairError(
                    f"{path} has no score array: expected one of {', '.join(SCORE_ARRAYS)}. "
                    f"Got arrays {archive.files}."
                )
            return archive[name], kind or SCORE_ARRAYS[name]
    except PairError:
        raise
    except FileNotFoundError:
        raise PairError(f"{path}: no such file.") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise PairError(f"cannot read {path} as .npz: {exc}.") from None


def _figure(value) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.4f}"


def format_result(result: dict[str, Any]) -> str:
    """The table of :func:`calibrators.evaluation.pair.temperature_explains`'s result."""
    lines = [
        f"{result['n']:,} positions; A tempered by beta = {_figure(result['beta'])} "
        f"(temperature {_figure(1 / result['beta'] if result['beta'] else math.inf)})",
        f"{'':<28}{'mean':>10}{'median':>10}{'p95':>10}",
    ]
    for label, key in (("KL(B || A)", "kl_before"), ("KL(B || A tempered)", "kl_after"),
                       (f"discordance in B's top-{result['top_k']}", "discordance")):
        row = result[key] or {}
        lines.append(f"{label:<28}" + "".join(
            f"{_figure(row.get(s)):>10}" for s in ("mean", "median", "p95")))
    lines += [
        f"temperature explains {_figure(result['explained'])} of KL(B || A), "
        f"{_figure(result['explained_beyond_flat'])} beyond flattening A alone",
        f"top-1 agreement {_figure(result['top1_agreement'])}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``welltempered compare``; 0, or 2 after a one-line message on stderr."""
    try:
        a, kind_a = load_scores(Path(args.a), args.kind_a)
        b, kind_b = load_scores(Path(args.b), args.kind_b)
        result = temperature_explains(a, b, kind_a=kind_a, kind_b=kind_b, top_k=args.top_k)
        print(format_result(result))
        if args.json is not None:
            beta = "inf" if math.isinf(result["beta"]) else result["beta"]  # JSON has no inf
            text = json.dumps({**result, "beta": beta}, indent=1, allow_nan=False)
            try:
                Path(args.json).write_text(text + "\n")
            except OSError as exc:
                raise PairError(f"cannot write --json {args.json}: {exc.strerror}.") from None
    except (PairError, CalibrationInputError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0
