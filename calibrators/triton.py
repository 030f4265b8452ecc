"""Triton Inference Server model repository entries for a calibrator.

:func:`write_entry` writes a calibrator as a model of a Triton model repository::

    <repository>/<name>/config.pbtxt        platform "onnxruntime_onnx", max_batch_size 0
    <repository>/<name>/1/model.onnx        the calibrator's ONNX graph

with the graph's interface (:mod:`calibrators.onnx_export`): input ``logits`` (or,
for a model whose output is probabilities, :data:`calibrators.fuse.PROBABILITIES_INPUT`)
TYPE_FP32 of dims ``[-1, K]``, outputs ``probabilities`` ``[-1, K]``, ``confidence``,
``label`` (TYPE_INT64) and ``entropy``, each ``[-1]``: ``-1`` is the number of rows,
any batch the graph itself takes (``max_batch_size: 0``, so Triton passes the shape as
sent rather than adding a batch dimension of its own).

:func:`write_ensemble` adds the ``ensemble`` model that chains a user's model,
already in the repository under its own name, to that entry: its inputs are the
user's model's (named with their types and dims, as the model's own config has them),
its outputs the calibrator's four, and its steps the user's model (whose named output
becomes the ensemble's tensor :data:`SCORES_TENSOR`) then the calibrator.

Configs are dicts with the field names of Triton's ``ModelConfig`` protobuf
(``model_config.proto``), rendered as its text format by :func:`to_pbtxt`; the tests
parse every one with Triton's own ``model_config_pb2``. :func:`model_config` is also
the answer of the service's ``/v2/models/{name}/config``, as JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calibrators.fuse import PROBABILITIES_INPUT, calibrator_model
from calibrators.onnx_export import INPUT_NAME, OUTPUT_NAMES
from calibrators.validation import KINDS, CalibrationInputError, check_kind

if TYPE_CHECKING:
    from calibrators.base import Calibrator

#: Triton's backend platform of an ONNX model.
PLATFORM = "onnxruntime_onnx"
#: The ensemble's tensor between the user's model and the calibrator.
SCORES_TENSOR = "model_scores"
#: Triton's data types of the calibrator's outputs.
OUTPUT_TYPES = {"probabilities": "TYPE_FP32", "confidence": "TYPE_FP32",
                "label": "TYPE_INT64", "entropy": "TYPE_FP32"}
#: Triton's data types (``DataType`` of model_config.proto), without their ``TYPE_``.
DATA_TYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
              "INT64", "FP16", "FP32", "FP64", "STRING", "BF16")
#: Fields whose values are protobuf enum names (bare in the text format).
_ENUMS = {"data_type"}
#: Fields that are protobuf maps of strings (``key``/``value`` entries in the text format).
_MAPS = {"input_map", "output_map"}
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True)
class Tensor:
    """One input of a user's model: name, Triton data type (``FP32``), dims (``-1`` free).

    Examples
    --------
    >>> Tensor.parse("pixels:FP32:-1,784")
    Tensor(name='pixels', data_type='FP32', dims=(-1, 784))
    """

    name: str
    data_type: str
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.data_type not in DATA_TYPES:
            raise CalibrationInputError(
                f"A Triton data type is one of {', '.join(DATA_TYPES)}. Got "
                f"{self.data_type!r} for {self.name!r}."
            )
        if not self.dims or any(d < -1 or d == 0 for d in self.dims):
            raise CalibrationInputError(
                f"dims are positive sizes or -1 (any). Got {list(self.dims)} for {self.name!r}."
            )

    @classmethod
    def parse(cls, text: str) -> Tensor:
        """``NAME:TYPE:D1,D2,...`` (the CLI's form)."""
        parts = text.rsplit(":", 2)
        try:
            name, data_type, dims = parts
            sizes = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise CalibrationInputError(
                f"A model input is NAME:TYPE:DIMS, e.g. pixels:FP32:-1,784. Got {text!r}."
            ) from None
        return cls(name, data_type.upper().removeprefix("TYPE_"), sizes)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": f"TYPE_{self.data_type}", "dims": list(self.dims)}


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CalibrationInputError(
            f"{what} must be letters, digits, '_', '.' or '-' (a Triton model name and "
            f"folder). Got {name!r}."
        )
    return name


def _input_name(kind: str) -> str:
    return INPUT_NAME if kind == KINDS[0] else PROBABILITIES_INPUT


def _outputs(n_classes: int) -> list[dict[str, Any]]:
    return [{"name": name, "data_type": OUTPUT_TYPES[name],
             "dims": [-1, n_classes] if name == "probabilities" else [-1]}
            for name in OUTPUT_NAMES]


def model_config(name: str, n_classes: int, kind: str = "logits") -> dict[str, Any]:
    """The Triton model configuration of a calibrator of K classes served as ``name``.

    Parameters
    ----------
    name : str
    n_classes : int
    kind : {"logits", "probabilities"}
        The scores its input takes (its input's name: ``logits`` or
        :data:`calibrators.fuse.PROBABILITIES_INPUT`).

    Returns
    -------
    dict
        ``ModelConfig`` fields: ``name``, ``platform``, ``max_batch_size`` (0),
        ``input``, ``output``.

    Examples
    --------
    >>> model_config("digits", 10)["input"]
    [{'name': 'logits', 'data_type': 'TYPE_FP32', 'dims': [-1, 10]}]
    """
    check_kind(kind)
    return {
        "name": name,
        "platform": PLATFORM,
        "max_batch_size": 0,
        "input": [{"name": _input_name(kind), "data_type": "TYPE_FP32",
                   "dims": [-1, n_classes]}],
        "output": _outputs(n_classes),
    }


def ensemble_config(
    name: str, *, model: str, model_inputs: Sequence[Tensor], model_output: str,
    calibrator: str, n_classes: int, kind: str = "logits",
) -> dict[str, Any]:
    """The configuration of an ensemble: the user's ``model``, then the ``calibrator``.

    Parameters
    ----------
    name : str
        The ensemble's model name.
    model : str
        The user's model, as named in the repository.
    model_inputs : sequence of Tensor
        Its inputs, which become the ensemble's.
    model_output : str
        Its output holding the scores (``kind``) of K classes.
    calibrator : str
        The calibrator's model name (:func:`write_entry`).
    n_classes : int
    kind : {"logits", "probabilities"}

    Raises
    ------
    CalibrationInputError
        No inputs, or an input named like the ensemble's other tensors.
    """
    check_kind(kind)
    inputs = list(model_inputs)
    taken = {SCORES_TENSOR, *OUTPUT_NAMES}
    clashes = [t.name for t in inputs if t.name in taken]
    if not inputs or clashes:
        raise CalibrationInputError(
            f"The model's inputs (one or more) must not be named {', '.join(sorted(taken))}, "
            f"the ensemble's other tensors. Got {[t.name for t in inputs]}."
        )
    return {
        "name": name,
        "platform": "ensemble",
        "max_batch_size": 0,
        "input": [t.config() for t in inputs],
        "output": _outputs(n_classes),
        "ensemble_scheduling": {"step": [
            {"model_name": model, "model_version": -1,
             "input_map": {t.name: t.name for t in inputs},
             "output_map": {model_output: SCORES_TENSOR}},
            {"model_name": calibrator, "model_version": -1,
             "input_map": {_input_name(kind): SCORES_TENSOR},
             "output_map": {o: o for o in OUTPUT_NAMES}},
        ]},
    }


def _scalar(field: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if field in _ENUMS:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lines(config: Mapping[str, Any], indent: str) -> Iterable[str]:
    inner = indent + "  "
    for field, value in config.items():
        if field in _MAPS:
            for key, item in value.items():
                yield (f"{indent}{field} {{ key: {_scalar(field, key)} "
                       f"value: {_scalar(field, item)} }}")
        elif isinstance(value, Mapping):
            yield f"{indent}{field} {{"
            yield from _lines(value, inner)
            yield f"{indent}}}"
        elif isinstance(value, list) and value and isinstance(value[0], Mapping):
            yield f"{indent}{field} ["
            for i, item in enumerate(value):
                yield f"{inner}{{"
                yield from _lines(item, inner + "  ")
                yield f"{inner}}}{',' if i < len(value) - 1 else ''}"
            yield f"{indent}]"
        elif isinstance(value, list):
            yield f"{indent}{field}: [ {', '.join(_scalar(field, v) for v in value)} ]"
        else:
            yield f"{indent}{field}: {_scalar(field, value)}"


def to_pbtxt(config: Mapping[str, Any]) -> str:
    """A configuration of this module in the protobuf text format of ``config.pbtxt``."""
    return "\n".join(_lines(config, "")) + "\n"


def write_entry(
    calibrator: Calibrator, repository: str | Path, name: str, *, kind: str | None = None,
    version: int = 1,
) -> Path:
    """Write ``calibrator`` as the model ``name`` of a Triton model repository.

    Parameters
    ----------
    calibrator : Calibrator
        Fitted.
    repository : str or Path
        The repository folder (created if missing).
    name : str
        The model's name and folder.
    kind : {"logits", "probabilities"}, optional
        What its input takes; default the kind the calibrator was fitted on.
    version : int, default 1
        The version folder.

    Returns
    -------
    Path
        ``<repository>/<name>``, holding ``config.pbtxt`` and ``<version>/model.onnx``.
    """
    _check_name("name", name)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CalibrationInputError(f"version must be an integer >= 1. Got {version!r}.")
    kind = (getattr(calibrator, "kind_", None) or KINDS[0]) if kind is None else kind
    onnx_model = calibrator_model(calibrator, kind)
    folder = Path(repository) / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / str(version) / "model.onnx").write_bytes(onnx_model.SerializeToString())
    config = model_config(name, calibrator.n_classes_, kind)
    (folder / "config.pbtxt").write_text(to_pbtxt(config))
    return folder


def write_ensemble(
    repository: str | Path, name: str, *, model: str, model_inputs: Sequence[Tensor],
    model_output: str, calibrator: str, n_classes: int, kind: str = "logits",
) -> Path:
    """Write :func:`ensemble_config` as ``<repository>/<name>/config.pbtxt`` (with the
    empty version folder ``1`` Triton expects of an ensemble); the folder."""
    for what, value in (("name", name), ("model", model), ("calibrator", calibrator)):
        _check_name(what, value)
    config = ensemble_config(name, model=model, model_inputs=model_inputs,
                             model_output=model_output, calibrator=calibrator,
                             n_classes=n_classes, kind=kind)
    folder = Path(repository) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(to_pbtxt(config))
    return folder
