"""Every method as a torch module (calibrators.torch_export): parity with numpy, and
torch.export / TorchScript."""

from __future__ import annotations

import io

import numpy as np
import pytest

import calibrators
from calibrators import KindError
from calibrators.base import Calibrator
from tests.calibrators.helpers import FIT_OPTIONS, labelled_logits, perturbed
from tests.oracles import softmax

torch = pytest.importorskip("torch")
from calibrators.torch_export import to_torch  # noqa: E402 (needs torch)

#: Largest allowed |torch - numpy| on the float outputs (float32 outputs, like ONNX).
ATOL = 1e-6
K = 5


@pytest.fixture(scope="module")
def fitted() -> dict[str, Calibrator]:
    z, y = labelled_logits(150, K, seed=7)
    rng = np.random.default_rng(0)
    return {m: perturbed(calibrators.create(m, **FIT_OPTIONS[m]).fit(z, y), rng)
            for m in calibrators.METHODS}


def _scores(n: int = 40, seed: int = 11) -> np.ndarray:
    z = labelled_logits(n, K, seed=seed)[0]
    z[0, 2] = z[0].max() - 2e3  # a logit far below the rest: the floored features
    z[1] += 500.0  # a large per-row constant
    return z


def _expected(cal: Calibrator, scores: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    p = cal.predict_proba(scores, kind=kind)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return {"probabilities": p, "confidence": p.max(axis=1), "label": p.argmax(axis=1),
            "entropy": -plogp.sum(axis=1)}


def _assert_outputs(got, want: dict, atol: float = ATOL) -> None:
    p, confidence, label, entropy = (t.detach().numpy() for t in got)
    assert label.dtype == np.int64
    for name, value in (("probabilities", p), ("confidence", confidence),
                        ("entropy", entropy)):
        np.testing.assert_allclose(value, want[name], rtol=0, atol=atol, err_msg=name)
    np.testing.assert_array_equal(label, want["label"])


@pytest.mark.parametrize("method", calibrators.METHODS)
def test_parity_with_numpy_on_logits_and_probabilities(method, fitted):
    cal = fitted[method]
    z = _scores()
    module = to_torch(cal)
    assert not list(module.parameters())
    _assert_outputs(module(torch.from_numpy(z)), _expected(cal, z, "logits"))
    _assert_outputs(module(torch.from_numpy(z.astype(np.float32))),
                    _expected(cal, z.astype(np.float32), "logits"))
    p = softmax(z)
    p[2, 1] = 0.0  # a zero probability: floored like the numpy path
    p[2] /= p[2].sum()
    by_probabilities = to_torch(cal, "probabilities", dtype=torch.float64)
    got = by_probabilities(torch.from_numpy(p))
    assert got[0].dtype == torch.float64
    # float64 outputs: the same arithmetic as numpy, so far closer than float32 rounding
    _assert_outputs(got, _expected(cal, p, "probabilities"), atol=1e-10)


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("method", calibrators.METHODS)
def test_torch_export_and_script(method, fitted):
    module = to_torch(fitted[method])
    z = torch.from_numpy(_scores(n=30).astype(np.float32))
    eager = module(z)
    exported = torch.export.export(module, (z[:4],),
                                   dynamic_shapes=({0: torch.export.Dim("N")},))
    for got in (exported.module()(z), torch.jit.script(module)(z)):
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.jit.load(buffer)(z)[0], eager[0], rtol=0, atol=0)


def test_format_1_vector_keeps_its_kind():
    """A format 1 vector map reads raw logits: one kind only, in torch as in numpy."""
    params = {"format": "welltempered.calibrator/1", "method": "vector", "n_classes": 3,
              "kind": "logits", "weight": [1.0, 2.0, 0.5], "bias": [0.1, 0.0, -0.2]}
    cal = calibrators.from_params(params)
    z = labelled_logits(10, 3)[0]
    _assert_outputs(to_torch(cal)(torch.from_numpy(z)), _expected(cal, z, "logits"))
    with pytest.raises(KindError, match="kind='probabilities'"):
        to_torch(cal, "probabilities")


def test_refuses_what_it_cannot_export(fitted):
    class Halve(Calibrator):
        method = "halve"

        def _fit(self, x, y, *, kind, options, progress):
            return {}

        def _forward(self, z):
            return 0.5 * z

    z, y = labelled_logits(20, 3)
    with pytest.raises(TypeError, match=r"to_torch exports .*Got Halve\."):
        to_torch(Halve().fit(z, y))
    with pytest.raises(calibrators.NotFittedError):
        to_torch(calibrators.create("temperature"))
    with pytest.raises(calibrators.CalibrationInputError, match="kind"):
        to_torch(fitted["temperature"], "log-odds")
