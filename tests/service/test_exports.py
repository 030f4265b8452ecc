"""``welltempered fuse`` and ``welltempered triton`` (service/exports.py)."""

from __future__ import annotations

import http.server
import json
import threading
from typing import ClassVar

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import calibrators
from service import cli, exports
from tests.service.helpers import logits_data

K, FEATURES = 4, 3
WEIGHT = np.arange(FEATURES * K, dtype=np.float32).reshape(FEATURES, K) / 5.0


def _classifier(outputs=("scores",)) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], [name]) for name in outputs], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", K]) for name in outputs],
        [helper.make_tensor("w", TensorProto.FLOAT, WEIGHT.shape, WEIGHT.ravel())],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.fixture(scope="module")
def cal():
    z, y = logits_data(200, K)
    return calibrators.create("vector", reg_lambda=1.0, reg_mu=1.0).fit(z, y)


@pytest.fixture
def files(tmp_path, cal):
    model = tmp_path / "model.onnx"
    model.write_bytes(_classifier())
    params = tmp_path / "params.json"
    params.write_text(json.dumps(cal.to_params()))
    return model, params


def _check_fused(path, cal) -> None:
    x = np.random.default_rng(2).normal(size=(7, FEATURES)).astype(np.float32)
    session = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    (p,) = session.run(["probabilities"], {"x": x})
    np.testing.assert_allclose(p, cal.predict_proba(x @ WEIGHT), rtol=0, atol=1e-6)


def test_fuse_from_a_params_file(files, cal, tmp_path, capsys):
    model, params = files
    out = tmp_path / "fused.onnx"
    assert cli.main(["fuse", str(model), "--params", str(params), "-o", str(out)]) == 0
    assert "output 'scores' (logits) then vector scaling" in capsys.readouterr().out
    _check_fused(out, cal)
    # a version's JSON as the API answers it: its params are taken
    params.write_text(json.dumps({"version": 3, "status": "succeeded",
                                  "params": cal.to_params()}))
    assert cli.main(["fuse", str(model), "--params", str(params), "-o", str(out)]) == 0
    _check_fused(out, cal)


@pytest.mark.parametrize("argv, words", [
    (["--params", "{params}"], "Name the model's output"),  # two score outputs
    ([], "--params FILE or --url"),
    (["--params", "{params}", "--url", "http://x"], "one of the two"),
    (["--url", "http://127.0.0.1:9"], "--url needs --model and --version"),
    (["--params", "{model}"], "cannot read params"),
])
def test_fuse_usage_errors_exit_2(argv, words, files, tmp_path, capsys):
    model, params = files
    model.write_bytes(_classifier(("a", "b")))
    argv = [a.format(params=params, model=model) for a in argv]
    assert cli.main(["fuse", str(model), *argv, "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("welltempered fuse: ") and words in err


class _Version(http.server.BaseHTTPRequestHandler):
    """A service's answer to GET a version: ``answer`` for ``path``, 404 otherwise."""

    answer: ClassVar[dict] = {}
    path_wanted: ClassVar[str] = ""
    seen: ClassVar[list] = []

    def do_GET(self):
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        found = self.path == self.path_wanted
        body = json.dumps(self.answer if found else {"detail": "no such version"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_fuse_from_a_server(files, cal, tmp_path, monkeypatch, capsys):
    params = cal.to_params()
    del params["kind"]  # format 1 had none: the version's kind column fills it in
    _Version.answer = {"status": "succeeded", "kind": "logits", "params": params}
    _Version.path_wanted = "/v1/models/my%20model/calibrators/2"
    _Version.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Version)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv(exports.KEY_VARIABLE, "wt_secret")
    try:
        model, out = files[0], tmp_path / "fused.onnx"
        argv = ["fuse", str(model), "--url", url, "--model", "my model", "-o", str(out)]
        assert cli.main([*argv, "--version", "2"]) == 0
        _check_fused(out, cal)
        assert _Version.seen == [(_Version.path_wanted, "Bearer wt_secret")]
        assert cli.main([*argv, "--version", "3"]) == 2
        assert "HTTP 404" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_triton_entry_and_ensemble(files, tmp_path, capsys):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format

    params, repo = files[1], tmp_path / "repo"
    argv = ["triton", "--params", str(params), "--name", "cal", "-o", str(repo)]
    assert cli.main([*argv, "--ensemble", "pipeline", "--user-model", "net",
                     "--user-output", "scores", "--user-input", "x:FP32:-1,3"]) == 0
    configs = {name: text_format.Parse((repo / name / "config.pbtxt").read_text(),
                                       model_config_pb2.ModelConfig())
               for name in ("cal", "pipeline")}
    assert (repo / "cal" / "1" / "model.onnx").is_file()
    assert configs["pipeline"].ensemble_scheduling.step[1].model_name == "cal"
    assert [t.name for t in configs["pipeline"].input] == ["x"]
    assert cli.main([*argv, "--ensemble", "pipeline"]) == 2
    assert "an ensemble needs" in capsys.readouterr().err
    assert cli.main([*argv[:-4], "--name", "a/b", "-o", str(repo)]) == 2
