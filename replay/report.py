"""``stability report``: one self-contained HTML file (and optionally a PNG) for a run.

The page shows loss / validation loss, learning rate and gradient norm (log scale) with alarms
and interventions marked on the timeline, per-layer heat maps of gradient norms and activation
statistics, a summary table (alarms by kind, first alarm, lead time where labels exist, goodput)
and the configuration used.  It loads nothing from the network.

Examples
--------
>>> import pyarrow as pa
>>> t = pa.table({"step": [0, 1, 2], "loss": [2.0, 1.9, 1.8]})
>>> page = build_report(t, title="demo")
>>> page.startswith("<!DOCTYPE html>") and "<svg" in page
True
"""

from __future__ import annotations

import html
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .plotting import KIND_COLOURS, LineChart, Marker, bin_columns, heatmap_png

MAX_POINTS = 1500
HEATMAP_BINS = 600
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
.heat img{image-rendering:pixelated;width:900px;height:auto;border:1px solid #ccc}
.heat .lab{font-size:11px;color:#555} pre{background:#f7f7f7;padding:8px;font-size:12px;
overflow:auto} .kind{display:inline-block;width:10px;height:10px;margin-right:4px}
"""


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        if isinstance(d, Mapping):
            return dict(d)
    raise TypeError(f"cannot read an event from {type(obj).__name__}")


def split_events(
    records: Iterable[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Split event-log records into alarms, interventions and the last goodput record.

    Alarms are records with ``kind`` and ``signal``; interventions are records whose ``type``
    (or ``event``/``record``) names an intervention; goodput records carry ``goodput`` data.

    >>> a, i, g = split_events([
    ...     {"event": "alarm", "step": 3, "kind": "loss_spike", "signal": "loss"},
    ...     {"event": "intervention", "step": 3, "type": "reduce_lr", "factor": 0.5},
    ... ])
    >>> len(a), i[0]["type"]
    (1, 'reduce_lr')
    """
    from stability.types import INTERVENTION_TYPES

    alarms: list[dict[str, Any]] = []
    interventions: list[dict[str, Any]] = []
    goodput: dict[str, Any] = {}
    for rec in records:
        r = dict(rec)
        payload = r.get("alarm") if isinstance(r.get("alarm"), Mapping) else None
        if payload is not None:
            alarms.append({**payload, "step": payload.get("step", r.get("step"))})
            continue
        inter = r.get("intervention") if isinstance(r.get("intervention"), Mapping) else None
        if inter is not None:
            interventions.append({**inter, "step": inter.get("step", r.get("step"))})
            continue
        if "kind" in r and "signal" in r:
            alarms.append(r)
        elif r.get("type") in INTERVENTION_TYPES:
            interventions.append(r)
        elif isinstance(r.get("goodput"), Mapping):
            goodput = dict(r["goodput"])
        elif r.get("type") == "goodput" or r.get("event") == "goodput":
            goodput = {k: v for k, v in r.items() if k not in ("type", "event", "time")}
    return alarms, interventions, goodput


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


def _markers(
    alarms: Sequence[Mapping[str, Any]], interventions: Sequence[Mapping[str, Any]]
) -> list[Marker]:
    out: list[Marker] = []
    seen: set[tuple[int, str]] = set()
    for a in alarms:
        key = (int(a["step"]), str(a.get("kind")))
        if key in seen:
            continue
        seen.add(key)
        out.append(
            Marker(
                float(a["step"]),
                KIND_COLOURS.get(str(a.get("kind")), "#888"),
                f"step {a['step']}: {a.get('kind')} on {a.get('signal')} "
                f"(score {a.get('score')}, {a.get('detector')})",
            )
        )
    for iv in interventions:
        out.append(
            Marker(float(iv["step"]), "#555", f"step {iv['step']}: {iv.get('type')}"
                   + (f" (cause: {iv['cause']})" if iv.get("cause") else ""), dashed=True)
        )
    return out


def _family_matrix(table: pa.Table, family: str) -> tuple[list[str], np.ndarray] | None:
    prefix = family + "/"
    names = [c for c in table.column_names if c.startswith(prefix)]
    if not names:
        return None
    mat = np.stack([_column(table, c) for c in names], axis=1)
    return [c[len(prefix) :] for c in names], mat


def _summary_rows(
    alarms: Sequence[Mapping[str, Any]],
    interventions: Sequence[Mapping[str, Any]],
    goodput: Mapping[str, Any],
    label: Mapping[str, Any] | None,
) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    by_kind = Counter(str(a.get("kind")) for a in alarms)
    rows.append(("alarms", str(len(alarms))))
    for kind, n in sorted(by_kind.items()):
        colour = KIND_COLOURS.get(kind, "#888")
        rows.append((f'<span class="kind" style="background:{colour}"></span>{kind}', str(n)))
    first = min((int(a["step"]) for a in alarms), default=None)
    if first is not None:
        fa = next(a for a in alarms if int(a["step"]) == first)
        rows.append(("first alarm", f"step {first}: {fa.get('kind')} on {fa.get('signal')}"))
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
        rows.append((f"goodput: {k}", f"{v:.4g}" if isinstance(v, float) else str(v)))
    return rows


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def build_report(
    table: pa.Table,
    *,
    events: Iterable[Mapping[str, Any]] | None = None,
    alarms: Sequence[Any] = (),
    interventions: Sequence[Any] = (),
    config: Mapping[str, Any] | None = None,
    label: Mapping[str, Any] | None = None,
    title: str = "training run",
) -> str:
    """Build the report page as an HTML string.

    Parameters
    ----------
    table
        The run in the wide schema (``step`` plus metric columns).
    events
        Event-log records (see :func:`split_events`); merged with ``alarms``/``interventions``.
    alarms, interventions
        :class:`~stability.types.Alarm` / :class:`~stability.types.Intervention` objects or dicts.
    config
        The monitor configuration used (shown verbatim).
    label
        This run's row from a labels file, to show delay and lead time.
    """
    if "step" not in table.column_names:
        raise ValueError("report: the run has no 'step' column")
    al = [_as_dict(a) for a in alarms]
    iv = [_as_dict(i) for i in interventions]
    goodput: dict[str, Any] = {}
    if events is not None:
        a2, i2, goodput = split_events(events)
        al += a2
        iv += i2
    steps = np.asarray(table.column("step").to_numpy(zero_copy_only=False), dtype=np.float64)
    markers = _markers(al, iv)
    cols = set(table.column_names)

    charts: list[str] = []
    spec = [
        ("loss and validation loss", ["loss", "val_loss"], False),
        ("learning rate", ["lr"], False),
        ("gradient norm", ["grad_norm"], True),
    ]
    for chart_title, names, log_y in spec:
        chart = LineChart(chart_title, log_y=log_y, markers=markers)
        for name in names:
            if name in cols:
                y = _column(table, name)
                if name == "val_loss":
                    sel = ~np.isnan(y) | np.isnan(y)
                    present = table.column(name).is_valid().to_numpy(zero_copy_only=False)
                    sel = sel & present
                    chart.add(name, steps[sel], y[sel])
                else:
                    chart.add(name, *_downsample(steps, y))
        charts.append(chart.to_svg())

    heat: list[str] = []
    for fam in HEATMAP_FAMILIES:
        got = _family_matrix(table, fam)
        if got is None:
            continue
        layers, mat = got
        centres, binned = bin_columns(steps.astype(np.int64), mat, HEATMAP_BINS)
        uri = heatmap_png(binned.T, log=fam != "act_mean", cell_h=max(4, 72 // max(len(layers), 1)))
        lo = f"{centres[0]:.0f}" if len(centres) else "-"
        hi = f"{centres[-1]:.0f}" if len(centres) else "-"
        heat.append(
            f'<div class="heat"><div class="lab"><b>{html.escape(fam)}</b> per layer '
            f"({len(layers)} rows: {html.escape(', '.join(layers[:12]))}"
            f"{' ...' if len(layers) > 12 else ''}), steps {lo} to {hi}; each row scaled "
            f'to its own 1-99th percentile range</div><img alt="{html.escape(fam)} heat map" '
            f'src="{uri}"></div>'
        )

    rows = _summary_rows(al, iv, goodput, label)
    table_html = "".join(f"<tr><th>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    alarm_rows = "".join(
        f"<tr><td>{a.get('step')}</td><td>{html.escape(str(a.get('kind')))}</td>"
        f"<td>{html.escape(str(a.get('signal')))}</td><td>{html.escape(str(a.get('score')))}</td>"
        f"<td>{html.escape(str(a.get('severity')))}</td>"
        f"<td>{html.escape(str(a.get('detector')))}</td></tr>"
        for a in sorted(al, key=lambda a: int(a["step"]))[:200]
    )
    cfg = json.dumps(config, indent=2, default=str) if config else "(not recorded)"
    legend = " ".join(
        f'<span class="kind" style="background:{c}"></span>{k}' for k, c in KIND_COLOURS.items()
    )
    n_steps = len(steps)
    span = f"steps {int(steps.min())} to {int(steps.max())}" if n_steps else "no steps"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)} - stability report</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><div class='sub'>{n_steps} rows, {span}, "
        f"{len(table.column_names) - 1} metrics. Alarm colours: {legend}; dashed grey lines are "
        "interventions.</div>"
        f"<h2>Summary</h2><table>{table_html}</table>"
        f"<h2>Timeline</h2>{''.join(charts)}"
        + (f"<h2>Per-layer heat maps</h2>{''.join(heat)}" if heat else "")
        + (
            "<h2>Alarms (first 200)</h2><table><tr><th>step</th><th>kind</th><th>signal</th>"
            f"<th>score</th><th>severity</th><th>detector</th></tr>{alarm_rows}</table>"
            if al
            else ""
        )
        + f"<h2>Configuration</h2><pre>{html.escape(cfg)}</pre></body></html>"
    )


def write_png(
    path: str | Path,
    table: pa.Table,
    alarms: Sequence[Mapping[str, Any]] = (),
    interventions: Sequence[Mapping[str, Any]] = (),
    title: str = "training run",
) -> None:
    """Write a PNG summary (loss, LR, grad norm with markers) using matplotlib.

    Raises
    ------
    RuntimeError
        If matplotlib is not installed (``pip install training-stability[report]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "PNG output needs matplotlib: pip install 'training-stability[report]'"
        ) from exc
    steps = np.asarray(table.column("step").to_numpy(zero_copy_only=False), dtype=np.float64)
    panels = [c for c in ("loss", "lr", "grad_norm") if c in table.column_names]
    fig, axes = plt.subplots(
        len(panels) or 1, 1, figsize=(10, 2.4 * max(len(panels), 1)), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], panels, strict=False):
        y = _column(table, name)
        ax.plot(steps, y, lw=0.9, color="#0072B2", label=name)
        if name == "loss" and "val_loss" in table.column_names:
            v = _column(table, "val_loss")
            ok = table.column("val_loss").is_valid().to_numpy(zero_copy_only=False)
            ax.plot(steps[ok], v[ok], "o-", ms=2.5, lw=0.9, color="#E69F00", label="val_loss")
        if name == "grad_norm":
            ax.set_yscale("log")
        for a in alarms:
            ax.axvline(
                float(a["step"]),
                color=KIND_COLOURS.get(str(a.get("kind")), "#888"),
                lw=0.8,
                alpha=0.6,
            )
        for i in interventions:
            ax.axvline(float(i["step"]), color="#555", lw=0.8, ls="--", alpha=0.7)
        ax.set_ylabel(name)
        ax.legend(loc="upper right", fontsize=8)
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def write_report(path: str | Path, table: pa.Table, **kwargs: Any) -> Path:
    """Build the report and write it to ``path`` (UTF-8); returns the path."""
    out = Path(path)
    out.write_text(build_report(table, **kwargs), encoding="utf-8")
    return out


def _read_events_file(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
        out = []
        for r in rows:
            payload = r.get("payload") or r.get("record")
            out.append(json.loads(payload) if isinstance(payload, str) else r)
        return out
    from stability.events import read_events

    return read_events(p, errors="skip")


def main(argv: Sequence[str] | None = None) -> int:
    """``stability report RUN [--events E] [--config C] [--labels L] -o report.html [--png P]``.

    Without ``--events`` the run is replayed through the monitor (``--config``, default preset)
    to find the alarms and interventions shown on the timeline.
    """
    import argparse

    from .replay import read_table, replay_table

    ap = argparse.ArgumentParser(prog="stability report", description=main.__doc__)
    ap.add_argument("run", help="recorded run (file, directory of parts, or importable log)")
    ap.add_argument("--events", "-e", help="event log (.jsonl / .parquet) to show instead")
    ap.add_argument("--config", "-c", default=None, help="preset name or .toml/.json config")
    ap.add_argument("--labels", "-l", help="labels file, to show delay and lead time")
    ap.add_argument("--output", "-o", default="report.html", help="HTML output path")
    ap.add_argument("--png", help="also write a PNG summary (needs matplotlib)")
    ap.add_argument("--title", help="page title (default: the run name)")
    args = ap.parse_args(list(argv) if argv is not None else None)

    run_id = Path(args.run.rstrip("/")).stem
    try:
        table = read_table(args.run)
    except (OSError, ValueError) as exc:
        print(f"stability report: {exc}", file=sys.stderr)
        return 2
    alarms: list[dict[str, Any]] = []
    interventions: list[dict[str, Any]] = []
    events: list[dict[str, Any]] | None = None
    config: dict[str, Any] | None = None
    if args.events:
        events = _read_events_file(args.events)
    else:
        from stability.config import load_config

        cfg = load_config(args.config)
        config = cfg.to_dict()
        res = replay_table(table, cfg, run_id, args.run)
        alarms = [a.to_dict() for a in res.alarms]
        interventions = [i.to_dict() for i in res.interventions]
    label = None
    if args.labels:
        from .labels import load_labels

        found = load_labels(args.labels).get(run_id)
        if found is not None:
            label = {
                "scenario": found.scenario,
                "onset_step": found.onset_step,
                "failure_step": found.failure_step,
                "nan_step": found.nan_step,
                "divergence_step": found.divergence_step,
            }
    title = args.title or run_id
    out = write_report(
        args.output,
        table,
        events=events,
        alarms=alarms,
        interventions=interventions,
        config=config,
        label=label,
        title=title,
    )
    print(f"wrote {out}")
    if args.png:
        a2, i2 = alarms, interventions
        if events is not None:
            a2, i2, _ = split_events(events)
        write_png(args.png, table, a2, i2, title=title)
        print(f"wrote {args.png}")
    return 0
