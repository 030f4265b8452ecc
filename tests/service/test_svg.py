"""service.observe.svg: the reliability diagram is valid XML with the structure it promises."""

from __future__ import annotations

import doctest
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from calibrators import TemperatureScaler, metrics
from service.observe import svg as svg_module
from service.observe.svg import reliability_svg

NS = {"svg": "http://www.w3.org/2000/svg"}


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root


def group(root: ET.Element, cls: str, index: int) -> ET.Element:
    (g,) = [
        g
        for g in root.iter("{http://www.w3.org/2000/svg}g")
        if g.get("class") == cls and g.get("data-series") == str(index)
    ]
    return g


def texts(root: ET.Element) -> str:
    return " ".join(t.text or "" for t in root.iter() if t.tag.endswith(("text", "title")))


@pytest.fixture
def before_after(cifar100):
    fit_probs, fit_labels = cifar100.fit
    probs, labels = cifar100.test
    cal = TemperatureScaler().fit(np.log(fit_probs), fit_labels)
    before = metrics.report(probs, labels)
    after = metrics.report(cal.predict_proba(np.log(probs)), labels)
    return [
        {"label": "before", "bins": before["bins"], "ece": before["ece"]},
        {"label": "after", "bins": after["bins"], "ece": after["ece"]},
    ]


def test_before_vs_after_on_cifar100(before_after):
    svg = reliability_svg(before_after, "wideresnet-16-4-cifar-100 v1 (hold-out)")
    root = parse(svg)
    assert root.find("svg:title", NS).text == "wideresnet-16-4-cifar-100 v1 (hold-out)"
    assert root.findall(".//svg:line[@class='diagonal']", NS)
    words = texts(root)
    assert "wideresnet-16-4-cifar-100 v1 (hold-out)" in words
    assert "accuracy" in words and "confidence (maximum probability)" in words
    legend = " ".join(t.text for t in root.find("svg:g[@class='legend']", NS).iter() if t.text)
    for item in before_after:
        assert f"{item['label']} \N{EM DASH} ECE {item['ece']:.4f}" in legend
    # the reliability panel's frame: the first rect of the axes group
    plot_height = float(root.find("svg:g[@class='axes']/svg:rect", NS).get("height"))
    for i, item in enumerate(before_after):
        counts = item["bins"]["count"]
        non_empty = sum(1 for c in counts if c > 0)
        bars = group(root, "series", i).findall("svg:rect[@class='bar']", NS)
        assert len(bars) == non_empty
        count_rects = group(root, "counts", i).findall("svg:rect[@class='count']", NS)
        assert [int(r.get("data-count")) for r in count_rects] == [c for c in counts if c > 0]
        # bar heights are the accuracies, on the same scale as the axes
        accuracies = [a for a, c in zip(item["bins"]["accuracy"], counts, strict=True) if c > 0]
        heights = [float(r.get("height")) for r in bars]
        np.testing.assert_allclose(heights, np.array(accuracies) * plot_height, atol=0.01)
        assert all(f"{c} rows" in r.find("svg:title", NS).text for r, c in
                   zip(count_rects, [c for c in counts if c > 0], strict=True))  # fmt: skip
    assert str(max(max(item["bins"]["count"]) for item in before_after)) in words


def test_text_is_escaped():
    bins = {"edges": [0.0, 0.5, 1.0], "count": [2, 0], "mean_confidence": [0.4, None],
            "accuracy": [0.5, None]}  # fmt: skip
    title = 'model <"x"> & v2'
    svg = reliability_svg([{"label": "live </svg> & co", "bins": bins, "ece": None}], title)
    root = parse(svg)
    assert root.get("aria-label") == title
    assert root.find("svg:title", NS).text == title
    assert group(root, "series", 0).get("data-label") == "live </svg> & co"
    assert "ECE" not in texts(root.find("svg:g[@class='legend']", NS))


def test_empty_bins_and_a_live_window_without_rows():
    bins = {"edges": list(np.linspace(0, 1, 16)), "count": [0] * 15,
            "mean_confidence": [None] * 15, "accuracy": [None] * 15}  # fmt: skip
    root = parse(reliability_svg([{"label": "live 1h", "bins": bins, "ece": None}], "live"))
    assert group(root, "series", 0).findall("svg:rect", NS) == []
    assert group(root, "counts", 0).findall("svg:rect", NS) == []


@pytest.mark.parametrize(
    "series",
    [
        [],
        {"label": "x"},
        [{"label": "no bins"}],
        [
            {
                "label": "short",
                "bins": {
                    "edges": [0, 1],
                    "count": [1, 2],
                    "mean_confidence": [0.5, 0.5],
                    "accuracy": [1, 1],
                },
            }
        ],
    ],
)
def test_malformed_series_raise(series):
    with pytest.raises(ValueError, match="Got"):
        reliability_svg(series, "t")


def test_docstring_examples():
    result = doctest.testmod(svg_module)
    assert result.attempted > 0 and result.failed == 0
