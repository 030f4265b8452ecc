"""Fused ONNX (calibrators.fuse): a real classifier's graph then every method's, as one.

The classifiers are real exports: a tiny torch MLP through ``torch.onnx.export``
(logits, opset 20 from torch's TorchScript exporter) and a scikit-learn
LogisticRegression through skl2onnx (probabilities, opset 22, with the ai.onnx.ml
domain). Parity is against running the two graphs in turn on ONNX Runtime, as a
user without the fused model would: the classifier, then the calibrator's own
graph on its scores (probabilities as their log, floored as the service does).
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import calibrators
from calibrators.fuse import (
    CALIBRATOR_PREFIX,
    MIN_OPSET,
    PROBABILITIES_INPUT,
    FuseError,
    calibrator_model,
    detect_output,
    fuse,
)
from calibrators.onnx_export import OUTPUT_NAMES
from calibrators.validation import PROBABILITY_FLOOR
from tests.calibrators.helpers import FIT_OPTIONS, labelled_logits, onnx_session

#: Largest allowed |fused - two graphs in turn| on the float outputs.
ATOL = 1e-6
N_FEATURES, K = 5, 4


def _run(model, feeds: dict) -> dict[str, np.ndarray]:
    session = onnx_session(model)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(240, N_FEATURES)).astype(np.float32)
    y = np.argmax(x[:, :K] + 0.8 * rng.normal(size=(240, K)), axis=1)
    return x, y


@pytest.fixture(scope="module")
def torch_mlp(data) -> bytes:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, K))
    out = io.BytesIO()
    # dynamo=False: torch's TorchScript exporter; the torch.export one needs onnxscript,
    # which the project does not install.
    torch.onnx.export(mlp, (torch.from_numpy(data[0][:2]),), out, input_names=["features"],
                      output_names=["scores"], dynamic_axes={"features": {0: "N"},
                                                             "scores": {0: "N"}},
                      dynamo=False)
    return out.getvalue()


@pytest.fixture(scope="module")
def sklearn_lr(data) -> bytes:
    skl2onnx = pytest.importorskip("skl2onnx")
    from sklearn.linear_model import LogisticRegression

    x, y = data
    lr = LogisticRegression(max_iter=500).fit(x, y)
    # zipmap off: the probabilities as a tensor, not a sequence of maps.
    return skl2onnx.to_onnx(lr, x[:1], options={"zipmap": False}).SerializeToString()


def _two_graphs(classifier: bytes, output: str, cal, kind: str, feeds: dict):
    scores = _run(classifier, feeds)[output]
    if kind == "probabilities":
        scores = np.log(np.maximum(scores, PROBABILITY_FLOOR), dtype=np.float32)
    return _run(cal.to_onnx(), {"logits": scores})


def _assert_parity(got: dict, want: dict) -> None:
    assert list(got) == list(OUTPUT_NAMES)
    for name in ("probabilities", "confidence", "entropy"):
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=ATOL, err_msg=name)
    np.testing.assert_array_equal(got["label"], want["label"])


@pytest.mark.parametrize("method", calibrators.METHODS)
def test_torch_mlp_then_every_method(method, data, torch_mlp):
    x, y = data
    fit_rows, test_rows = slice(0, 160), slice(160, None)
    scores = _run(torch_mlp, {"features": x[fit_rows]})["scores"]
    cal = calibrators.create(method, **FIT_OPTIONS[method]).fit(scores, y[fit_rows])
    fused = fuse(torch_mlp, cal)
    assert [i.name for i in fused.graph.input] == ["features"]
    assert fused.opset_import[0].version == onnx.load_from_string(torch_mlp).opset_import[0].version
    feeds = {"features": x[test_rows]}
    _assert_parity(_run(fused, feeds), _two_graphs(torch_mlp, "scores", cal, "logits", feeds))


@pytest.mark.parametrize("method", calibrators.METHODS)
def test_sklearn_probabilities_then_every_method(method, data, sklearn_lr):
    x, y = data
    probabilities = _run(sklearn_lr, {"X": x[:160]})["probabilities"]
    cal = calibrators.create(method, **FIT_OPTIONS[method]).fit(
        probabilities, y[:160], kind="probabilities")
    fused = fuse(sklearn_lr, cal)  # kind: the calibrator's; output: detected
    props = {p.key: p.value for p in fused.metadata_props}
    assert (props["welltempered.output"], props["welltempered.kind"]) == ("probabilities",
                                                                          "probabilities")
    assert props["welltempered.method"] == method
    assert {o.domain for o in fused.opset_import} == {"", "ai.onnx.ml"}
    feeds = {"X": x[160:]}
    _assert_parity(_run(fused, feeds),
                   _two_graphs(sklearn_lr, "probabilities", cal, "probabilities", feeds))


def _identity_model(outputs: dict[str, tuple[int, list]], opset: int = 18,
                    input_name: str = "p") -> onnx.ModelProto:
    """A model whose outputs are its input, as each named type and shape."""
    nodes = [helper.make_node("Cast", [input_name], [name], to=elem)
             for name, (elem, _) in outputs.items()]
    return helper.make_model(
        helper.make_graph(
            nodes, "identity",
            [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", K])],
            [helper.make_tensor_value_info(name, elem, shape)
             for name, (elem, shape) in outputs.items()],
        ),
        opset_imports=[helper.make_opsetid("", opset)],
    )


@pytest.fixture(scope="module")
def fitted():
    z, y = labelled_logits(80, K)
    return calibrators.create("vector", **FIT_OPTIONS["vector"]).fit(z, y)


def test_zero_probabilities_and_float64_scores(fitted):
    """A zero probability is -inf after the log, floored in the graph like the numpy path."""
    model = _identity_model({"p64": (TensorProto.DOUBLE, ["N", K])})
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(K), size=30).astype(np.float32)
    p[:5, 0] = 0.0
    p /= p.sum(axis=1, keepdims=True)
    got = _run(fuse(model, fitted, kind="probabilities"), {"p": p})
    want = fitted.predict_proba(p, kind="probabilities")
    np.testing.assert_allclose(got["probabilities"], want, rtol=0, atol=ATOL)
    assert np.isfinite(got["entropy"]).all()


def test_the_score_output_detected_or_named(fitted):
    one = _identity_model({"label": (TensorProto.INT64, ["N", K]),
                           "scores": (TensorProto.FLOAT, ["N", K]),
                           "wrong_k": (TensorProto.FLOAT, ["N", K + 1])})
    assert detect_output(one, K) == "scores"
    two = _identity_model({"a": (TensorProto.FLOAT, ["N", K]),
                           "b": (TensorProto.FLOAT16, [None, K])})
    with pytest.raises(FuseError, match=r"2 are .*'a' \(float32, \[N, 4\]\), 'b' \(float16"):
        fuse(two, fitted)
    fused = fuse(two, fitted, output="b")
    assert fused.metadata_props and [o.name for o in fused.graph.output] == list(OUTPUT_NAMES)
    with pytest.raises(FuseError, match="none is"):
        fuse(_identity_model({"a": (TensorProto.FLOAT, ["N", K + 1])}), fitted)
    with pytest.raises(FuseError, match=r"one of the model's outputs: 'a', 'b'\. Got 'c'"):
        fuse(two, fitted, output="c")
    with pytest.raises(FuseError, match=r"shape \[N, 4\].*'w' \(float32, \[N, 5\]\)"):
        fuse(_identity_model({"w": (TensorProto.FLOAT, ["N", K + 1])}), fitted, output="w")


def test_names_cannot_clash(fitted):
    """The classifier's own tensors named like our outputs or internals stay apart."""
    model = _identity_model({"probabilities": (TensorProto.FLOAT, ["N", K]),
                             "welltempered/logits": (TensorProto.FLOAT, ["N", K])})
    fused = fuse(model, fitted, output="probabilities", kind="logits")
    z = labelled_logits(12, K, seed=5)[0].astype(np.float32)
    np.testing.assert_allclose(_run(fused, {"p": z})["probabilities"],
                               fitted.predict_proba(z), rtol=0, atol=ATOL)
    with pytest.raises(FuseError, match="inputs must not be named"):
        fuse(_identity_model({"s": (TensorProto.FLOAT, ["N", K])}, input_name="label"), fitted)


@pytest.mark.parametrize("opset", [MIN_OPSET, 17, 19, onnx.defs.onnx_opset_version()])
def test_opsets_reconciled(opset, fitted):
    model = _identity_model({"s": (TensorProto.FLOAT, ["N", K])}, opset=opset)
    fused = fuse(model, fitted)
    assert [(o.domain, o.version) for o in fused.opset_import] == [("", opset)]
    z = labelled_logits(9, K, seed=2)[0].astype(np.float32)
    z[0, 1] = -1e4  # the centred log-ratio's floored branch too
    np.testing.assert_allclose(_run(fused, {"p": z})["probabilities"], fitted.predict_proba(z),
                               rtol=0, atol=ATOL)


def test_refusals_say_what_to_do(fitted):
    old = _identity_model({"s": (TensorProto.FLOAT, ["N", K])}, opset=MIN_OPSET - 1)
    with pytest.raises(FuseError, match=rf"opset must be {MIN_OPSET} to .*version_converter.*"
                                        rf"Got {MIN_OPSET - 1}\."):
        fuse(old, fitted)
    with pytest.raises(FuseError, match="must be an ONNX model"):
        fuse(b"\x00not onnx at all\xff", fitted)
    with pytest.raises(FuseError, match=r"must be ONNX bytes or an onnx\.ModelProto"):
        fuse("model.onnx", fitted)
    external = _identity_model({"s": (TensorProto.FLOAT, ["N", K])})
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    weight.data_location = TensorProto.EXTERNAL
    external.graph.initializer.append(weight)
    with pytest.raises(FuseError, match="external data"):
        fuse(external, fitted)


def test_calibrator_model_for_probabilities(fitted):
    model = calibrator_model(fitted, "probabilities")
    assert [i.name for i in model.graph.input] == [PROBABILITIES_INPUT]
    assert all(n.name.startswith(CALIBRATOR_PREFIX) for n in model.graph.initializer)
    p = np.random.default_rng(4).dirichlet(np.ones(K), size=20).astype(np.float32)
    got = _run(model, {PROBABILITIES_INPUT: p})["probabilities"]
    np.testing.assert_allclose(got, fitted.predict_proba(p, kind="probabilities"), rtol=0,
                               atol=ATOL)
    assert calibrator_model(fitted).SerializeToString() == fitted.to_onnx()
