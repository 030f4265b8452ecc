"""service.observe.svg: the reliability diagram is valid XML with the structure it promises."""

from __future__ import annotations

import doctest
import io
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from calibrators import TemperatureScaler
from calibrators.evaluation import metrics
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
    fullest = max(max(item["bins"]["count"]) for item in before_after)
    assert f"fullest bin: {fullest:,} rows" in words


def test_bars_fade_with_their_rows(before_after):
    """A bar's fill opacity grows with its bin's rows, relative to its series' fullest bin."""
    root = parse(reliability_svg(before_after, "t"))
    for i in range(len(before_after)):
        bars = group(root, "series", i).findall("svg:rect[@class='bar']", NS)
        counts = [int(r.get("data-count")) for r in bars]
        opacity = [float(r.get("fill-opacity")) for r in bars]
        order = np.argsort(counts, kind="stable")
        assert np.all(np.diff(np.array(opacity)[order]) >= 0)
        assert opacity[int(np.argmax(counts))] == svg_module._FULL
        assert svg_module._FADED <= min(opacity) < 0.3  # a bin of a few rows is faint


def test_count_panel_is_log_scaled(before_after):
    """Count heights are affine in log10(rows), and a bin of one row still shows."""
    one = {"edges": [0.0, 0.5, 1.0], "count": [1, 10_000], "mean_confidence": [0.3, 0.9],
           "accuracy": [0.0, 0.9]}  # fmt: skip
    for series in (before_after, [{"label": "x", "bins": one}]):
        root = parse(reliability_svg(series, "t"))
        rects = [r for i in range(len(series))
                 for r in group(root, "counts", i).findall("svg:rect", NS)]  # fmt: skip
        logs = np.log10([int(r.get("data-count")) for r in rects])
        heights = np.array([float(r.get("height")) for r in rects])
        slope, intercept = np.polyfit(logs, heights, 1)
        np.testing.assert_allclose(heights, slope * logs + intercept, atol=0.01)
        assert min(heights) > 3
        decades = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")
                   if t.get("class") == "decade"]  # fmt: skip
        assert decades[:3] == ["1", "10", "100"]


def test_legend_explains_the_marks(before_after):
    root = parse(reliability_svg(before_after, "t"))
    key = texts(root.find("svg:g[@class='legend']/svg:g[@class='key']", NS))
    assert "perfect calibration" in key
    assert "mean confidence" in key and "accuracy" in key
    assert "rows in the bin" in key and "fullest bin" in key
    ramp = [float(r.get("fill-opacity")) for r in root.iter("{http://www.w3.org/2000/svg}rect")
            if r.get("class") == "ramp"]  # fmt: skip
    assert ramp == sorted(ramp) and ramp[-1] == svg_module._FULL


def _png_pixels(svg: str, scale: float) -> tuple[np.ndarray, bytes]:
    """Render with cairosvg (Cairo) and decode the PNG with Cairo: (height, width, RGB)."""
    try:  # the dev extra's cairosvg, over the system's Cairo (libcairo2)
        import cairocffi
        import cairosvg
    except (ImportError, OSError) as exc:  # cairocffi raises OSError without libcairo
        pytest.skip(f"cairosvg cannot render here: {exc}")
    png = cairosvg.svg2png(bytestring=svg.encode(), scale=scale)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    surface = cairocffi.ImageSurface.create_from_png(io.BytesIO(png))
    h, w, stride = surface.get_height(), surface.get_width(), surface.get_stride()
    bgra = np.frombuffer(bytes(surface.get_data()), np.uint8).reshape(h, stride)[:, : 4 * w]
    return bgra.reshape(h, w, 4)[:, :, 2::-1].astype(int), png


def test_rendered_png(before_after, tmp_path):
    """A real renderer draws what the SVG promises: the fullest bin's bar is a strong
    colour and a bin of few rows a pale one; a long title stays inside the image."""
    scale = 2.0
    svg = reliability_svg(before_after, "wideresnet-16-4-cifar-100 v1 (hold-out)")
    root = parse(svg)
    pixels, png = _png_pixels(svg, scale)
    (tmp_path / "reliability.png").write_bytes(png)
    assert pixels.shape[:2] == (round(float(root.get("height")) * scale),
                                round(float(root.get("width")) * scale))  # fmt: skip

    def centre(rect: ET.Element) -> np.ndarray:
        """The pixel at the middle of a bar, three quarters down (below the tick)."""
        cx = float(rect.get("x")) + float(rect.get("width")) / 2
        cy = float(rect.get("y")) + float(rect.get("height")) * 0.75
        return pixels[round(cy * scale), round(cx * scale)]

    for i in range(len(before_after)):
        bars = [r for r in group(root, "series", i).findall("svg:rect[@class='bar']", NS)
                if float(r.get("height")) > 20]  # fmt: skip
        counts = [int(r.get("data-count")) for r in bars]
        full = centre(bars[int(np.argmax(counts))])
        faint = centre(bars[int(np.argmin(counts))])
        colour = np.array([int(svg_module.PALETTE[i][k : k + 2], 16) for k in (1, 3, 5)])
        assert np.abs(full - colour).max() < 60  # close to the series' colour
        assert faint.sum() > full.sum() + 150  # much paler (closer to white)
        assert faint.min() > full.min()
        counts_rects = group(root, "counts", i).findall("svg:rect[@class='count']", NS)
        assert np.abs(centre(counts_rects[-1]) - colour).max() < 60

    long = "a-model-with-a-rather-long-name-from-a-registry-somewhere v12: hold-out reliability"
    pixels, _ = _png_pixels(reliability_svg(before_after, long), scale)
    band = pixels[: round(36 * scale)]
    assert (band < 200).any()  # the title is drawn
    assert (band[:, :4] == 255).all() and (band[:, -4:] == 255).all()  # and not clipped


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
