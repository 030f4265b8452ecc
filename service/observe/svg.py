"""Reliability diagrams as hand-written SVG (no plotting library, no state).

:func:`reliability_svg` draws one or more series (e.g. hold-out before vs after
calibration, or the live window) on one chart:

* top panel: the diagonal ``accuracy = confidence`` (dashed), and per series
  one bar per non-empty bin from 0 up to the bin's accuracy, the bars of the
  series side by side inside the bin; a tick on each bar marks the bin's mean
  confidence, so the gap to the diagonal reads directly. Each bar is outlined
  in its series' colour and filled with an opacity that grows with its rows
  (``sqrt(count / fullest bin of the series)``, from 0.12 to 0.9), so the bins
  that carry the ECE stand out and a bin of three rows reads as the anecdote
  it is;
* bottom panel: the rows per bin of each series on a log scale (decades
  marked, from 1 row), with the largest count written beside it;
* a legend with each series' label, ECE and rows, and a key of the marks: the
  dashed diagonal, the mean-confidence tick, and the fill opacity.

Every bar has a ``<title>`` (a tooltip in browsers) with the bin, its count,
accuracy and mean confidence. Text goes through XML escaping, so labels and
titles from users cannot break the document. Structure for tests and styling:
each series is a ``<g class="series" data-series="i" data-label="...">`` holding
``<rect class="bar">`` elements (``data-count`` and ``fill-opacity`` on each),
its counts are ``<rect class="count">`` in a ``<g class="counts"
data-series="i">``, the legend is ``<g class="legend">`` and its key of the
marks ``<g class="key">``.

The input is the ``bins`` dict of :func:`calibrators.evaluation.metrics.report` (or of
``ece_from_bin_statistics``): ``edges``, ``count``, ``mean_confidence`` and
``accuracy`` (``None`` for an empty bin).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape, quoteattr

__all__ = ["CONTENT_TYPE", "reliability_svg"]

CONTENT_TYPE = "image/svg+xml"

#: Colour-blind-safe (Okabe-Ito) colours, cycled over the series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00")

_WIDTH = 540
_LEFT, _RIGHT = 64, 24
_PLOT = _WIDTH - _LEFT - _RIGHT  # the reliability panel is a _PLOT x _PLOT square
_TITLE_Y, _TITLE_SIZE = 26, 15
_LEGEND_TOP, _LEGEND_ROW = 44, 20
_GAP, _HIST = 24, 100
_BOTTOM = 48
#: Fill opacity of a bar: from _FADED (a bin of almost no rows) to _FULL (the
#: fullest bin of its series), growing as the square root of the rows.
_FADED, _FULL = 0.12, 0.9


def _opacity(count: int, fullest: int) -> float:
    """A bar's fill opacity for ``count`` rows when its series' fullest bin has ``fullest``."""
    share = count / fullest if fullest > 0 else 0.0
    return round(_FADED + (_FULL - _FADED) * share**0.5, 3)


def _num(x: float) -> str:
    """Coordinates with 2 decimals, no trailing zeros."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _check_series(series) -> list[dict]:
    if isinstance(series, Mapping) or not isinstance(series, Sequence) or not series:
        raise ValueError(f"series must be a non-empty list of dicts. Got {series!r}.")
    out = []
    for i, item in enumerate(series):
        if not isinstance(item, Mapping) or "bins" not in item:
            raise ValueError(f"series[{i}] must be a dict with 'label' and 'bins'. Got {item!r}.")
        bins = item["bins"]
        keys = ("edges", "count", "mean_confidence", "accuracy")
        if not isinstance(bins, Mapping) or any(k not in bins for k in keys):
            raise ValueError(f"series[{i}]['bins'] must have {', '.join(keys)}. Got {bins!r}.")
        n_bins = len(bins["count"])
        if len(bins["edges"]) != n_bins + 1 or any(
            len(bins[k]) != n_bins for k in ("mean_confidence", "accuracy")
        ):
            raise ValueError(
                f"series[{i}]['bins'] must have n_bins + 1 edges and n_bins of everything "
                f"else. Got {len(bins['edges'])} edges and {n_bins} counts."
            )
        ece = item.get("ece")
        out.append(
            {
                "label": str(item.get("label", f"series {i + 1}")),
                "ece": None if ece is None else float(ece),
                "edges": [float(e) for e in bins["edges"]],
                "count": [int(c) for c in bins["count"]],
                "confidence": [None if v is None else float(v) for v in bins["mean_confidence"]],
                "accuracy": [None if v is None else float(v) for v in bins["accuracy"]],
            }
        )
    return out


def reliability_svg(series: Sequence[Mapping], title: str) -> str:
    """A reliability diagram with bin counts, as an SVG document.

    Parameters
    ----------
    series : list of dict
        One entry per series, drawn in order: ``label`` (str), ``bins`` (the
        reliability bins of :func:`calibrators.evaluation.metrics.report`: ``edges``,
        ``count``, ``mean_confidence``, ``accuracy``) and ``ece`` (float or
        None, shown in the legend). Series may have different bins.
    title : str
        Shown at the top and as the document's ``<title>``.

    Returns
    -------
    str
        A standalone SVG 1.1 document (serve it as :data:`CONTENT_TYPE`).

    Raises
    ------
    ValueError
        When a series lacks ``bins`` or its lists have inconsistent lengths.

    Examples
    --------
    >>> bins = {"edges": [0.0, 0.5, 1.0], "count": [0, 4],
    ...         "mean_confidence": [None, 0.8], "accuracy": [None, 0.75]}
    >>> svg = reliability_svg([{"label": "after", "bins": bins, "ece": 0.05}], "m v1")
    >>> svg.startswith("<svg") and svg.count('class="bar"') == 1
    True
    """
    items = _check_series(series)
    n_series = len(items)
    key_top = _LEGEND_TOP + _LEGEND_ROW * n_series
    top = key_top + 2 * _LEGEND_ROW + 8
    hist_top = top + _PLOT + _GAP
    height = hist_top + _HIST + _BOTTOM
    left, right = _LEFT, _LEFT + _PLOT
    colours = [PALETTE[i % len(PALETTE)] for i in range(n_series)]

    def x(v: float) -> float:
        return left + min(max(v, 0.0), 1.0) * _PLOT

    def y(v: float) -> float:
        return top + (1.0 - min(max(v, 0.0), 1.0)) * _PLOT

    # the count panel: log10 of the rows, from half a row (so one row shows) up
    # to the decade above the fullest bin
    max_count = max((max(item["count"], default=0) for item in items), default=0)
    decades = max(1, math.ceil(math.log10(max_count))) if max_count > 1 else 1
    floor = math.log10(0.5)

    def count_height(count: int) -> float:
        return _HIST * (math.log10(count) - floor) / (decades - floor)

    # a long title is set smaller rather than clipped (about 0.6 em per bold glyph)
    title_size = min(_TITLE_SIZE, (_WIDTH - 16) / (0.62 * max(len(title), 1)))
    parts: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{_WIDTH}" '
        f'height="{height}" viewBox="0 0 {_WIDTH} {height}" role="img" '
        f"aria-label={quoteattr(title)} "
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect class="background" x="0" y="0" width="{_WIDTH}" height="{height}" fill="white"/>',
        f'<text class="title" x="{_WIDTH / 2}" y="{_TITLE_Y}" text-anchor="middle" '
        f'font-size="{_num(title_size)}" font-weight="bold">{escape(title)}</text>',
    ]

    # legend: one row per series, then the key of the marks
    parts.append('<g class="legend">')
    for i, item in enumerate(items):
        row = _LEGEND_TOP + _LEGEND_ROW * i
        text = item["label"] + (
            "" if item["ece"] is None else f" \N{EM DASH} ECE {item['ece']:.4f}"
        )
        n = sum(item["count"])
        parts.append(
            f'<rect x="{left}" y="{row}" width="12" height="12" fill="{colours[i]}" '
            f'fill-opacity="{_FULL}" stroke="{colours[i]}"/>'
            f'<text x="{left + 18}" y="{row + 10}">{escape(text)} (n = {n})</text>'
        )
    parts.append('<g class="key" fill="#222">')
    row = key_top + 2
    parts.append(
        f'<line x1="{left}" y1="{row + 6}" x2="{left + 22}" y2="{row + 6}" stroke="#888" '
        'stroke-width="1.5" stroke-dasharray="6 4"/>'
        f'<text x="{left + 28}" y="{row + 10}">perfect calibration</text>'
        f'<line x1="{left + 150}" y1="{row + 6}" x2="{left + 166}" y2="{row + 6}" '
        'stroke="#222" stroke-width="2"/>'
        f'<text x="{left + 172}" y="{row + 10}">'
        "the bin's mean confidence (bar: accuracy)</text>"
    )
    row = key_top + _LEGEND_ROW + 2
    ramp = (0.01, 0.1, 0.3, 0.6, 1.0)
    parts.append(f'<text x="{left}" y="{row + 10}">fill: rows in the bin, few</text>')
    ramp_left = left + 150
    for k, share in enumerate(ramp):
        parts.append(
            f'<rect class="ramp" x="{ramp_left + 16 * k}" y="{row}" width="14" height="12" '
            f'fill="{colours[0]}" fill-opacity="{_opacity(round(share * 1000), 1000)}" '
            f'stroke="{colours[0]}"/>'
        )
    parts.append(
        f'<text x="{ramp_left + 16 * len(ramp) + 4}" y="{row + 10}">as many as the '
        "series' fullest bin</text>"
    )
    parts.append("</g>")
    parts.append("</g>")

    # frames, grid and axes of both panels
    parts.append('<g class="axes" stroke="#444" fill="none">')
    parts.append(f'<rect x="{left}" y="{top}" width="{_PLOT}" height="{_PLOT}"/>')
    parts.append(f'<rect x="{left}" y="{hist_top}" width="{_PLOT}" height="{_HIST}"/>')
    parts.append("</g>")
    parts.append('<g class="grid" stroke="#ddd" stroke-width="1">')
    for k in range(1, 5):
        v = k / 5
        parts.append(
            f'<line x1="{_num(x(v))}" y1="{top}" x2="{_num(x(v))}" y2="{top + _PLOT}"/>'
            f'<line x1="{left}" y1="{_num(y(v))}" x2="{right}" y2="{_num(y(v))}"/>'
        )
    for d in range(1, decades):
        gy = _num(hist_top + _HIST - count_height(10**d))
        parts.append(f'<line x1="{left}" y1="{gy}" x2="{right}" y2="{gy}"/>')
    parts.append("</g>")
    parts.append(
        f'<line class="diagonal" x1="{x(0)}" y1="{y(0)}" x2="{x(1)}" y2="{y(1)}" '
        'stroke="#888" stroke-width="1.5" stroke-dasharray="6 4"/>'
    )
    parts.append('<g class="ticks" fill="#222">')
    for k in range(6):
        v = k / 5
        parts.append(
            f'<text x="{left - 6}" y="{_num(y(v) + 4)}" text-anchor="end">{v:.1f}</text>'
            f'<text x="{_num(x(v))}" y="{hist_top + _HIST + 16}" '
            f'text-anchor="middle">{v:.1f}</text>'
        )
    for d in range(decades + 1):
        parts.append(
            f'<text class="decade" x="{left - 6}" '
            f'y="{_num(hist_top + _HIST - count_height(10**d) + 4)}" '
            f'text-anchor="end">{10**d:,}</text>'
        )
    parts.append(
        f'<text class="max-count" x="{right}" y="{hist_top - 6}" text-anchor="end">'
        f"fullest bin: {max_count:,} rows</text>"
    )
    parts.append("</g>")
    parts.append(
        f'<g class="labels" fill="#222">'
        f'<text x="{left + _PLOT / 2}" y="{hist_top + _HIST + 36}" '
        f'text-anchor="middle">confidence (maximum probability)</text>'
        f'<text transform="translate({left - 44} {_num(top + _PLOT / 2)}) rotate(-90)" '
        f'text-anchor="middle">accuracy</text>'
        f'<text transform="translate({left - 48} {_num(hist_top + _HIST / 2)}) rotate(-90)" '
        f'text-anchor="middle">rows (log)</text>'
        "</g>"
    )

    # bars: per bin, the series side by side
    for i, item in enumerate(items):
        colour = colours[i]
        fullest = max(item["count"], default=0)
        bars, counts = [], []
        edges = item["edges"]
        for b, count in enumerate(item["count"]):
            x0, x1 = x(edges[b]), x(edges[b + 1])
            slot = (x1 - x0) / n_series
            bx, bw = x0 + slot * i + 0.5, max(slot - 1.0, 0.5)
            acc, conf = item["accuracy"][b], item["confidence"][b]
            label = f"[{edges[b]:.3f}, {edges[b + 1]:.3f}]: {count} rows"
            if count > 0 and acc is not None:
                tip = escape(
                    f"{item['label']} {label}, accuracy {acc:.3f}"
                    + ("" if conf is None else f", mean confidence {conf:.3f}")
                )
                bars.append(
                    f'<rect class="bar" x="{_num(bx)}" y="{_num(y(acc))}" width="{_num(bw)}" '
                    f'height="{_num(y(0) - y(acc))}" data-count="{count}" '
                    f'fill-opacity="{_opacity(count, fullest)}"><title>{tip}</title></rect>'
                )
                if conf is not None:
                    bars.append(
                        f'<line class="confidence" x1="{_num(bx)}" y1="{_num(y(conf))}" '
                        f'x2="{_num(bx + bw)}" y2="{_num(y(conf))}" stroke="#222" '
                        'stroke-width="2"/>'
                    )
            if count > 0:
                h = count_height(count)
                counts.append(
                    f'<rect class="count" x="{_num(bx)}" y="{_num(hist_top + _HIST - h)}" '
                    f'width="{_num(bw)}" height="{_num(h)}" data-count="{count}">'
                    f"<title>{escape(item['label'] + ' ' + label)}</title></rect>"
                )
        data = f'data-series="{i}" data-label={quoteattr(item["label"])}'
        parts.append(f'<g class="series" {data} fill="{colour}" stroke="{colour}">')
        parts.extend(bars)
        parts.append("</g>")
        parts.append(f'<g class="counts" {data} fill="{colour}" fill-opacity="{_FULL}">')
        parts.extend(counts)
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
