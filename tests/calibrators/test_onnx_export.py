"""ONNX export of ``softmax(W * phi(z) + b)``: interface, graph size, and parity.

Parity is against :func:`_reference`, a float64 numpy oracle written here
(independent of the export module and of ``calibrators.numerics``), on ONNX
Runtime's CPU provider and on ``onnx.reference.ReferenceEvaluator``.
"""

from __future__ import annotations

import ast
import inspect

import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

from calibrators import onnx_export
from calibrators.onnx_export import OUTPUT_NAMES, linear_subgraph, softmax_model
from calibrators.validation import LOG_FLOOR, PROBABILITY_FLOOR, CalibrationInputError
from tests.calibrators.helpers import onnx_outputs, onnx_session

#: Largest allowed |ONNX - numpy| on probabilities, confidence and entropy.
ATOL = 1e-6
STRUCTURES = ("scalar", "diagonal", "full")
FEATURES = ("logits", "log_softmax")


# -- oracle and helpers -------------------------------------------------------
def linear_softmax_model(n_classes, *, weight, bias=None, feature="logits", doc_string="",
                         metadata=None) -> onnx.ModelProto:
    """The graph every member of the ``softmax(W * phi(z) + b)`` family exports,
    built from the two pieces the calibrators build theirs from."""
    w = np.asarray(weight, dtype=np.float64)
    b = None if bias is None else np.asarray(bias, dtype=np.float64)
    return softmax_model(
        n_classes,
        lambda g, z: linear_subgraph(g, z, weight=w, bias=b, feature=feature),
        graph_name="linear_softmax", doc_string=doc_string, metadata=metadata,
    )


def _reference(z64: np.ndarray, weight, bias, feature: str) -> dict[str, np.ndarray]:
    """The float64 numpy path: ``softmax(W * phi(z) + b)`` and its summaries."""
    x = np.asarray(z64, dtype=np.float64)
    if feature == "log_softmax":
        shifted = x - x.max(axis=1, keepdims=True)
        x = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    w = np.asarray(weight, dtype=np.float64)
    u = np.einsum("nj,ij->ni", x, w) if w.ndim == 2 else x * w
    if bias is not None:
        u = u + np.asarray(bias, dtype=np.float64)
    s = u - u.max(axis=1, keepdims=True)
    e = np.exp(s)
    total = e.sum(axis=1, keepdims=True)
    p = e / total
    logp = s - np.log(total)
    plogp = np.where(p > 0, p * logp, 0.0)  # 0 * log 0 = 0
    return {
        "probabilities": p,
        "confidence": p.max(axis=1),
        "label": u.argmax(axis=1),
        "entropy": -plogp.sum(axis=1),
    }


def _errors(got: dict, want: dict) -> dict[str, float]:
    """Max absolute error per float output."""
    return {
        name: float(np.max(np.abs(got[name].astype(np.float64) - want[name])))
        for name in ("probabilities", "confidence", "entropy")
    }


def _assert_parity(got: dict, want: dict, n: int, k: int) -> None:
    assert got["probabilities"].dtype == np.float32
    assert got["probabilities"].shape == (n, k)
    for name in ("confidence", "entropy"):
        assert got[name].dtype == np.float32
        assert got[name].shape == (n,)
    assert got["label"].dtype == np.int64
    assert got["label"].shape == (n,)
    errors = _errors(got, want)
    assert max(errors.values()) <= ATOL, errors
    np.testing.assert_array_equal(got["label"], want["label"])


def _params(rng: np.random.Generator, structure: str, k: int, scale: float, with_bias: bool):
    """Random weight (float, (K,) or (K, K)) and bias ((K,) or None) of magnitude ~scale."""
    if structure == "scalar":
        weight = float(scale * rng.uniform(0.1, 2.0))
    elif structure == "diagonal":
        weight = scale * rng.normal(size=k)
    else:
        weight = scale * rng.normal(size=(k, k)) / np.sqrt(k)
    bias = scale * rng.normal(size=k) if with_bias else None
    return weight, bias


def _logits_of_probabilities(p32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the caller feeds the graph, and the float64 logits the numpy path uses.

    The graph gets ``np.log(p)`` in float32 (``-inf`` for a zero). The numpy
    path uses ``log(max(p, PROBABILITY_FLOOR))``: the same float32 logs for
    positive entries, and log(2**-149) in float64 for zeros.
    """
    with np.errstate(divide="ignore"):
        fed = np.log(p32)
    want = np.where(p32 > 0, fed.astype(np.float64), np.log(np.float64(PROBABILITY_FLOOR)))
    return fed, want


# -- interface ------------------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
def test_graph_interface_metadata_and_checker(structure):
    k = 7
    weight, bias = _params(np.random.default_rng(1), structure, k, 1.0, structure != "scalar")
    meta = {"method": "matrix", "n_classes": str(k), "version": "3"}
    model = linear_softmax_model(
        k, weight=weight, bias=bias, doc_string="welltempered test", metadata=meta
    )
    onnx.checker.check_model(model, full_check=True)

    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.doc_string == "welltempered test"
    assert {p.key: p.value for p in model.metadata_props} == meta

    (inp,) = model.graph.input
    assert inp.name == "logits"
    assert inp.type.tensor_type.elem_type == TensorProto.FLOAT
    dims = inp.type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["N", ""]
    assert dims[1].dim_value == k

    expected = {
        "probabilities": (TensorProto.FLOAT, ["N", k]),
        "confidence": (TensorProto.FLOAT, ["N"]),
        "label": (TensorProto.INT64, ["N"]),
        "entropy": (TensorProto.FLOAT, ["N"]),
    }
    assert [o.name for o in model.graph.output] == list(expected)
    for out in model.graph.output:
        elem_type, shape = expected[out.name]
        assert out.type.tensor_type.elem_type == elem_type
        got = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
        assert got == shape

    # ONNX Runtime sees the same interface.
    sess = onnx_session(model)
    assert [(i.name, i.type, i.shape) for i in sess.get_inputs()] == [
        ("logits", "tensor(float)", ["N", k])
    ]
    assert [o.name for o in sess.get_outputs()] == list(expected)
    assert sess.get_modelmeta().custom_metadata_map == meta


@pytest.mark.parametrize(
    ("structure", "with_bias", "weight_op", "weight_shape"),
    [
        ("scalar", False, "Mul", ()),
        ("diagonal", True, "Mul", (5,)),
        ("full", True, "MatMul", (5, 5)),
    ],
)
@pytest.mark.parametrize("feature", FEATURES)
def test_graph_is_small_and_weights_are_exact_float64(
    structure, with_bias, weight_op, weight_shape, feature
):
    rng = np.random.default_rng(2)
    weight, bias = _params(rng, structure, 5, 1.0, with_bias)
    model = linear_softmax_model(5, weight=weight, bias=bias, feature=feature)
    ops = [node.op_type for node in model.graph.node]
    assert "MatMul" in ops if structure == "full" else "MatMul" not in ops
    assert ops.count("Add") == int(with_bias)
    assert ops.count("LogSoftmax") == int(feature == "log_softmax")
    assert ops.count("Exp") == 1  # one exponential pass over u
    assert len(ops) <= 24

    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert all(t.data_type == TensorProto.DOUBLE for t in model.graph.initializer
               if t.name != "class_axis")
    (node,) = [n for n in model.graph.node if n.op_type == weight_op and n.input[1] in inits]
    stored = inits[node.input[1]]
    assert stored.shape == weight_shape
    expected = np.asarray(weight).T if structure == "full" else np.asarray(weight)
    np.testing.assert_array_equal(stored, expected)  # bit for bit
    if with_bias:
        np.testing.assert_array_equal(inits["bias"], bias)
    assert inits["log_floor"] == LOG_FLOOR


@pytest.mark.process
def test_module_does_not_import_onnxruntime():
    tree = ast.parse(inspect.getsource(onnx_export))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "onnxruntime" not in imported


@pytest.mark.parametrize(
    ("n_classes", "metadata", "match"),
    [
        (1, None, "at least 2"),
        (3.0, None, "must be an int"),
        (True, None, "must be an int"),
        (3, {"k": 3}, "metadata"),
    ],
)
def test_invalid_arguments_raise(n_classes, metadata, match):
    with pytest.raises(CalibrationInputError, match=match) as info:
        softmax_model(n_classes, lambda g, z: z, metadata=metadata)
    assert "Got" in str(info.value)


# -- parity: examples -----------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_parity_with_numpy(structure, feature, with_bias):
    rng = np.random.default_rng(3)
    n, k = 9, 5
    weight, bias = _params(rng, structure, k, 1.5, with_bias)
    z32 = (4.0 * rng.normal(size=(n, k))).astype(np.float32)
    sess = onnx_session(linear_softmax_model(k, weight=weight, bias=bias, feature=feature))
    want = _reference(z32.astype(np.float64), weight, bias, feature)
    _assert_parity(onnx_outputs(sess, z32), want, n, k)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("feature", FEATURES)
def test_reference_evaluator_agrees(structure, feature):
    rng = np.random.default_rng(4)
    n, k = 6, 4
    weight, bias = _params(rng, structure, k, 1.0, structure != "scalar")
    model = linear_softmax_model(k, weight=weight, bias=bias, feature=feature)
    p = rng.dirichlet(np.ones(k), size=n).astype(np.float32)
    p[0, 1] = 0.0  # a -inf input
    fed, z64 = _logits_of_probabilities(p)
    want = _reference(z64, weight, bias, feature)
    got_ref = onnx_outputs(ReferenceEvaluator(model), fed)
    _assert_parity(got_ref, want, n, k)
    got_ort = onnx_outputs(onnx_session(model), fed)
    for name in OUTPUT_NAMES:
        np.testing.assert_allclose(got_ort[name], got_ref[name], rtol=0, atol=ATOL)


@pytest.mark.parametrize("structure", ["scalar", "diagonal"])
def test_ties_resolve_to_the_first_class(structure):
    k = 6
    weight = 0.7 if structure == "scalar" else np.full(k, 0.7)
    sess = onnx_session(linear_softmax_model(k, weight=weight))
    z32 = np.zeros((3, k), dtype=np.float32)
    z32[1, [2, 4]] = 5.0
    got = onnx_outputs(sess, z32)
    np.testing.assert_array_equal(got["label"], [0, 2, 0])
    np.testing.assert_allclose(got["probabilities"][0], np.full(k, 1 / k), atol=ATOL)
    np.testing.assert_allclose(got["entropy"][0], np.log(k), atol=ATOL)


def test_dynamic_batch_size_oneonnx_session():
    rng = np.random.default_rng(5)
    k = 10
    weight, bias = _params(rng, "full", k, 1.0, True)
    sess = onnx_session(linear_softmax_model(k, weight=weight, bias=bias, feature="log_softmax"))
    for n in (1, 4096, 1):
        z32 = (3.0 * rng.normal(size=(n, k))).astype(np.float32)
        want = _reference(z32.astype(np.float64), weight, bias, "log_softmax")
        _assert_parity(onnx_outputs(sess, z32), want, n, k)


@pytest.mark.parametrize("feature", FEATURES)
def test_parity_on_real_classifier_outputs(shared, feature):
    probs = shared.probs
    n, k = probs.shape
    rng = np.random.default_rng(6)
    weight = np.eye(k) + 0.1 * rng.normal(size=(k, k))
    bias = 0.1 * rng.normal(size=k)
    sess = onnx_session(linear_softmax_model(k, weight=weight, bias=bias, feature=feature))
    fed, z64 = _logits_of_probabilities(probs)
    want = _reference(z64, weight, bias, feature)
    _assert_parity(onnx_outputs(sess, fed), want, n, k)


# -- parity: properties ---------------------------------------------------------
@settings(max_examples=25)
@given(
    n=st.integers(1, 40),
    k=st.integers(2, 40),
    structure=st.sampled_from(STRUCTURES),
    feature=st.sampled_from(FEATURES),
    with_bias=st.booleans(),
    logit_scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    weight_scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**32 - 1),
)
@example(n=1, k=2, structure="full", feature="logits", with_bias=True,
         logit_scale=1.0, weight_scale=1.0, seed=0)
@example(n=3, k=1000, structure="full", feature="log_softmax", with_bias=True,
         logit_scale=1e4, weight_scale=1.0, seed=1)
@example(n=5, k=1000, structure="diagonal", feature="logits", with_bias=True,
         logit_scale=1e4, weight_scale=1e3, seed=2)
def test_parity_property(n, k, structure, feature, with_bias, logit_scale, weight_scale, seed):
    rng = np.random.default_rng(seed)
    weight, bias = _params(rng, structure, k, weight_scale, with_bias)
    z32 = (logit_scale * rng.normal(size=(n, k))).astype(np.float32)
    sess = onnx_session(linear_softmax_model(k, weight=weight, bias=bias, feature=feature))
    got = onnx_outputs(sess, z32)
    _assert_parity(got, _reference(z32.astype(np.float64), weight, bias, feature), n, k)
    # Invariants of the outputs themselves.
    assert np.all(np.abs(got["probabilities"].sum(axis=1, dtype=np.float64) - 1.0) <= 1e-5)
    np.testing.assert_array_equal(got["confidence"], got["probabilities"].max(axis=1))
    assert np.all(got["entropy"] >= -ATOL)
    assert np.all(got["entropy"] <= np.log(k) + ATOL)


@settings(max_examples=25)
@given(
    n=st.integers(1, 30),
    k=st.integers(2, 30),
    structure=st.sampled_from(STRUCTURES),
    feature=st.sampled_from(FEATURES),
    zero_fraction=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
@example(n=1, k=2, structure="full", feature="log_softmax", zero_fraction=1.0, seed=0)
def test_parity_on_probabilities_with_exact_zeros(n, k, structure, feature, zero_fraction, seed):
    rng = np.random.default_rng(seed)
    weight, bias = _params(rng, structure, k, 1.0, structure != "scalar")
    p = rng.dirichlet(np.full(k, 0.3), size=n)
    zero = rng.random((n, k)) < zero_fraction
    zero[np.arange(n), p.argmax(axis=1)] = False  # one positive entry per row at least
    p[zero] = 0.0
    p32 = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    fed, z64 = _logits_of_probabilities(p32)
    assert np.isneginf(fed).any() == bool((p32 == 0).any())
    np.testing.assert_array_equal(z64[p32 == 0], LOG_FLOOR)
    sess = onnx_session(linear_softmax_model(k, weight=weight, bias=bias, feature=feature))
    _assert_parity(onnx_outputs(sess, fed), _reference(z64, weight, bias, feature), n, k)


# -- the generic wrapper --------------------------------------------------------
def test_a_subgraph_that_asks_for_the_wrappers_names_gets_fresh_ones():
    def forward(graph, z):
        doubled = graph.node("Mul", [z, graph.constant(2.0, "log_floor")], "probabilities")
        return graph.node("Identity", [doubled], "s")

    model = softmax_model(4, forward, graph_name="doubling")
    names = [out for node in model.graph.node for out in node.output]
    assert len(names) == len(set(names))
    z32 = np.random.default_rng(7).normal(size=(9, 4)).astype(np.float32)
    want = _reference(2.0 * z32.astype(np.float64), 1.0, None, "logits")
    _assert_parity(onnx_outputs(model, z32), want, 9, 4)
    _assert_parity(onnx_outputs(ReferenceEvaluator(model), z32), want, 9, 4)
