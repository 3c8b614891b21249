"""HTML pieces of ``stability report``: charts, heat maps and tables of a run's page.

Split out of ``replay/report.py`` (pure move): the page constants and CSS, downsampling of long
series, timeline markers, per-layer heat maps, the summary / goodput / episode / alarm tables and
the timeline charts that :func:`replay.report.build_report` assembles.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .plotting import (
    KIND_COLOURS,
    LineChart,
    Marker,
    bin_columns,
    ffill_sparse,
    fmt,
    heatmap_png,
    stacked_bar,
)

MAX_POINTS = 1500
HEATMAP_BINS = 600
#: a series with fewer logged rows than this fraction is drawn as points
SPARSE_FRACTION = 0.5
#: signals listed per episode row before "+N more"
EPISODE_SIGNALS = 4
HEATMAP_FAMILIES = (
    "grad_norm",
    "update_ratio",
    "act_std",
    "act_absmax",
    "act_mean",
    "act_kurtosis",
)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;
max-width:980px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666;font-size:13px} table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left} th{background:#f4f4f4}
svg.chart{display:block;margin:8px 0;background:#fff}
svg .title{font-size:13px;font-weight:600} svg .ytick{font-size:10px;text-anchor:end;fill:#555}
svg .xtick{font-size:10px;text-anchor:middle;fill:#555} svg .grid{stroke:#eee}
svg .plot{fill:#fcfcfc;stroke:#ccc} svg .line{stroke-width:1.3} svg .legend{font-size:11px}
svg .marker{stroke-width:1.2;opacity:.7} svg .empty{font-size:12px;fill:#999}
.heat{margin:10px 0} .heat .lab{font-size:11px;color:#555;margin-bottom:2px}
.hm{display:flex;align-items:flex-start} .hm img{image-rendering:pixelated;width:760px;
border:1px solid #ccc} .rows{width:136px;padding-right:4px;font-size:10px;color:#444;
text-align:right} .rowlab{overflow:hidden;white-space:nowrap;text-overflow:ellipsis}
svg .episode{opacity:.22} table.episodes{width:100%}
table.episodes td{overflow-wrap:anywhere} td.num{text-align:right;font-variant-numeric:tabular-nums}
details summary{cursor:pointer;font-size:13px;margin:6px 0}
pre{background:#f7f7f7;padding:8px;font-size:12px;
overflow:auto} .kind{display:inline-block;width:10px;height:10px;margin-right:4px}
"""


def _column(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def _downsample(steps: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep at most MAX_POINTS points while preserving spikes (max per bin)."""
    keep = ~np.isnan(y) | np.isnan(y)  # all rows; NaN/inf kept as gaps
    steps, y = steps[keep], y[keep]
    n = len(y)
    if n <= MAX_POINTS:
        return steps, y
    edges = np.linspace(0, n, MAX_POINTS // 2 + 1).astype(np.int64)
    xs, ys = [], []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        block = y[lo:hi]
        fin = np.isfinite(block)
        if not fin.any():
            xs.append(steps[lo])
            ys.append(np.nan)
            continue
        idx = np.flatnonzero(fin)
        i_min = lo + idx[np.argmin(block[fin])]
        i_max = lo + idx[np.argmax(block[fin])]
        for i in sorted({i_min, i_max}):
            xs.append(steps[i])
            ys.append(y[i])
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def _present(table: pa.Table, name: str) -> np.ndarray:
    """Rows where ``name`` was logged (not null)."""
    col = table.column(name).combine_chunks()
    return np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)


def _episode_label(e: Mapping[str, Any]) -> str:
    span = (f"step {e['first_step']}" if e["first_step"] == e["last_step"]
            else f"steps {e['first_step']}-{e['last_step']}")
    sig = list(e["signals"])
    more = f" +{len(sig) - EPISODE_SIGNALS} more" if len(sig) > EPISODE_SIGNALS else ""
    text = (f"{span}: {_counts(e['kinds'])} on {'; '.join(sig[:EPISODE_SIGNALS])}{more}; "
            f"peak score {fmt(e['peak_score'])} ({e['peak_signal']}, step {e['peak_step']})")
    if e["cause"]:
        text += f"; cause {e['cause']}"
    if e["interventions"]:
        text += f"; {_counts(e['interventions'])}"
    return text


def _h(v: Any) -> str:
    """Any value as HTML text: every string of an event log or a run is escaped."""
    return html.escape(str(v))


def _counts(d: Mapping[str, int]) -> str:
    return ", ".join(f"{k} x{v}" if v > 1 else str(k) for k, v in d.items())


def _markers(
    eps: Sequence[Mapping[str, Any]], interventions: Sequence[Mapping[str, Any]]
) -> list[Marker]:
    """One shaded span per alarm episode and one dashed line per intervention step."""
    out: list[Marker] = []
    for e in eps:
        kind = next(iter(e["kinds"]), "")
        out.append(Marker(float(e["first_step"]), KIND_COLOURS.get(kind, "#888"),
                          _episode_label(e), end=float(e["last_step"])))
    by_step: dict[int, list[str]] = {}
    for iv in interventions:
        by_step.setdefault(int(iv["step"]), []).append(
            str(iv.get("type")) + (f" (cause: {iv['cause']})" if iv.get("cause") else ""))
    for step, kinds in sorted(by_step.items()):
        out.append(Marker(float(step), "#555", f"step {step}: {', '.join(kinds)}", dashed=True))
    return out


def _family_matrix(
    table: pa.Table, family: str
) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    prefix = family + "/"
    names = [c for c in table.column_names if c.startswith(prefix)]
    if not names:
        return None
    mat = np.stack([_column(table, c) for c in names], axis=1)
    pres = np.stack([_present(table, c) for c in names], axis=1)
    return [c[len(prefix) :] for c in names], mat, pres


def _heatmap_html(fam: str, steps: np.ndarray, layers: list[str], mat: np.ndarray,
                  pres: np.ndarray) -> str:
    """A heat map (rows = layers, labelled) of one per-layer family; sparse columns filled."""
    filled = ffill_sparse(mat, pres)
    centres, binned = bin_columns(steps.astype(np.int64), filled, HEATMAP_BINS)
    n = len(layers)
    row = max(3, min(16, 640 // max(n, 1)))
    every = max(1, math.ceil(10 / row))
    fin = binned[np.isfinite(binned)]
    # log colour scale for positive magnitudes; signed families (mean, excess kurtosis) linear
    log = fam not in ("act_mean", "act_kurtosis") and bool(fin.size) and bool(np.all(fin > 0))
    uri = heatmap_png(binned.T, log=log, cell_h=1)
    labels = "".join(
        f'<div class="rowlab" style="height:{row}px;line-height:{row}px;'
        f'font-size:{min(10, row)}px">{html.escape(name) if k % every == 0 else ""}</div>'
        for k, name in enumerate(layers)
    )
    lo = f"{centres[0]:.0f}" if len(centres) else "-"
    hi = f"{centres[-1]:.0f}" if len(centres) else "-"
    sparse = int((pres.mean(axis=0) < SPARSE_FRACTION).sum()) if len(pres) else 0
    note = f"; {sparse} sparsely logged rows held at their last value" if sparse else ""
    return (
        f'<div class="heat" data-family="{html.escape(fam)}"><div class="lab">'
        f"<b>{html.escape(fam)}</b> per layer ({n} rows), steps {lo} to {hi}; each row scaled "
        f"to its own 1-99th percentile range{note}</div><div class='hm'><div class='rows'>"
        f'{labels}</div><img alt="{html.escape(fam)} heat map" style="height:{n * row}px" '
        f'src="{uri}"></div></div>'
    )


def _summary_rows(
    alarms: Sequence[Mapping[str, Any]],
    interventions: Sequence[Mapping[str, Any]],
    eps: Sequence[Mapping[str, Any]],
    goodput: Mapping[str, Any],
    label: Mapping[str, Any] | None,
) -> list[tuple[str, str]]:
    """The summary table: ``(label, value)`` rows; a label is HTML with every piece of text
    from the run or its event log escaped, a value is plain text (the caller escapes it)."""
    rows: list[tuple[str, str]] = []
    by_kind = Counter(str(a.get("kind")) for a in alarms)
    n_steps = len({int(a["step"]) for a in alarms})
    rows.append(("alarms", f"{len(alarms)} on {n_steps} steps in {len(eps)} "
                 f"episode{'s' if len(eps) != 1 else ''}" if alarms else "0"))
    for kind, n in sorted(by_kind.items()):
        colour = KIND_COLOURS.get(kind, "#888")
        rows.append((f'<span class="kind" style="background:{html.escape(colour)}"></span>'
                     f"{html.escape(kind)}", str(n)))
    first = min((int(a["step"]) for a in alarms), default=None)
    if first is not None:
        fa = next(a for a in alarms if int(a["step"]) == first)
        rows.append(("first alarm", f"step {first}: {fa.get('kind')} on {fa.get('signal')} "
                                    f"(score {fmt(fa.get('score'))})"))
    else:
        rows.append(("first alarm", "none"))
    by_type = Counter(str(i.get("type")) for i in interventions)
    rows.append(
        ("interventions", ", ".join(f"{k} x{v}" for k, v in sorted(by_type.items())) or "none")
    )
    if label:
        onset = label.get("onset_step")
        rows.append(("labelled fault", f"{label.get('scenario')} at step {onset}"))
        div = next(
            (
                label.get(k)
                for k in ("failure_step", "nan_step", "divergence_step")
                if label.get(k) is not None and not _isnan(label.get(k))
            ),
            None,
        )
        if first is not None and onset is not None and not _isnan(onset):
            after = [int(a["step"]) for a in alarms if int(a["step"]) >= int(onset)]
            if after:
                rows.append(("detection delay", f"{min(after) - int(onset)} steps after onset"))
        if div is not None and first is not None:
            rows.append(("lead time", f"{int(div) - first} steps before divergence ({div})"))
    for k, v in goodput.items():
        if v is None or isinstance(v, (bool, int, float, str)):
            rows.append((f"goodput: {html.escape(str(k))}", "none" if v is None else fmt(v)))
    return rows


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _goodput_panel(goodput: Mapping[str, Any]) -> str:
    """Badput breakdown bars: wall time by bucket (a ``GoodputTracker`` record) and/or steps
    (productive, skipped, rolled back, after a stop -- a replay's counterfactual figures)."""
    from stability.run.goodput import TIME_BUCKETS

    out: list[str] = []
    times = goodput.get("time_s")
    if isinstance(times, Mapping) and float(goodput.get("wall_time_s") or 0.0) > 0:
        out.append(stacked_bar("wall time by bucket (badput breakdown)",
                               [(b, float(times.get(b, 0.0) or 0.0)) for b in TIME_BUCKETS],
                               "s"))
    if "productive" in goodput and "steps" in goodput:
        prod = int(goodput.get("productive") or 0)
        skipped = int(goodput.get("skipped") or 0)
        lost = int(goodput.get("lost_to_rollback") or 0)
        out.append(stacked_bar("steps", [("productive", prod), ("skipped", skipped),
                                         ("lost to rollback", lost)]))
    elif "executed_steps" in goodput:
        ex = int(goodput.get("executed_steps") or 0)
        sk = int(goodput.get("skipped_steps") or 0)
        rb = int(goodput.get("rollback_steps") or 0)
        after = int(goodput.get("steps_after_stop") or 0)
        out.append(stacked_bar("steps if the monitor had acted (counterfactual)",
                               [("productive", max(ex - sk - rb, 0)), ("skipped", sk),
                                ("rolled back", rb), ("saved by the stop", after)]))
    return "".join(out)


def _episodes_table(eps: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for e in eps:
        sig = list(e["signals"])
        more = f" +{len(sig) - EPISODE_SIGNALS} more" if len(sig) > EPISODE_SIGNALS else ""
        span = (str(e["first_step"]) if e["first_step"] == e["last_step"]
                else f"{e['first_step']}-{e['last_step']}")
        rows.append(
            f"<tr class='episode'><td>{_h(span)}</td><td>{_h(e['cause'] or '-')}</td>"
            f"<td>{html.escape(_counts(e['kinds']))}</td>"
            f"<td>{html.escape('; '.join(sig[:EPISODE_SIGNALS]) + more)}</td>"
            f"<td class='num'>{_h(fmt(e['first_score']))}</td>"
            f"<td class='num'>{_h(fmt(e['peak_score']))} <span class='sub'>"
            f"({_h(e['peak_signal'])}, step {_h(e['peak_step'])})</span></td>"
            f"<td>{html.escape(_counts(e['interventions']) or '-')}</td></tr>"
        )
    return (
        "<table class='episodes'><tr><th>steps</th><th>cause</th><th>alarms</th>"
        "<th>signals</th><th>first score</th><th>peak score</th><th>interventions</th></tr>"
        + "".join(rows) + "</table>"
    )


def _alarm_rows(alarms: Sequence[Mapping[str, Any]], limit: int = 200) -> str:
    rows = "".join(
        f"<tr><td>{_h(a.get('step'))}</td><td>{_h(a.get('kind'))}</td>"
        f"<td>{_h(a.get('signal'))}</td><td class='num'>{_h(fmt(a.get('score')))}</td>"
        f"<td class='num'>{_h(fmt(a.get('threshold')))}</td>"
        f"<td>{html.escape(str(a.get('severity')))}</td>"
        f"<td>{html.escape(str(a.get('detector')))}</td></tr>"
        for a in sorted(alarms, key=lambda a: int(a["step"]))[:limit]
    )
    shown = f"first {limit} of {len(alarms)}" if len(alarms) > limit else str(len(alarms))
    return (
        f"<details><summary>every alarm ({shown})</summary><table><tr><th>step</th>"
        "<th>kind</th><th>signal</th><th>score</th><th>threshold</th><th>severity</th>"
        f"<th>detector</th></tr>{rows}</table></details>"
    )


def _loss_is_log(table: pa.Table, names: Sequence[str]) -> bool:
    """Log scale when every logged finite value is positive."""
    vals = [v[np.isfinite(v)] for v in (_column(table, n) for n in names)]
    allv = np.concatenate(vals) if vals else np.zeros(0)
    return bool(allv.size) and bool(np.all(allv > 0))


def _timeline(table: pa.Table, steps: np.ndarray, markers: list[Marker]) -> list[str]:
    cols = set(table.column_names)
    charts: list[str] = []
    spec = [
        ("loss and validation loss", ["loss", "val_loss"]),
        ("learning rate", ["lr"]),
        ("gradient norm", ["grad_norm"]),
    ]
    for chart_title, names in spec:
        have = [n for n in names if n in cols]
        log_y = _loss_is_log(table, have) if chart_title != "learning rate" else False
        if chart_title == "learning rate" and have:
            lr = _column(table, "lr")
            fin = lr[np.isfinite(lr)]
            # LR spanning over a decade (warm-up, a blow-up) reads better on a log axis
            log_y = bool(fin.size) and bool(np.all(fin > 0)) and fin.max() > 10 * fin.min()
        chart = LineChart(chart_title, log_y=log_y, markers=markers)
        for name in have:
            y = _column(table, name)
            logged = _present(table, name)
            sx, sy = steps[logged], y[logged]
            sparse = logged.mean() < SPARSE_FRACTION if len(logged) else False
            if len(sx) > MAX_POINTS:
                sx, sy = _downsample(sx, sy)
            chart.add(name, sx, sy, points=bool(sparse))
        charts.append(chart.to_svg())
    return charts


