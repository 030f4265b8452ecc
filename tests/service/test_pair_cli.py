"""``welltempered compare A.npz B.npz`` (service/pair.py) end to end through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from calibrators.evaluation.pair import temperature_explains
from service.cli import main
from tests.oracles import softmax


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(5)
    z = rng.normal(size=(400, 9)) * 2
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(a, logits=z)
    np.savez(b, probabilities=softmax(0.4 * z))  # B is A at temperature 2.5
    return a, b, z


def test_b_tempered_a_is_all_explained(pair, tmp_path, capsys):
    a, b, z = pair
    out = tmp_path / "out.json"
    assert main(["compare", str(a), str(b), "--top-k", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "beta = 0.4000 (temperature 2.5000)" in printed
    result = json.loads(out.read_text())
    want = temperature_explains(z, softmax(0.4 * z), kind_b="probabilities", top_k=4)
    assert result == want  # JSON keeps every float exactly
    assert result["explained"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: np.savez(d / "x.npz", labels=np.zeros(3)), "no score array"),
        (lambda d: np.save(d / "x.npz", np.zeros((3, 3))), "cannot read"),
        (lambda d: np.savez(d / "x.npz", logits=np.zeros((5, 9))), "same shape"),
    ],
)
def test_bad_files_exit_2_with_one_line(pair, tmp_path, capsys, make, words):
    a, _, _ = pair
    make(tmp_path)
    bad = tmp_path / "x.npz"
    if not bad.exists():
        (tmp_path / "x.npz.npy").rename(bad)
    assert main(["compare", str(a), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("welltempered compare: error:") and words in err
    assert "\n" not in err
