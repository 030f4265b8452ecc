"""``welltempered fuse`` and ``welltempered triton``: a calibrator where the model runs.

::

    welltempered fuse MODEL.onnx (--params PARAMS.json | --url URL --model M --version V)
                      [--output NAME] [--kind logits|probabilities] -o OUT.onnx
    welltempered triton (--params PARAMS.json | --url URL --model M --version V)
                        --name NAME -o REPOSITORY [--kind ...]
                        [--ensemble NAME --user-model NAME --user-output NAME
                         --user-input NAME:TYPE:DIMS ...]

The calibrator comes from a params file (``to_params()`` JSON, or a version's JSON
as the API answers it, whose ``params`` it takes) or from a running service: the
version's params through ``GET /v1/models/{model}/calibrators/{version}``, with the
key of ``WELLTEMPERED_API_KEY`` when set. ``fuse`` writes
:func:`calibrators.fuse.fuse` of the model file; ``triton`` writes
:func:`calibrators.triton.write_entry` and, with ``--ensemble``,
:func:`calibrators.triton.write_ensemble`.

Exit codes: 0 on success, 2 for bad input (unreadable files, params, a model that
cannot be fused, an unreachable server), with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import calibrators
from calibrators.validation import KINDS, CalibrationInputError

#: The environment variable holding the API key for ``--url``.
KEY_VARIABLE = "WELLTEMPERED_API_KEY"


class ExportError(Exception):
    """Bad input to an export command: the message is printed, the exit code is 2."""


def _source_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_argument_group("the calibrator (a params file, or a version of a server)")
    source.add_argument("--params", type=Path, metavar="PARAMS.json",
                        help="to_params() JSON, or a version's JSON as the API answers it")
    source.add_argument("--url", metavar="URL", help="the service, e.g. http://127.0.0.1:8000 "
                        f"(key: ${KEY_VARIABLE} when set)")
    source.add_argument("--model", metavar="NAME", help="the model's name, with --url")
    source.add_argument("--version", type=int, metavar="N", help="the version, with --url")
    p.add_argument("--kind", choices=KINDS, default=None,
                   help="what the scores are (default: the kind the calibrator was fitted on)")


def add_fuse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_file", type=Path, metavar="MODEL.onnx", help="the classifier")
    _source_arguments(p)
    p.add_argument("--output", default=None, metavar="NAME",
                   help="the classifier's output holding the scores (default: detected, the "
                        "one float output of shape [N, K])")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="OUT.onnx")


def add_triton_arguments(p: argparse.ArgumentParser) -> None:
    _source_arguments(p)
    p.add_argument("--name", required=True, help="the calibrator's model name in Triton")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="REPOSITORY",
                   help="the model repository folder (created if missing)")
    chain = p.add_argument_group("an ensemble: the user's model, then the calibrator")
    chain.add_argument("--ensemble", metavar="NAME", help="the ensemble's model name")
    chain.add_argument("--user-model", metavar="NAME", help="the user's model in the repository")
    chain.add_argument("--user-output", metavar="NAME", help="its output holding the scores")
    chain.add_argument("--user-input", action="append", default=[], metavar="NAME:TYPE:DIMS",
                       help="one of its inputs, e.g. pixels:FP32:-1,64 (repeat for each)")


def params_from_file(path: Path) -> dict[str, Any]:
    """A params dict from a file: ``to_params()`` JSON or a version's API JSON."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read params from {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("params"), dict):
        return data["params"]
    return data


def params_from_server(url: str, model: str, version: int) -> dict[str, Any]:
    """A version's params from a running service (its kind filled in when they lack one)."""
    path = f"/v1/models/{urllib.parse.quote(model, safe='')}/calibrators/{version}"
    request = urllib.request.Request(url.rstrip("/") + path)
    key = os.environ.get(KEY_VARIABLE)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            data = json.load(answer)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:500]
        raise ExportError(f"GET {path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ExportError(f"GET {url.rstrip('/')}{path}: {exc}") from None
    if not isinstance(data.get("params"), dict):
        raise ExportError(
            f"version {version} of {model!r} has no params (status {data.get('status')!r}): "
            "only a fitted version can be exported"
        )
    return {**data["params"], "kind": data["params"].get("kind") or data.get("kind")}


def load_calibrator(args: argparse.Namespace) -> calibrators.Calibrator:
    """The calibrator of ``--params`` or of ``--url --model --version``."""
    remote = (args.url, args.model, args.version)
    if (args.params is None) == all(v is None for v in remote):
        raise ExportError("give the calibrator as --params FILE or --url URL --model NAME "
                          "--version N (one of the two)")
    if args.params is not None:
        params = params_from_file(args.params)
    elif any(v is None for v in remote):
        raise ExportError("--url needs --model and --version")
    else:
        params = params_from_server(args.url, args.model, args.version)
    return calibrators.from_params(params)


def _run(command: str, work) -> int:
    try:
        message = work()
    except (ExportError, CalibrationInputError) as exc:
        print(f"welltempered {command}: {exc}", file=sys.stderr)
        return 2
    print(message)
    return 0


def fuse(args: argparse.Namespace) -> int:
    from calibrators.fuse import fuse as fuse_models

    def work() -> str:
        cal = load_calibrator(args)
        try:
            model = args.model_file.read_bytes()
        except OSError as exc:
            raise ExportError(f"cannot read {args.model_file}: {exc}") from None
        fused = fuse_models(model, cal, output=args.output, kind=args.kind)
        args.out.write_bytes(fused.SerializeToString())
        props = {p.key: p.value for p in fused.metadata_props}
        return (f"wrote {args.out}: {args.model_file.name} output "
                f"{props['welltempered.output']!r} ({props['welltempered.kind']}) then "
                f"{cal.method} scaling; inputs "
                f"{', '.join(i.name for i in fused.graph.input)}, outputs "
                f"{', '.join(o.name for o in fused.graph.output)}")

    return _run("fuse", work)


def triton(args: argparse.Namespace) -> int:
    from calibrators import triton as repository

    def work() -> str:
        chain = (args.ensemble, args.user_model, args.user_output)
        if any(v is not None for v in chain) or args.user_input:
            if any(v is None for v in chain) or not args.user_input:
                raise ExportError("an ensemble needs --ensemble, --user-model, --user-output "
                                  "and one --user-input per input of the user's model")
        cal = load_calibrator(args)
        kind = args.kind or cal.kind_ or KINDS[0]
        written = [repository.write_entry(cal, args.out, args.name, kind=kind)]
        if args.ensemble is not None:
            inputs = [repository.Tensor.parse(text) for text in args.user_input]
            written.append(repository.write_ensemble(
                args.out, args.ensemble, model=args.user_model, model_inputs=inputs,
                model_output=args.user_output, calibrator=args.name,
                n_classes=cal.n_classes_, kind=kind,
            ))
        return f"wrote {', '.join(str(p) for p in written)} (Triton model repository {args.out})"

    return _run("triton", work)
