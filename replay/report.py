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
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .frames import episodes as alarm_episode_list
from .plotting import KIND_COLOURS
from .report_html import (
    _CSS,
    HEATMAP_FAMILIES,
    _alarm_rows,
    _column,
    _episodes_table,
    _family_matrix,
    _goodput_panel,
    _heatmap_html,
    _loss_is_log,
    _markers,
    _summary_rows,
    _timeline,
)
from .report_html import EPISODE_SIGNALS as EPISODE_SIGNALS  # re-exported (moved)
from .report_html import HEATMAP_BINS as HEATMAP_BINS
from .report_html import MAX_POINTS as MAX_POINTS
from .report_html import SPARSE_FRACTION as SPARSE_FRACTION


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
        elif r.get("type") == "intervention" and isinstance(r.get("intervention"), str):
            interventions.append({**r, "type": r["intervention"]})  # the event log's schema
        elif r.get("type") in INTERVENTION_TYPES:
            interventions.append(r)
        elif isinstance(r.get("goodput"), Mapping):
            goodput = dict(r["goodput"])
        elif r.get("type") == "goodput" or r.get("event") == "goodput":
            goodput = {k: v for k, v in r.items() if k not in ("type", "event", "time")}
    return alarms, interventions, goodput


def build_report(
    table: pa.Table,
    *,
    events: Iterable[Mapping[str, Any]] | None = None,
    alarms: Sequence[Any] = (),
    interventions: Sequence[Any] = (),
    config: Mapping[str, Any] | None = None,
    label: Mapping[str, Any] | None = None,
    goodput: Mapping[str, Any] | None = None,
    title: str = "training run",
) -> str:
    """Build the report page as an HTML string.

    Parameters
    ----------
    table
        The run in the wide schema (``step`` plus metric columns).
    events
        Event-log records (see :func:`split_events`); merged with ``alarms``/``interventions``.
        The last ``goodput`` record (``GoodputTracker.record()``) gives the badput panel.
    alarms, interventions
        :class:`~stability.types.Alarm` / :class:`~stability.types.Intervention` objects or dicts.
    config
        The monitor configuration used (shown verbatim).
    label
        This run's row from a labels file, to show delay and lead time.
    goodput
        Goodput figures to show (a ``GoodputTracker`` record or a replay's counterfactual
        :func:`replay.replay.goodput`); default: the event log's.
    """
    if "step" not in table.column_names:
        raise ValueError("report: the run has no 'step' column")
    al = [_as_dict(a) for a in alarms]
    iv = [_as_dict(i) for i in interventions]
    gp: dict[str, Any] = {}
    if events is not None:
        a2, i2, gp = split_events(events)
        al += a2
        iv += i2
    if goodput:
        gp = dict(goodput)
    steps = np.asarray(table.column("step").to_numpy(zero_copy_only=False), dtype=np.float64)
    eps = alarm_episode_list(al, iv)
    charts = _timeline(table, steps, _markers(eps, iv))

    heat: list[str] = []
    for fam in HEATMAP_FAMILIES:
        got = _family_matrix(table, fam)
        if got is not None:
            heat.append(_heatmap_html(fam, steps, *got))

    rows = _summary_rows(al, iv, eps, gp, label)
    table_html = "".join(f"<tr><th>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    panel = _goodput_panel(gp)
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
        f"{len(table.column_names) - 1} metrics. Shaded bands are alarm episodes (colour: "
        f"the main alarm kind: {legend}); dashed grey lines are interventions; hover for "
        "details.</div>"
        f"<h2>Summary</h2><table>{table_html}</table>"
        + (f"<h2>Goodput</h2>{panel}" if panel else "")
        + f"<h2>Timeline</h2>{''.join(charts)}"
        + (f"<h2>Per-layer heat maps</h2>{''.join(heat)}" if heat else "")
        + (f"<h2>Alarm episodes ({len(eps)})</h2>{_episodes_table(eps)}{_alarm_rows(al)}"
           if al else "")
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
        if name == "grad_norm" or (name == "loss" and _loss_is_log(table, ["loss"])):
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
    from stability.outputs.events import read_events

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
    replay_goodput: dict[str, Any] | None = None
    if args.events:
        events = _read_events_file(args.events)
    else:
        from stability.config.config import load_config

        cfg = load_config(args.config)
        config = cfg.to_dict()
        res = replay_table(table, cfg, run_id, args.run)
        replay_goodput = res.goodput
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
        goodput=replay_goodput,
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
