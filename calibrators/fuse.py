"""One ONNX model: a classifier's graph, then a calibrator's.

:func:`fuse` takes a classifier's ONNX model and a fitted calibrator and returns
one model whose inputs are the classifier's and whose outputs are the
calibrator's four (``probabilities``, ``confidence``, ``label``, ``entropy``: see
:mod:`calibrators.onnx_export`), so a team that runs its model in ONNX Runtime
runs the calibration in the same call, without a network hop.

* The classifier's output that feeds the calibrator is named, or detected: the one
  floating-point output of shape (N, K) whose K (a fixed dimension) is the
  calibrator's. Logits go in as they are; probabilities as their log, computed in
  float64 (a zero becomes ``-inf``, which the calibrator's graph reads as
  :data:`calibrators.validation.LOG_FLOOR`, as the numpy path does). The score
  tensor is cast to float64 first, so a float32, float64 or float16 output all feed
  the calibrator's float64 arithmetic.
* Names cannot clash: every tensor and node of the classifier except its inputs gets
  the prefix :data:`MODEL_PREFIX`, every one of the calibrator except its four
  outputs :data:`CALIBRATOR_PREFIX`.
* Versions: the fused model keeps the classifier's operator sets (every domain) and
  converts the calibrator's graph (opset :data:`calibrators.onnx_export.OPSET`) to the
  classifier's default-domain opset with ``onnx.version_converter``. Supported:
  opsets :data:`MIN_OPSET` (the first the converter reaches from 17: its ``If``
  adapter stops there) to the newest the installed ``onnx`` defines; the IR version
  is the larger of the two models' (a newer IR holds an older graph unchanged), at
  most the installed ``onnx``'s. Anything else is refused with :class:`FuseError`,
  which says what to do.
* Tensors stored outside the file (ONNX external data) are refused: the fused model
  is one file.

:func:`calibrator_model` is the calibrator's own graph with a probabilities input
(for serving it next to a model that outputs probabilities: Triton's ensemble, see
:mod:`calibrators.triton`). Nothing here imports ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper
from onnx.compose import add_prefix_graph

from calibrators.onnx_export import INPUT_NAME, IR_VERSION, OPSET, OUTPUT_NAMES
from calibrators.validation import KINDS, CalibrationInputError, check_kind

if TYPE_CHECKING:
    from calibrators.base import Calibrator

#: Prefix of the classifier's tensor and node names in a fused model (inputs excepted).
MODEL_PREFIX = "model/"
#: Prefix of the calibrator's tensor and node names in a fused model (outputs excepted).
CALIBRATOR_PREFIX = "welltempered/"
#: The lowest default-domain opset a fused model can have (module docstring).
MIN_OPSET = 16
#: The input of :func:`calibrator_model` for probabilities (``probabilities`` is an output).
PROBABILITIES_INPUT = "input_probabilities"
#: Element types a score output may have (cast to float64 before the calibrator).
SCORE_TYPES = {
    TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64", TensorProto.FLOAT16: "float16",
}


class FuseError(CalibrationInputError):
    """A classifier model that cannot be fused with a calibrator; the message says why."""


def load_model(model: bytes | onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as a checked ``ModelProto`` (a copy when given one).

    Raises
    ------
    FuseError
        Not an ONNX model, an invalid one, or one with external data.
    """
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    elif isinstance(model, bytes | bytearray | memoryview):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except DecodeError as exc:
            raise FuseError(
                f"The model must be an ONNX model (a serialised ModelProto). Got {len(model)} "
                f"bytes that do not parse: {exc}."
            ) from None
    else:
        raise FuseError(
            f"The model must be ONNX bytes or an onnx.ModelProto. Got {type(model).__name__}."
        )
    if not proto.graph.node and not proto.graph.output:
        raise FuseError("The model must be an ONNX model with a graph. Got an empty model.")
    if proto.ir_version > onnx.IR_VERSION:
        raise FuseError(
            f"The model's IR version must be at most {onnx.IR_VERSION} (the installed onnx "
            f"{onnx.__version__}). Got {proto.ir_version}."
        )
    if any(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer):
        raise FuseError(
            "The model must hold its tensors in the file (onnx.save_model(model, path, "
            "save_as_external_data=False)). Got initializers stored as external data."
        )
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        raise FuseError(f"The model is not a valid ONNX model: {exc}".rstrip() + ".") from None
    return proto


def _shape(value: onnx.ValueInfoProto) -> list[int | str | None]:
    if not value.type.tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value.type.tensor_type.shape.dim]


def _describe(value: onnx.ValueInfoProto) -> str:
    elem = value.type.tensor_type.elem_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem else "untyped"
    dims = ", ".join("?" if d is None else str(d) for d in _shape(value))
    return f"{value.name!r} ({dtype}, [{dims}])"


def score_outputs(model: onnx.ModelProto, n_classes: int) -> list[str]:
    """The outputs that can hold K scores per row: floating point, shape (N, K), K fixed."""
    return [
        o.name for o in model.graph.output
        if o.type.tensor_type.elem_type in SCORE_TYPES
        and len(shape := _shape(o)) == 2 and shape[1] == n_classes
    ]


def detect_output(model: onnx.ModelProto, n_classes: int) -> str:
    """The one output that can feed a calibrator of K classes (:func:`score_outputs`).

    Raises
    ------
    FuseError
        None or several: the message lists every output, to name one.
    """
    found = score_outputs(model, n_classes)
    if len(found) == 1:
        return found[0]
    outputs = ", ".join(_describe(o) for o in model.graph.output)
    which = "none is" if not found else f"{len(found)} are"
    raise FuseError(
        f"Name the model's output that holds the scores (output=...): {which} a float "
        f"output of shape [N, {n_classes}], the calibrator's classes. Got outputs {outputs}."
    )


def _check_output(model: onnx.ModelProto, name: str, n_classes: int) -> None:
    outputs = {o.name: o for o in model.graph.output}
    if name not in outputs:
        raise FuseError(
            f"output must be one of the model's outputs: {', '.join(map(repr, outputs))}. "
            f"Got {name!r}."
        )
    value = outputs[name]
    shape = _shape(value)
    elem = value.type.tensor_type.elem_type
    if elem not in SCORE_TYPES or (shape and (len(shape) != 2 or shape[1] not in (n_classes,
                                                                                  None))):
        raise FuseError(
            f"output {name!r} must be float32, float64 or float16 of shape [N, {n_classes}] "
            f"(the calibrator's classes). Got {_describe(value)}."
        )


def _default_opset(model: onnx.ModelProto) -> int:
    versions = {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")}
    if len(versions) > 1:
        raise FuseError(
            f"The model must import one version of the default ONNX domain. Got "
            f"{sorted(versions)}."
        )
    opset = versions.pop() if versions else OPSET
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise FuseError(
            f"The model's default-domain opset must be {MIN_OPSET} to {newest} (the installed "
            f"onnx {onnx.__version__}); convert it first with "
            f"onnx.version_converter.convert_version(model, {max(MIN_OPSET, OPSET)}). "
            f"Got {opset}."
        )
    return opset


def _at_opset(calibrator_onnx: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    if opset == OPSET:
        return calibrator_onnx
    from onnx import version_converter

    return version_converter.convert_version(calibrator_onnx, opset)


def _score_bridge(source: str, kind: str, prefix: str) -> tuple[list[onnx.NodeProto], str]:
    """Nodes from a score tensor to float64 logits (the log of probabilities), named as
    the input of the calibrator's graph prefixed with ``prefix``; that name."""
    logits = prefix + INPUT_NAME
    if kind == "logits":
        return [helper.make_node("Cast", [source], [logits], to=TensorProto.DOUBLE,
                                 name=prefix + "cast_scores")], logits
    scores = prefix + "probabilities64"
    return [
        helper.make_node("Cast", [source], [scores], to=TensorProto.DOUBLE,
                         name=prefix + "cast_scores"),
        helper.make_node("Log", [scores], [logits], name=prefix + "log_probabilities"),
    ], logits


def _prefix(graph: onnx.GraphProto, prefix: str, **keep) -> None:
    """``onnx.compose.add_prefix_graph`` in place, with the initializers named in the
    map from the start: it renames them only after the subgraphs (an ``If``'s
    branches), which would still read their old names."""
    names = {t.name: prefix + t.name for t in graph.initializer}
    add_prefix_graph(graph, prefix, inplace=True, name_map=names, **keep)


def _calibrator_graph(calibrator: Calibrator, kind: str, opset: int) -> onnx.ModelProto:
    """The calibrator's model at ``opset``, its names prefixed but for its outputs."""
    model = _at_opset(onnx.load_from_string(calibrator.to_onnx()), opset)
    _prefix(model.graph, CALIBRATOR_PREFIX, rename_outputs=False)
    return model


def calibrator_model(calibrator: Calibrator, kind: str = "logits") -> onnx.ModelProto:
    """The calibrator's ONNX model taking ``kind`` scores as they come.

    Parameters
    ----------
    calibrator : Calibrator
        Fitted.
    kind : {"logits", "probabilities"}
        ``logits``: the model of :meth:`Calibrator.to_onnx` (input ``logits``).
        ``probabilities``: input :data:`PROBABILITIES_INPUT` (float32, (N, K)),
        whose log is taken in float64 before the same graph.

    Returns
    -------
    onnx.ModelProto
        Outputs as :func:`calibrators.onnx_export.softmax_model`.

    Raises
    ------
    KindError
        The calibrator does not take ``kind`` (:attr:`Calibrator.input_kinds`).
    """
    check_kind(kind)
    calibrator.check_input_kind(kind)
    if kind == "logits":
        return onnx.load_from_string(calibrator.to_onnx())
    inner = _calibrator_graph(calibrator, kind, OPSET)
    # The bridge ends in the name the prefixed graph reads its input from.
    bridge, _ = _score_bridge(PROBABILITIES_INPUT, kind, CALIBRATOR_PREFIX)
    k = calibrator.n_classes_
    graph = helper.make_graph(
        [*bridge, *inner.graph.node], inner.graph.name,
        [helper.make_tensor_value_info(PROBABILITIES_INPUT, TensorProto.FLOAT, ["N", k])],
        list(inner.graph.output), initializer=list(inner.graph.initializer),
        doc_string=inner.graph.doc_string,
    )
    model = helper.make_model(graph, opset_imports=list(inner.opset_import),
                              ir_version=inner.ir_version, producer_name="welltempered",
                              doc_string=inner.doc_string)
    helper.set_model_props(model, {p.key: p.value for p in inner.metadata_props})
    onnx.checker.check_model(model, full_check=True)
    return model


def fuse(
    model: bytes | onnx.ModelProto,
    calibrator: Calibrator,
    *,
    output: str | None = None,
    kind: str | None = None,
) -> onnx.ModelProto:
    """The classifier ``model`` followed by ``calibrator``, as one ONNX model.

    Parameters
    ----------
    model : bytes or onnx.ModelProto
        The classifier's ONNX model (tensors inside the file).
    calibrator : Calibrator
        A fitted calibrator of K classes.
    output : str, optional
        The classifier's output holding the scores; detected when omitted
        (:func:`detect_output`).
    kind : {"logits", "probabilities"}, optional
        What that output holds; default the kind the calibrator was fitted on
        (``kind_``; ``"logits"`` when unknown).

    Returns
    -------
    onnx.ModelProto
        Inputs: the classifier's. Outputs: ``probabilities`` float32 (N, K),
        ``confidence`` float32 (N,), ``label`` int64 (N,), ``entropy`` float32
        (N,). The classifier's operator sets; its metadata plus the calibrator's
        under ``welltempered.`` keys, and ``welltempered.output`` and
        ``welltempered.kind`` (the scores it reads).

    Raises
    ------
    FuseError
        The model is not valid ONNX, has no such output (or not exactly one to
        detect), an unsupported opset or IR version, external data, or an input
        named like an output of the calibrator.
    KindError
        The calibrator does not take ``kind``.

    Examples
    --------
    >>> import numpy as np
    >>> from onnx import helper, TensorProto
    >>> from calibrators import from_params
    >>> classifier = helper.make_model(helper.make_graph(
    ...     [helper.make_node("MatMul", ["x", "w"], ["scores"])], "linear",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
    ...     [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])],
    ...     [helper.make_tensor("w", TensorProto.FLOAT, [2, 3], np.ones(6))]),
    ...     opset_imports=[helper.make_opsetid("", 18)])
    >>> cal = from_params({"method": "temperature", "n_classes": 3, "weight": 0.5,
    ...                    "bias": None})
    >>> fused = fuse(classifier, cal)
    >>> [i.name for i in fused.graph.input], [o.name for o in fused.graph.output]
    (['x'], ['probabilities', 'confidence', 'label', 'entropy'])
    """
    if kind is None:
        kind = getattr(calibrator, "kind_", None) or KINDS[0]
    check_kind(kind)
    calibrator.check_input_kind(kind)
    proto = load_model(model)
    k = calibrator.n_classes_
    opset = _default_opset(proto)
    if output is None:
        output = detect_output(proto, k)
    else:
        _check_output(proto, output, k)
    clashes = [i.name for i in proto.graph.input
               if i.name in OUTPUT_NAMES or i.name.startswith((MODEL_PREFIX, CALIBRATOR_PREFIX))]
    if clashes:
        raise FuseError(
            f"The model's inputs must not be named {', '.join(OUTPUT_NAMES)} or start with "
            f"{MODEL_PREFIX!r} or {CALIBRATOR_PREFIX!r} (the fused model's names). Got "
            f"{clashes}."
        )
    cal = _calibrator_graph(calibrator, kind, opset)
    _prefix(proto.graph, MODEL_PREFIX, rename_inputs=False)
    # The bridge ends in the name the prefixed calibrator reads its input from.
    bridge, _ = _score_bridge(MODEL_PREFIX + output, kind, CALIBRATOR_PREFIX)
    graph = helper.make_graph(
        [*proto.graph.node, *bridge, *cal.graph.node],
        f"{proto.graph.name or 'model'}_calibrated",
        list(proto.graph.input),
        list(cal.graph.output),
        initializer=[*proto.graph.initializer, *cal.graph.initializer],
        # The calibrator's value_info (the version converter infers some) would type its
        # input float32; it reads float64 here, so only the model's is kept.
        value_info=list(proto.graph.value_info),
        sparse_initializer=list(proto.graph.sparse_initializer),
        doc_string=proto.graph.doc_string,
    )
    opsets = {o.domain or "": o.version for o in proto.opset_import if o.domain != "ai.onnx"}
    opsets[""] = opset
    fused = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(domain, v) for domain, v in sorted(opsets.items())],
        ir_version=max(proto.ir_version, IR_VERSION),
        producer_name="welltempered",
        doc_string=f"{proto.doc_string}\n{cal.doc_string}".strip(),
    )
    fused.functions.extend(proto.functions)
    props = {p.key: p.value for p in proto.metadata_props}
    props.update({f"welltempered.{p.key}": p.value for p in cal.metadata_props})
    props.update({"welltempered.output": output, "welltempered.kind": kind})
    helper.set_model_props(fused, props)
    try:
        onnx.checker.check_model(fused)
    except onnx.checker.ValidationError as exc:
        raise FuseError(f"The fused model is not valid ONNX: {exc}".rstrip() + ".") from None
    return fused
