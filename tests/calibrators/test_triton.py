"""Triton model repository entries (calibrators.triton), parsed by Triton's own protobuf."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import calibrators
from calibrators import CalibrationInputError
from calibrators.onnx_export import OUTPUT_NAMES
from calibrators.triton import (
    PLATFORM,
    SCORES_TENSOR,
    Tensor,
    ensemble_config,
    model_config,
    to_pbtxt,
    write_ensemble,
    write_entry,
)
from tests.calibrators.helpers import FIT_OPTIONS, labelled_logits, onnx_session
from tests.oracles import softmax

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
text_format = pytest.importorskip("google.protobuf.text_format")

K = 4
#: ONNX element types as Triton's data types.
TRITON_TYPES = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT64: "TYPE_INT64"}


def _parse(text: str):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _dims(value: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else -1
            for d in value.type.tensor_type.shape.dim]


def _signature(tensors) -> list[tuple]:
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in tensors]


@pytest.fixture(scope="module")
def fitted():
    z, y = labelled_logits(90, K, seed=3)
    return calibrators.create("matrix", **FIT_OPTIONS["matrix"]).fit(softmax(z), y,
                                                                     kind="probabilities")


@pytest.mark.parametrize("kind", calibrators.validation.KINDS)
def test_entry_config_matches_its_onnx(kind, fitted, tmp_path):
    folder = write_entry(fitted, tmp_path, "digits-cal", kind=kind)
    config = _parse((folder / "config.pbtxt").read_text())
    assert (config.name, config.platform, config.max_batch_size) == ("digits-cal", PLATFORM, 0)
    graph = onnx.load(folder / "1" / "model.onnx").graph
    onnx_signature = [(v.name, TRITON_TYPES[v.type.tensor_type.elem_type], _dims(v))
                      for v in (*graph.input, *graph.output)]
    assert _signature((*config.input, *config.output)) == onnx_signature
    assert [o.name for o in config.output] == list(OUTPUT_NAMES)
    assert list(config.input[0].dims) == [-1, K]
    # the entry computes what the library does, for the kind its input takes
    z = labelled_logits(20, K, seed=9)[0]
    scores = softmax(z) if kind == "probabilities" else z
    session = onnx_session((folder / "1" / "model.onnx").read_bytes())
    (p,) = session.run(["probabilities"], {config.input[0].name: scores.astype(np.float32)})
    np.testing.assert_allclose(p, fitted.predict_proba(scores, kind=kind), rtol=0, atol=1e-6)


def test_entry_defaults_to_the_fitted_kind(fitted, tmp_path):
    config = _parse((write_entry(fitted, tmp_path, "c") / "config.pbtxt").read_text())
    assert config.input[0].name != "logits"  # fitted on probabilities


def test_ensemble_chains_the_model_to_the_entry(fitted, tmp_path):
    entry = _parse((write_entry(fitted, tmp_path, "cal") / "config.pbtxt").read_text())
    inputs = [Tensor.parse("pixels:FP32:-1,64"), Tensor.parse("mask:type_bool:-1,1")]
    folder = write_ensemble(tmp_path, "digits", model="digits-mlp", model_inputs=inputs,
                            model_output="output__0", calibrator="cal", n_classes=K,
                            kind="probabilities")
    assert (folder / "1").is_dir()
    config = _parse((folder / "config.pbtxt").read_text())
    assert config.platform == "ensemble"
    assert _signature(config.input) == [("pixels", "TYPE_FP32", [-1, 64]),
                                        ("mask", "TYPE_BOOL", [-1, 1])]
    assert _signature(config.output) == _signature(entry.output)
    model_step, calibrator_step = config.ensemble_scheduling.step
    assert model_step.model_name == "digits-mlp"
    assert dict(model_step.input_map) == {"pixels": "pixels", "mask": "mask"}
    assert dict(model_step.output_map) == {"output__0": SCORES_TENSOR}
    assert calibrator_step.model_name == "cal"
    # the calibrator step feeds the entry's own input, and maps out every entry output
    assert dict(calibrator_step.input_map) == {entry.input[0].name: SCORES_TENSOR}
    assert dict(calibrator_step.output_map) == {o.name: o.name for o in entry.output}


def test_text_format_escapes_and_refusals(tmp_path):
    config = ensemble_config("e", model="m", model_inputs=[Tensor("x", "FP32", (-1, 3))],
                             model_output='odd "name" \\ here', calibrator="c", n_classes=3)
    step = _parse(to_pbtxt(config)).ensemble_scheduling.step[0]
    assert dict(step.output_map) == {'odd "name" \\ here': SCORES_TENSOR}
    assert _parse(to_pbtxt(model_config("m", 3))).output[2].data_type == model_config_pb2.TYPE_INT64
    for bad in ("x:FP32", "x:FP32:a,b", "x:FLOAT:-1", "x:FP32:-1,0"):
        with pytest.raises(CalibrationInputError, match=r"NAME:TYPE:DIMS|data type|dims"):
            Tensor.parse(bad)
    with pytest.raises(CalibrationInputError, match="must not be named"):
        ensemble_config("e", model="m", model_inputs=[Tensor("label", "FP32", (-1, 3))],
                        model_output="o", calibrator="c", n_classes=3)
    with pytest.raises(CalibrationInputError, match="Triton model name"):
        write_ensemble(tmp_path, "../up", model="m", model_inputs=[Tensor("x", "FP32", (-1,))],
                       model_output="o", calibrator="c", n_classes=3)
