"""service.offline, the ``welltempered fit`` CLI: run in-process on synthetic
and real files, its JSON checked against metrics/checks computed here on the same
split, the array-name and kind rules, the rounding of the split, every user error
(exit 2, one line on stderr, no traceback), and ``--demo``."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from calibrators import METHODS, create
from calibrators.evaluation.checks import argmax_report
from calibrators.evaluation.holdout import split_indices
from calibrators.evaluation.metrics import report
from service import offline
from service.jobs.fitting import fit_job
from service.offline import main
from service.vocabulary import AUTO, DEFAULT_ARGMAX_POLICY
from tests.helpers import DATA_DIR
from tests.oracles import softmax

N, K = 90, 4  # K >= 3, N != K


def _synthetic(seed: int = 1):
    """Over-confident logits (labels drawn from softmax(z / 2)) of shape (N, K)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(N, K)) * 3.0
    p = np.exp(z / 2.0)
    p /= p.sum(axis=1, keepdims=True)
    y = np.minimum((rng.random(N)[:, None] > np.cumsum(p, axis=1)).sum(axis=1), K - 1)
    return z.astype(np.float32), y.astype(np.int64)


@pytest.fixture
def logits_npz(tmp_path):
    z, y = _synthetic()
    path = tmp_path / "synthetic.npz"
    np.savez(path, logits=z, labels=y)
    return path


def _strict_json(path):
    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=reject)


def _split(n, holdout=0.2, seed=0):
    # The rule of calibrators.evaluation.holdout, written out independently.
    perm = np.random.default_rng(seed).permutation(n)
    n_fit = n - round(n * holdout)
    return perm[:n_fit], perm[n_fit:]


def _error(capsys, argv) -> str:
    """Run ``main(argv)``, expect exit 2 and one line on stderr; return that line."""
    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("welltempered fit: error: ")
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------
# synthetic data, every method


@pytest.mark.parametrize("method", [*METHODS, "all"])
def test_each_method_prints_a_table_and_writes_json(method, logits_npz, tmp_path, capsys):
    out_path = tmp_path / "out.json"
    assert main([str(logits_npz), "--method", method, "--json", str(out_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    expected = list(METHODS) if method == "all" else [method]
    table_rows = [line.split()[0] for line in out.splitlines() if line[:1].isalpha()]
    for name in ["uncalibrated", *expected]:
        assert name in table_rows
    assert "kind=logits" in out

    result = _strict_json(out_path)
    assert list(result["methods"]) == expected
    assert (result["n"], result["n_classes"], result["kind"]) == (N, K, "logits")
    assert (result["n_fit"], result["n_holdout"]) == (N - round(0.2 * N), round(0.2 * N))
    assert result["arrays"] == {"scores": "logits", "labels": "labels"}
    for name, entry in result["methods"].items():
        assert set(entry) == {"report", "argmax", "fit_seconds", "params"}
        assert entry["params"]["method"] == name
        assert entry["report"]["n"] == entry["argmax"]["n"] == round(0.2 * N)
        assert entry["fit_seconds"] >= 0
        changes = entry["argmax"]["changed_from_rank"]
        assert sum(changes.values()) == entry["argmax"]["changed"]
    if "temperature" in result["methods"]:
        t = result["methods"]["temperature"]
        assert t["argmax"]["changed"] == 0
        assert f"T = {1 / t['params']['weight']:.6g}" in out


@pytest.mark.parametrize("method", ["svs", "sms"])
def test_structured_summary_names_the_multipliers(method, logits_npz, capsys):
    assert main([str(logits_npz), "--method", method]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines()
                if line.startswith(method + " ") and "L-BFGS" in line)
    assert "reg_diagonal = " in line and "reg_intercept = " in line
    assert ("reg_off_diagonal = " in line) == (method == "sms")
    assert "x the paper's rule (chosen by 4-fold CV); T = " in line
    assert "reg_mu" not in line  # not ODIR's field, which these methods do not have


@pytest.mark.parametrize("holdout,seed", [(0.5, 0), (0.3, 7)])
def test_json_numbers_equal_a_fit_and_report_made_here(holdout, seed, logits_npz, tmp_path):
    out_path = tmp_path / "out.json"
    argv = [str(logits_npz), "--method", "vector", "--holdout", str(holdout),
            "--seed", str(seed), "--json", str(out_path)]
    assert main(argv) == 0
    result = _strict_json(out_path)

    z, y = _synthetic()
    fit_idx, test_idx = _split(N, holdout, seed)
    assert (result["n_fit"], result["n_holdout"]) == (len(fit_idx), len(test_idx))
    expected = report(softmax(z[test_idx]), y[test_idx])
    got = result["uncalibrated"]
    assert got.keys() == expected.keys()
    assert got["bins"]["count"] == expected["bins"]["count"]
    for key, value in expected.items():
        if key != "bins":
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    cal = create("vector").fit(z[fit_idx], y[fit_idx])
    probs = cal.predict_proba(z[test_idx])
    vector = result["methods"]["vector"]
    assert vector["report"] == report(probs, y[test_idx])
    assert vector["argmax"] == argmax_report(z[test_idx], probs)
    assert vector["params"]["weight"] == cal.to_params()["weight"]


def test_matrix_and_dirichlet_with_probabilities_input(tmp_path, capsys):
    z, y = _synthetic(seed=3)
    path = tmp_path / "probs.npz"
    np.savez(path, probabilities=softmax(z), labels=y)
    out_path = tmp_path / "out.json"
    assert main([str(path), "--method", "dirichlet", "--json", str(out_path)]) == 0
    result = _strict_json(out_path)
    assert result["kind"] == "probabilities"
    fit_idx, test_idx = _split(N)
    p = softmax(z)
    cal = create("dirichlet").fit(p[fit_idx], y[fit_idx], kind="probabilities")
    probs = cal.predict_proba(p[test_idx], kind="probabilities")
    assert result["uncalibrated"] == report(p[test_idx], y[test_idx])
    assert result["methods"]["dirichlet"]["report"] == report(probs, y[test_idx])
    assert "reg_lambda =" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# the real data


@pytest.mark.parametrize("method", ["temperature", "vector"])
def test_lenet_cifar10(method, cifar10, tmp_path, capsys):
    out_path = tmp_path / "out.json"
    path = DATA_DIR / "lenet-5-cifar-10.npz"
    argv = [str(path), "--method", method, "--holdout", "0.5", "--json", str(out_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "'predictions', 'ground_truth'" in out
    result = _strict_json(out_path)
    assert result["arrays"] == {"scores": "predictions", "labels": "ground_truth"}
    assert (result["kind"], result["n"], result["n_classes"]) == ("probabilities", 10000, 10)
    # --holdout 0.5 with seed 0 is the shared-data convention of tests/conftest.py.
    probs_test, labels_test = cifar10.test
    assert result["uncalibrated"] == report(probs_test, labels_test)
    cal = create(method).fit(*cifar10.fit, kind="probabilities")
    after = cal.predict_proba(probs_test, kind="probabilities")
    entry = result["methods"][method]
    assert entry["report"] == report(after, labels_test)
    assert entry["argmax"] == argmax_report(probs_test, after, kind="probabilities")
    assert entry["report"]["nll"] < result["uncalibrated"]["nll"]
    if method == "temperature":
        assert entry["argmax"]["changed"] == 0


# ---------------------------------------------------------------------------
# array names and kinds


@pytest.mark.parametrize(
    "arrays,kind_flag,expected",
    [
        ({"logits", "probabilities"}, None, ("logits", "logits")),
        ({"logits", "probabilities"}, "probabilities", ("probabilities", "probabilities")),
        ({"logits", "predictions"}, "probabilities", ("predictions", "probabilities")),
        ({"predictions"}, None, ("predictions", "probabilities")),
        ({"predictions"}, "logits", ("predictions", "logits")),  # --kind overrides the name
        ({"logits"}, "logits", ("logits", "logits")),
    ],
)
def test_score_array_and_kind_resolution(arrays, kind_flag, expected, tmp_path):
    z, y = _synthetic()
    data = {name: (z if name == "logits" else softmax(z)) for name in arrays}
    path = tmp_path / "in.npz"
    np.savez(path, ground_truth=y, **data)
    out_path = tmp_path / "out.json"
    argv = [str(path), "--json", str(out_path)] + (["--kind", kind_flag] if kind_flag else [])
    assert main(argv) == 0
    result = _strict_json(out_path)
    assert (result["arrays"]["scores"], result["kind"]) == expected
    assert result["arrays"]["labels"] == "ground_truth"


@pytest.mark.parametrize(
    "n,holdout,n_fit",
    [(10, 0.5, 5), (10, 0.3, 7), (5, 0.5, 3), (7, 0.5, 3), (4, 0.5, 2), (1000, 0.25, 750)],
)
def test_split_rounds_the_holdout_with_python_round(n, holdout, n_fit):
    fit_idx, test_idx = split_indices(n, holdout, seed=3)
    assert len(fit_idx) == n_fit == n - round(n * holdout)
    perm = np.random.default_rng(3).permutation(n)
    np.testing.assert_array_equal(np.concatenate([fit_idx, test_idx]), perm)


# ---------------------------------------------------------------------------
# errors: exit 2, one line, no traceback


def test_missing_file(tmp_path, capsys):
    line = _error(capsys, [tmp_path / "nope.npz"])
    assert "no such file" in line


def test_not_an_npz(tmp_path, capsys):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip archive")
    assert "cannot read" in _error(capsys, [garbage])
    npy = tmp_path / "array.npy"
    np.save(npy, np.zeros((4, 3)))
    assert "not a .npz archive" in _error(capsys, [npy])


def test_missing_score_array(tmp_path, capsys):
    path = tmp_path / "in.npz"
    np.savez(path, scores=np.zeros((5, 3)), labels=np.zeros(5, dtype=int))
    line = _error(capsys, [path])
    assert "no score array" in line and "'scores'" in line


def test_missing_label_array(tmp_path, capsys):
    path = tmp_path / "in.npz"
    np.savez(path, logits=np.zeros((5, 3)), targets=np.zeros(5, dtype=int))
    line = _error(capsys, [path])
    assert "no label array" in line and "'targets'" in line


@pytest.mark.parametrize("holdout", ["0", "1", "1.5", "-0.2", "nan"])
def test_bad_holdout(holdout, logits_npz, capsys):
    line = _error(capsys, [logits_npz, "--holdout", holdout])
    assert "holdout must be a fraction in (0, 1)" in line


def test_holdout_leaving_an_empty_part(tmp_path, capsys):
    path = tmp_path / "tiny.npz"
    np.savez(path, logits=np.eye(4, 3), labels=np.arange(4) % 3)
    line = _error(capsys, [path, "--holdout", "0.1"])
    assert "both parts need rows" in line


def test_nan_in_logits(tmp_path, capsys):
    z, y = _synthetic()
    z[17, 2] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, logits=z, labels=y)
    line = _error(capsys, [path])
    assert "finite" in line and "row 17" in line


def test_bad_labels_and_bad_probabilities(tmp_path, capsys):
    z, y = _synthetic()
    y[4] = K
    path = tmp_path / "labels.npz"
    np.savez(path, logits=z, labels=y)
    assert "labels must be integers in [0, 4)" in _error(capsys, [path])
    path = tmp_path / "probs.npz"
    np.savez(path, probabilities=z, labels=_synthetic()[1])  # logits named as probabilities
    assert "probabilities" in _error(capsys, [path])


def test_a_method_that_cannot_fit_names_itself(tmp_path, capsys):
    z, y = _synthetic()
    path = tmp_path / "small.npz"
    np.savez(path, logits=z[:8], labels=y[:8])  # 4 fit rows: too few for 3-fold CV
    line = _error(capsys, [path, "--method", "matrix", "--holdout", "0.5"])
    assert "matrix: cross-validating the penalties needs at least 6 rows" in line


def test_file_and_demo_together_or_neither(logits_npz, capsys):
    assert "not both" in _error(capsys, [logits_npz, "--demo"])
    assert "FILE.npz is required" in _error(capsys, [])


def test_unwritable_json(logits_npz, tmp_path, capsys):
    assert main([str(logits_npz), "--json", str(tmp_path / "missing-dir" / "out.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot write --json" in err and "Traceback" not in err


def test_auto_chooses_what_the_service_would(logits_npz, tmp_path, capsys):
    # issue 24: the CLI offered `all` but not `auto`, the service `auto` but not `all`
    out_path = tmp_path / "auto.json"
    assert main([str(logits_npz), "--method", "auto", "--json", str(out_path)]) == 0
    result = _strict_json(out_path)
    with np.load(logits_npz) as f:
        served = fit_job(
            f["logits"], f["labels"], kind="logits", method=AUTO, holdout=0.2, seed=0,
            options={}, argmax_policy=DEFAULT_ARGMAX_POLICY,
        )
    assert list(result["methods"]) == list(served["candidates"])
    assert result["chosen"] == served["chosen_method"]
    for name, m in result["methods"].items():
        assert m["report"]["nll"] == pytest.approx(served["candidates"][name]["metrics"]["nll"])
    assert f"auto: {served['chosen_method']} " in capsys.readouterr().out


def test_usage_errors_return_2(capsys):
    assert main(["x.npz", "--method", "platt"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--holdout" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# the demo and the entry points


def test_demo_npz_is_deterministic_logits(tmp_path):
    a = offline.demo_npz(tmp_path / "a.npz")
    b = offline.demo_npz(str(tmp_path / "b.npz"))
    assert a == tmp_path / "a.npz" and b.exists()
    with np.load(a) as fa, np.load(b) as fb:
        assert set(fa.files) == {"logits", "labels"}
        np.testing.assert_array_equal(fa["logits"], fb["logits"])
        np.testing.assert_array_equal(fa["labels"], fb["labels"])
        logits, labels = fa["logits"], fa["labels"]
    assert logits.shape == (899, 10) and labels.shape == (899,)
    assert (logits.argmax(axis=1) == labels).mean() > 0.9


def test_demo_flag(tmp_path, capsys):
    out_path = tmp_path / "demo.json"
    assert main(["--demo", "--method", "temperature", "--json", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "scikit-learn digits" in out and "temperature" in out
    result = _strict_json(out_path)
    assert (result["n"], result["n_classes"], result["kind"]) == (899, 10, "logits")
    temperature = result["methods"]["temperature"]
    assert temperature["report"]["nll"] < result["uncalibrated"]["nll"]


def test_welltempered_fit_subcommand(logits_npz, capsys):
    cli = pytest.importorskip("service.cli")
    assert cli.main(["fit", str(logits_npz), "--method", "temperature"]) == 0
    assert "temperature" in capsys.readouterr().out


@pytest.mark.process
def test_python_dash_m(logits_npz):
    proc = subprocess.run(
        [sys.executable, "-m", "service.offline", str(logits_npz), "--holdout", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("welltempered fit: error: holdout must be")


def test_sequence_ids_split_by_sequence_and_report_per_sequence(tmp_path):
    rng = np.random.default_rng(9)
    sizes = rng.integers(1, 25, 40)
    sequences = np.repeat([f"text-{i}" for i in range(40)], sizes)
    n = len(sequences)
    labels = rng.integers(0, 5, n)
    logits = rng.normal(size=(n, 5)) * 3
    logits[np.arange(n), labels] += 2
    path = tmp_path / "tokens.npz"
    np.savez(path, logits=logits, labels=labels, sequence_ids=sequences)
    out = tmp_path / "out.json"
    assert main([str(path), "--method", "temperature", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["arrays"]["sequences"] == "sequence_ids" and result["n_sequences"] == 40
    fit_idx, test_idx = split_indices(n, 0.2, 0, groups=sequences)
    assert not set(sequences[fit_idx]) & set(sequences[test_idx])
    assert result["n_holdout"] == len(test_idx)
    got = result["methods"]["temperature"]["report"]["sequences"]
    assert got["sequences"]["count"] == len(set(sequences[test_idx]))
    assert got["tokens"]["count"] == len(test_idx)
    assert "sequences" in result["uncalibrated"]
