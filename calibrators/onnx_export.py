"""ONNX export of calibrators: one graph wrapper, one subgraph per kind of calibrator.

Every exported model has the same interface and the same wrapper
(:func:`softmax_model`); only the calibrated-logits subgraph in the middle differs:

* input ``logits``: float32 of shape (N, K), N dynamic (``dim_param "N"``), K fixed.
  Probabilities are fed as their log; a zero probability (log = ``-inf``) is
  replaced by :data:`calibrators.validation.LOG_FLOOR`, exactly what the numpy path
  does with ``log(max(p, PROBABILITY_FLOOR))``.
* the calibrator's subgraph (its ``_onnx_forward`` hook, built with a
  :class:`GraphBuilder`) maps those float64 logits to float64 calibrated logits.
* outputs ``probabilities`` float32 (N, K), ``confidence`` float32 (N,) (the
  largest probability), ``label`` int64 (N,) (first argmax of the calibrated
  logits) and ``entropy`` float32 (N,) in nats.

The graph casts the input to float64 first and does all the arithmetic in
float64, casting only the outputs to float32, so it agrees with the float64
numpy path to float32 rounding. Weights are float64 initializers holding the
fitted numbers bit for bit.

The subgraph of the ``softmax(W * phi(z) + b)`` family (:func:`linear_subgraph`,
inside :func:`softmax_model` for the whole model) picks the smallest graph
for the structure of ``W``: a scalar ``Mul`` (temperature), a broadcast ``Mul``
by a (K,) vector (vector scaling) or a ``MatMul`` by ``W.T`` (matrix, Dirichlet).

Versions
--------
Opset 17 with IR version 8 (the pair ``onnx`` 1.12 introduced). Every operator
used here exists in that form since opset 13 or earlier, and ONNX Runtime has
run opset 17 / IR 8 models since 1.12, so the model loads on the installed
runtime and on any ``onnxruntime>=1.18`` the project allows. Opset 18 would
gain nothing (it only moved the ``axes`` of ``ReduceMax`` to an input) and
would raise the floor for other consumers. The CPU provider implements every
operator used here for ``double`` (``IsInf``, ``Where``, ``Mul``, ``Add``,
``MatMul``, ``Log``, ``LogSoftmax``, ``Max``, ``ReduceMax``, ``ReduceMean``, ``ReduceSum``, ``Sub``,
``ArgMax``, ``Squeeze``, ``Reciprocal``, ``Cast``, ``Greater``); ``Exp`` runs
in float32 (see below), and so does the ``ReduceMin`` whose result picks, through
an ``If``, whether the ``IsInf`` / ``Where`` replacement of ``-inf`` runs at all.

This module builds models only; it does not import ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from calibrators.validation import LOG_FLOOR, CalibrationInputError

#: Operator set and IR version of every exported model (see the module docstring).
OPSET = 17
IR_VERSION = 8

INPUT_NAME = "logits"
OUTPUT_NAMES = ("probabilities", "confidence", "label", "entropy")

Feature = Literal["logits", "clr", "log_softmax"]
FEATURES: tuple[str, ...] = get_args(Feature)


class GraphBuilder:
    """Nodes and initializers of one ONNX graph, with unique tensor names.

    A calibrator's ``_onnx_forward(graph, z)`` appends its nodes here and returns
    the name of its output; names it asks for are kept when free, otherwise
    suffixed (``u`` -> ``u_1``), so a subgraph cannot collide with the wrapper.

    Parameters
    ----------
    n_classes : int
        K, the number of classes (the static second dimension of every (N, K) tensor).

    Examples
    --------
    >>> g = GraphBuilder(3)
    >>> beta = g.constant(2.0, "beta")
    >>> g.node("Mul", ["z", beta], "u"), g.node("Mul", ["u", beta], "u")
    ('u', 'u_1')
    """

    def __init__(self, n_classes: int):
        self.n_classes = n_classes
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def name(self, hint: str) -> str:
        """A tensor name not used yet in this graph: ``hint``, or ``hint_<i>``."""
        name, i = hint, 0
        while name in self._names:
            i += 1
            name = f"{hint}_{i}"
        self._names.add(name)
        return name

    def constant(self, value: Any, hint: str) -> str:
        """An initializer holding ``value`` (float64; int64 for an integer array); its name."""
        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.integer):
            arr = arr.astype(np.float64)
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    def node(self, op_type: str, inputs: list[str], hint: str | None = None, **attributes) -> str:
        """Append one ``op_type`` node with one output; the output's name.

        Parameters
        ----------
        op_type : str
            An operator of the default domain at opset :data:`OPSET`.
        inputs : list of str
            Names of tensors already in the graph (or the graph input).
        hint : str, optional
            Wanted output name; default the operator's name in lower case.
        **attributes
            The node's attributes (``axis=1``, ``keepdims=0``...).
        """
        out = self.name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attributes))
        return out


Forward = Callable[[GraphBuilder, str], str]


def _check_n_classes_and_metadata(n_classes, metadata) -> None:
    if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer):
        raise CalibrationInputError(f"n_classes must be an int. Got {n_classes!r}.")
    if n_classes < 2:
        raise CalibrationInputError(f"n_classes must be at least 2. Got {n_classes}.")
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CalibrationInputError(
                f"metadata keys and values must be str. Got {key!r}: {value!r}."
            )


def softmax_model(
    n_classes: int,
    forward: Forward,
    *,
    graph_name: str = "calibrator",
    doc_string: str = "",
    metadata: dict[str, str] | None = None,
) -> onnx.ModelProto:
    """The ONNX model of ``softmax(forward(z))`` with the interface of every calibrator.

    Parameters
    ----------
    n_classes : int
        K, the number of classes (at least 2); fixed in the graph's shapes.
    forward : callable
        ``forward(graph, z) -> u``: appends to ``graph`` (a :class:`GraphBuilder`)
        the nodes that map ``z``, the name of the float64 logits of shape (N, K),
        to calibrated float64 logits of shape (N, K), and returns their name.
    graph_name : str, default "calibrator"
        The graph's name.
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
        If ``n_classes`` is not an int >= 2 or ``metadata`` not a dict of str.

    Examples
    --------
    >>> def half(graph, z):
    ...     return graph.node("Mul", [z, graph.constant(0.5, "beta")], "u")
    >>> model = softmax_model(3, half)
    >>> [o.name for o in model.graph.output]
    ['probabilities', 'confidence', 'label', 'entropy']
    """
    _check_n_classes_and_metadata(n_classes, metadata)
    k = int(n_classes)
    probabilities, confidence, label, entropy = OUTPUT_NAMES
    g = GraphBuilder(k)
    for reserved in (INPUT_NAME, *OUTPUT_NAMES):
        g.name(reserved)
    u = forward(g, _finite_logits(g))
    _softmax_outputs(g, u)
    graph = helper.make_graph(
        g.nodes,
        graph_name,
        inputs=[helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", k])],
        outputs=[
            helper.make_tensor_value_info(probabilities, TensorProto.FLOAT, ["N", k]),
            helper.make_tensor_value_info(confidence, TensorProto.FLOAT, ["N"]),
            helper.make_tensor_value_info(label, TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info(entropy, TensorProto.FLOAT, ["N"]),
        ],
        initializer=g.initializers,
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


def _finite_logits(g: GraphBuilder) -> str:
    """The input as float64, with ``-inf`` replaced by ``LOG_FLOOR``; its name."""
    double, k = TensorProto.DOUBLE, g.n_classes
    log_floor = g.constant(LOG_FLOOR, "log_floor")
    g.constant(np.array([1], dtype=np.int64), "class_axis")
    # -inf -> LOG_FLOOR. ONNX Runtime's Where is a slow broadcasting loop, so it runs
    # only when the batch needs it: the batch minimum is not > -inf (a -inf, or a NaN
    # that hides one); otherwise the branch taken is a bare Cast.
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
            helper.make_node("Where", ["is_neg_inf", log_floor, "z64"], ["z_floor"]),
        ],
        "floor_neg_inf",
        [],
        [helper.make_tensor_value_info("z_floor", double, ["N", k])],
    )
    for branch_name in ("z_cast", "z64", "is_neg_inf", "z_floor"):
        g.name(branch_name)  # the branches' names are reserved in the outer graph too
    neg_inf = g.constant(-np.inf, "neg_inf")
    z_min32 = g.node("ReduceMin", [INPUT_NAME], "z_min32", keepdims=0)
    z_min = g.node("Cast", [z_min32], "z_min", to=double)
    no_neg_inf = g.node("Greater", [z_min, neg_inf], "no_neg_inf")
    return g.node("If", [no_neg_inf], "z", then_branch=cast_branch, else_branch=floor_branch)


def _softmax_outputs(g: GraphBuilder, u: str) -> None:
    """The four outputs from the calibrated float64 logits ``u``."""
    # One exponential pass: s = u - max(u) <= 0 (float64), e = exp(s),
    # S = sum(e), p = e / S, confidence = max p = 1 / S, entropy =
    # log S - sum(p * s). The exponential alone runs in float32: ONNX Runtime's
    # float64 Exp is a scalar loop (bench/README.md has the cost), and for s <= 0
    # the float32 rounding of s and exp(s) moves p by at most
    # max_s(e^s |s|) * 2**-23 ~ 5e-8 absolute, far below the 1e-6 parity we
    # promise. Sums, division and log stay float64.
    probabilities, confidence, label, entropy = OUTPUT_NAMES
    double, axis = TensorProto.DOUBLE, "class_axis"
    g.nodes.append(
        helper.make_node("ArgMax", [u], [label], axis=1, keepdims=0, select_last_index=0)
    )
    u_max = g.node("ReduceMax", [u], "u_max", axes=[1], keepdims=1)
    s = g.node("Sub", [u, u_max], "s")
    s32 = g.node("Cast", [s], "s32", to=TensorProto.FLOAT)
    e32 = g.node("Exp", [s32], "e32")
    e = g.node("Cast", [e32], "e", to=double)
    total = g.node("ReduceSum", [e, axis], "total", keepdims=1)
    p64 = g.node("Div", [e, total], "p64")
    ps = g.node("Mul", [p64, s], "ps")
    mean_s = g.node("ReduceSum", [ps, axis], "mean_s", keepdims=0)
    total_n = g.node("Squeeze", [total, axis], "total_n")
    log_total = g.node("Log", [total_n], "log_total")
    entropy64 = g.node("Sub", [log_total, mean_s], "entropy64")
    confidence64 = g.node("Reciprocal", [total_n], "confidence64")
    for source, output in ((p64, probabilities), (confidence64, confidence),
                           (entropy64, entropy)):
        g.nodes.append(helper.make_node("Cast", [source], [output], to=TensorProto.FLOAT))


def _centred_log_ratio(g: GraphBuilder, z: str) -> str:
    """Append :func:`calibrators.validation.centred_log_ratio` of ``z``; its name.

    Where no entry can fall below the floor, ``clr(z) = z - mean(z)``: an ``If`` takes
    that branch when the batch's spread ``max(z) - min(z)`` is at most
    ``-LOG_FLOOR - log(K)`` (then every ``z_j - logsumexp(z) >= LOG_FLOOR``). The other
    branch floors: ``l = max(s - log(sum(exp(s))), LOG_FLOOR)`` with ``s = z - max(z)``,
    then ``l - mean(l)``; its exponential runs in float32, as in the softmax outputs
    (ONNX Runtime's float64 ``Exp`` is a scalar loop): that moves the row's
    log-normaliser by about 1e-7, a per-row constant the centring removes from every
    entry above the floor. Each branch costs a few per-row passes; a float64
    ``LogSoftmax`` in their place made a vector scaling graph about twice as slow.
    """
    double, k = TensorProto.DOUBLE, g.n_classes
    out = g.name("phi")
    names = {n: g.name(n) for n in ("clr_z_mean", "clr_max", "clr_s", "clr_s32", "clr_e32",
                                    "clr_e", "clr_total", "clr_log_total", "clr_log_p",
                                    "clr_floored", "clr_mean")}
    n = names
    floor = g.constant(LOG_FLOOR, "clr_floor")
    centred = helper.make_graph(
        [helper.make_node("ReduceMean", [z], [n["clr_z_mean"]], axes=[1], keepdims=1),
         helper.make_node("Sub", [z, n["clr_z_mean"]], [out + "_centred"])],
        "centred", [], [helper.make_tensor_value_info(out + "_centred", double, ["N", k])],
    )
    floored = helper.make_graph(
        [helper.make_node("ReduceMax", [z], [n["clr_max"]], axes=[1], keepdims=1),
         helper.make_node("Sub", [z, n["clr_max"]], [n["clr_s"]]),
         helper.make_node("Cast", [n["clr_s"]], [n["clr_s32"]], to=TensorProto.FLOAT),
         helper.make_node("Exp", [n["clr_s32"]], [n["clr_e32"]]),
         helper.make_node("Cast", [n["clr_e32"]], [n["clr_e"]], to=double),
         helper.make_node("ReduceSum", [n["clr_e"], "class_axis"], [n["clr_total"]],
                          keepdims=1),
         helper.make_node("Log", [n["clr_total"]], [n["clr_log_total"]]),
         helper.make_node("Sub", [n["clr_s"], n["clr_log_total"]], [n["clr_log_p"]]),
         helper.make_node("Max", [n["clr_log_p"], floor], [n["clr_floored"]]),
         helper.make_node("ReduceMean", [n["clr_floored"]], [n["clr_mean"]], axes=[1],
                          keepdims=1),
         helper.make_node("Sub", [n["clr_floored"], n["clr_mean"]], [out + "_floored"])],
        "floored", [], [helper.make_tensor_value_info(out + "_floored", double, ["N", k])],
    )
    g.name(out + "_centred"), g.name(out + "_floored")
    spread = g.node("Sub", [g.node("ReduceMax", [z], "clr_z_top", keepdims=0),
                            g.node("ReduceMin", [z], "clr_z_bottom", keepdims=0)], "clr_spread")
    safe = g.node("LessOrEqual", [spread, g.constant(-LOG_FLOOR - np.log(k), "clr_safe")],
                  "clr_no_floor")
    g.nodes.append(helper.make_node("If", [safe], [out], then_branch=centred,
                                    else_branch=floored))
    return out


def linear_subgraph(
    g: GraphBuilder, z: str, *, weight: np.ndarray | float, bias: np.ndarray | None,
    feature: Feature,
) -> str:
    """Append ``u = W * phi(z) + b`` to ``g``; the name of ``u``.

    The ONNX side of the ``softmax(W * phi(z) + b)`` family. ``weight`` and
    ``bias`` are used as given (float64 values the calibrator's params have
    validated).

    Parameters
    ----------
    g : GraphBuilder
    z : str
        Name of the float64 logits, shape (N, K).
    weight : float or ndarray of shape (K,) or (K, K)
    bias : ndarray of shape (K,) or None
    feature : {"logits", "clr", "log_softmax"}
        ``clr``: :func:`calibrators.validation.centred_log_ratio` in the graph
        (:func:`_centred_log_ratio`).

    Returns
    -------
    str
        Name of the float64 calibrated logits, shape (N, K).
    """
    x = z
    if feature == "log_softmax":
        x = g.node("LogSoftmax", [z], "phi", axis=1)
    elif feature == "clr":
        x = _centred_log_ratio(g, z)
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim == 2:
        wx = g.node("MatMul", [x, g.constant(np.ascontiguousarray(w.T), "weight_t")], "wx")
    else:
        wx = g.node("Mul", [x, g.constant(w, "weight")], "wx")
    if bias is None:
        return wx
    return g.node("Add", [wx, g.constant(bias, "bias")], "u")
