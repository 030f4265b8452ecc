"""ONNX export of the one model behind every calibrator, ``softmax(W * phi(z) + b)``.

One graph serves temperature, vector, matrix and Dirichlet scaling:

* input ``logits``: float32 of shape (N, K), N dynamic (``dim_param "N"``), K fixed.
  Probabilities are fed as their log; a zero probability (log = ``-inf``) is
  replaced by :data:`calibrators.validation.LOG_FLOOR`, exactly what the numpy path
  does with ``log(max(p, PROBABILITY_FLOOR))``.
* outputs ``probabilities`` float32 (N, K), ``confidence`` float32 (N,) (the
  largest probability), ``label`` int64 (N,) (first argmax of the calibrated
  logits) and ``entropy`` float32 (N,) in nats.

The graph casts the input to float64 first and does all the arithmetic in
float64, casting only the outputs to float32, so it agrees with the float64
numpy path to float32 rounding. Weights are float64 initializers holding the
fitted numbers bit for bit. The structure of ``W`` picks the smallest graph:
a scalar ``Mul`` (temperature), a broadcast ``Mul`` by a (K,) vector (vector
scaling) or a ``MatMul`` by ``W.T`` (matrix, Dirichlet).

Versions
--------
Opset 17 with IR version 8 (the pair ``onnx`` 1.12 introduced). Every operator
used here exists in that form since opset 13 or earlier, and ONNX Runtime has
run opset 17 / IR 8 models since 1.12, so the model loads on the installed
runtime and on any ``onnxruntime>=1.18`` the project allows. Opset 18 would
gain nothing (it only moved the ``axes`` of ``ReduceMax`` to an input) and
would raise the floor for other consumers. The CPU provider implements every
operator used here for ``double`` (``IsInf``, ``Where``, ``Mul``, ``Add``,
``MatMul``, ``Log``, ``LogSoftmax``, ``ReduceMax``, ``ReduceSum``,
``ArgMax``, ``Squeeze``, ``Reciprocal``, ``Cast``, ``Greater``); ``Exp`` runs
in float32 (see below), and so does the ``ReduceMin`` whose result picks, through
an ``If``, whether the ``IsInf`` / ``Where`` replacement of ``-inf`` runs at all.

This module builds models only; it does not import ONNX Runtime.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from calibrators.validation import LOG_FLOOR, CalibrationInputError

#: Operator set and IR version of every exported model (see the module docstring).
OPSET = 17
IR_VERSION = 8

INPUT_NAME = "logits"
OUTPUT_NAMES = ("probabilities", "confidence", "label", "entropy")
FEATURES = ("logits", "log_softmax")

Feature = Literal["logits", "log_softmax"]


def _float64_array(name: str, value, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` as a finite float64 array of ``shape``, or raise."""
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise CalibrationInputError(f"{name} must be real numbers. Got dtype {arr.dtype}.")
    if arr.shape != shape:
        raise CalibrationInputError(f"{name} must have shape {shape}. Got shape {arr.shape}.")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise CalibrationInputError(f"{name} must be finite. Got {arr[~np.isfinite(arr)][0]}.")
    return arr


def _weight(n_classes: int, weight) -> np.ndarray:
    """The weight as float64 of shape () (scalar), (K,) (diagonal) or (K, K) (full)."""
    ndim = np.ndim(weight)
    if ndim not in (0, 1, 2):
        raise CalibrationInputError(
            f"weight must be a scalar, an array of shape ({n_classes},) or "
            f"({n_classes}, {n_classes}). Got {ndim} dimensions, shape {np.shape(weight)}."
        )
    shape = ((), (n_classes,), (n_classes, n_classes))[ndim]
    return _float64_array("weight", weight, shape)


def _check_arguments(n_classes, feature, metadata) -> None:
    if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer):
        raise CalibrationInputError(f"n_classes must be an int. Got {n_classes!r}.")
    if n_classes < 2:
        raise CalibrationInputError(f"n_classes must be at least 2. Got {n_classes}.")
    if feature not in FEATURES:
        raise CalibrationInputError(
            f"feature must be 'logits' or 'log_softmax'. Got {feature!r}."
        )
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CalibrationInputError(
                f"metadata keys and values must be str. Got {key!r}: {value!r}."
            )


def linear_softmax_model(
    n_classes: int,
    *,
    weight,
    bias=None,
    feature: Feature = "logits",
    doc_string: str = "",
    metadata: dict[str, str] | None = None,
) -> onnx.ModelProto:
    """The ONNX model of ``softmax(W * phi(z) + b)``, computed in float64.

    Parameters
    ----------
    n_classes : int
        K, the number of classes (at least 2); fixed in the graph's shapes.
    weight : float or ndarray of shape (K,) or (K, K)
        A scalar ``beta`` (``u = beta * phi(z)``), a per-class scale ``w``
        (``u = phi(z) * w``) or a full matrix ``W``
        (``u_i = sum_j W[i, j] * phi(z)_j``, i.e. ``u = phi(z) @ W.T``).
    bias : ndarray of shape (K,), optional
        Added to ``u``; no ``Add`` node when None.
    feature : {"logits", "log_softmax"}
        ``phi``: the identity, or the row-wise log-softmax (Dirichlet scaling).
    doc_string : str
        Stored as the model's ``doc_string``.
    metadata : dict of str to str, optional
        Stored as the model's ``metadata_props`` (e.g. method, K, version).

    Returns
    -------
    onnx.ModelProto
        Input ``logits`` float32 of shape (N, K); outputs ``probabilities``
        float32 of shape (N, K), ``confidence`` float32 of shape (N,),
        ``label`` int64 of shape (N,) and ``entropy`` float32 of shape (N,)
        (nats). A ``-inf`` input entry is read as ``LOG_FLOOR`` = log(2**-149).
        Opset 17, IR version 8; the model passes ``onnx.checker.check_model``.

    Raises
    ------
    CalibrationInputError
        If ``n_classes``, ``weight``, ``bias``, ``feature`` or ``metadata`` do
        not have the form described above, or the numbers are not finite.

    Examples
    --------
    >>> model = linear_softmax_model(3, weight=0.5, metadata={"method": "temperature"})
    >>> [o.name for o in model.graph.output]
    ['probabilities', 'confidence', 'label', 'entropy']
    """
    _check_arguments(n_classes, feature, metadata)
    k = int(n_classes)
    w = _weight(k, weight)
    b = None if bias is None else _float64_array("bias", bias, (k,))

    double = TensorProto.DOUBLE
    initializers = [
        numpy_helper.from_array(np.array(LOG_FLOOR, dtype=np.float64), "log_floor"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "class_axis"),
    ]
    # -inf -> LOG_FLOOR. ONNX Runtime's Where is a slow broadcasting loop (20 ms of a
    # 60 ms run at 4,096 x 1,000), so it runs only when the batch needs it: the
    # batch minimum is not > -inf (a -inf, or a NaN that hides one); otherwise the
    # branch taken is a bare Cast.
    cast_branch = helper.make_graph(
        [helper.make_node("Cast", [INPUT_NAME], ["z_cast"], to=double)],
        "cast",
        [],
        [helper.make_tensor_value_info("z_cast", double, ["N", k])],
    )
    floor_branch = helper.make_graph(
        [
            helper.make_node("Cast", [INPUT_NAME], ["z64"], to=double),
            helper.make_node(
                "IsInf", ["z64"], ["is_neg_inf"], detect_positive=0, detect_negative=1
            ),
            helper.make_node("Where", ["is_neg_inf", "log_floor", "z64"], ["z_floor"]),
        ],
        "floor_neg_inf",
        [],
        [helper.make_tensor_value_info("z_floor", double, ["N", k])],
    )
    initializers.append(numpy_helper.from_array(np.array(-np.inf, dtype=np.float64), "neg_inf"))
    nodes = [
        helper.make_node("ReduceMin", [INPUT_NAME], ["z_min32"], keepdims=0),
        helper.make_node("Cast", ["z_min32"], ["z_min"], to=double),
        helper.make_node("Greater", ["z_min", "neg_inf"], ["no_neg_inf"]),
        helper.make_node(
            "If", ["no_neg_inf"], ["z"], then_branch=cast_branch, else_branch=floor_branch
        ),
    ]
    x = "z"
    if feature == "log_softmax":
        nodes.append(helper.make_node("LogSoftmax", ["z"], ["phi"], axis=1))
        x = "phi"

    if w.ndim == 2:
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(w.T), "weight_t"))
        nodes.append(helper.make_node("MatMul", [x, "weight_t"], ["wx"]))
    else:
        initializers.append(numpy_helper.from_array(w, "weight"))
        nodes.append(helper.make_node("Mul", [x, "weight"], ["wx"]))
    u = "wx"
    if b is not None:
        initializers.append(numpy_helper.from_array(b, "bias"))
        nodes.append(helper.make_node("Add", ["wx", "bias"], ["u"]))
        u = "u"

    # One exponential pass: s = u - max(u) <= 0 (float64), e = exp(s),
    # S = sum(e), p = e / S, confidence = max p = 1 / S, entropy =
    # log S - sum(p * s). The exponential alone runs in float32: ONNX Runtime's
    # float64 Exp is a scalar loop (measured 2x slower for the whole graph at
    # 4,096 x 1,000), and for s <= 0 the float32 rounding of s and exp(s)
    # moves p by at most max_s(e^s |s|) * 2**-23 ~ 5e-8 absolute, far below
    # the 1e-6 parity we promise. Sums, division and log stay float64.
    nodes += [
        helper.make_node("ArgMax", [u], ["label"], axis=1, keepdims=0, select_last_index=0),
        helper.make_node("ReduceMax", [u], ["u_max"], axes=[1], keepdims=1),
        helper.make_node("Sub", [u, "u_max"], ["s"]),
        helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.FLOAT),
        helper.make_node("Exp", ["s32"], ["e32"]),
        helper.make_node("Cast", ["e32"], ["e"], to=double),
        helper.make_node("ReduceSum", ["e", "class_axis"], ["total"], keepdims=1),
        helper.make_node("Div", ["e", "total"], ["p64"]),
        helper.make_node("Mul", ["p64", "s"], ["ps"]),
        helper.make_node("ReduceSum", ["ps", "class_axis"], ["mean_s"], keepdims=0),
        helper.make_node("Squeeze", ["total", "class_axis"], ["total_n"]),
        helper.make_node("Log", ["total_n"], ["log_total"]),
        helper.make_node("Sub", ["log_total", "mean_s"], ["entropy64"]),
        helper.make_node("Reciprocal", ["total_n"], ["confidence64"]),
        helper.make_node("Cast", ["p64"], ["probabilities"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["confidence64"], ["confidence"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["entropy64"], ["entropy"], to=TensorProto.FLOAT),
    ]

    graph = helper.make_graph(
        nodes,
        "linear_softmax",
        inputs=[helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", k])],
        outputs=[
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", k]),
            helper.make_tensor_value_info("confidence", TensorProto.FLOAT, ["N"]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info("entropy", TensorProto.FLOAT, ["N"]),
        ],
        initializer=initializers,
        doc_string=doc_string,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="welltempered",
        doc_string=doc_string,
    )
    helper.set_model_props(model, dict(metadata or {}))
    onnx.checker.check_model(model, full_check=True)
    return model


def linear_softmax_onnx(
    n_classes: int,
    *,
    weight,
    bias=None,
    feature: Feature = "logits",
    doc_string: str = "",
    metadata: dict[str, str] | None = None,
) -> bytes:
    """:func:`linear_softmax_model`, serialised (the bytes ONNX Runtime loads).

    Parameters and errors are those of :func:`linear_softmax_model`.

    Returns
    -------
    bytes
        The serialised ``onnx.ModelProto``.
    """
    return linear_softmax_model(
        n_classes,
        weight=weight,
        bias=bias,
        feature=feature,
        doc_string=doc_string,
        metadata=metadata,
    ).SerializeToString()
