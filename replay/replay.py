"""Replay recorded runs through the monitor: alarms, interventions, goodput, events on disk.

The monitor's batch path (:meth:`stability.monitor.monitor.Monitor.replay`) gives exactly the
decisions
of a step-by-step ``observe()`` loop, so a replay shows what the monitor *would have done*.

Goodput figures (all counterfactual -- the recorded run did not act on the requests):

* ``stop_step``: first step at which a ``Stop`` was requested (``None`` if never);
  ``steps_after_stop``: recorded steps after it (compute a stop would have saved);
* ``skipped_steps``: steps whose optimizer update would have been skipped;
* ``rollback_steps``: steps that rollbacks would have thrown away and recomputed
  (``step - to_step`` summed over rollbacks);
* ``goodput``: ``(executed - skipped - rolled back) / executed`` where ``executed`` is the number
  of recorded steps up to and including the stop (all of them without a stop).

These are counted from the requested interventions, not read from the monitor's goodput ledger
(:attr:`stability.monitor.monitor.Monitor.goodput`): the ledger books what a trainer acting on the
returned ``Control`` ran -- every recorded step, also after a stop, and nothing in ``log_only``
mode -- while these figures stop at the stop and count requests.  On a run without a stop
and not in ``log_only`` mode the two agree (``tests/test_monitor_goodput.py`` checks it).

Examples
--------
>>> discover_runs("/nonexistent/*.parquet")
[]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from replay import stream as run_stream
from replay.fleet import RunFailure, fan_out_runs
from replay.runs import Progress as Progress
from replay.runs import discover_many as discover_many
from replay.runs import discover_runs as discover_runs
from replay.runs import parallel_map as parallel_map
from replay.runs import read_table as read_table
from replay.stream import OutOfOrder, RunStream, plan_stream
from stability.types import Alarm, Decision, Intervention


# ---------------------------------------------------------------------------- replay
@dataclass
class ReplayResult:
    """What the monitor would have done on one recorded run."""

    run_id: str
    path: str
    n_steps: int
    steps: NDArray[np.int64]
    alarms: list[Alarm] = field(default_factory=list)
    interventions: list[Intervention] = field(default_factory=list)
    goodput: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def alarm_steps(self) -> NDArray[np.int64]:
        """Sorted unique steps with at least one alarm."""
        return np.unique(np.array([a.step for a in self.alarms], dtype=np.int64))

    def summary(self) -> dict[str, Any]:
        """JSON-compatible summary (counts, first alarm, interventions, goodput)."""
        by_kind = Counter(a.kind for a in self.alarms)
        by_det = Counter(a.detector for a in self.alarms)
        by_iv = Counter(i.type for i in self.interventions)
        first = min(self.alarms, key=lambda a: a.step) if self.alarms else None
        return {
            "run_id": self.run_id,
            "path": self.path,
            "n_steps": self.n_steps,
            "first_step": int(self.steps[0]) if self.steps.size else None,
            "last_step": int(self.steps[-1]) if self.steps.size else None,
            "alarm_steps": int(self.alarm_steps.size),
            "alarms": len(self.alarms),
            "alarms_by_kind": dict(sorted(by_kind.items())),
            "alarms_by_detector": dict(sorted(by_det.items())),
            "first_alarm": first.to_dict() if first else None,
            "interventions_by_type": dict(sorted(by_iv.items())),
            "interventions": [i.to_dict() for i in self.interventions[:20]],
            "goodput": self.goodput,
            "seconds": round(self.seconds, 3),
        }

    # -------------------------------------------------------------- tables (replay.frames)
    def to_arrow(self, which: str = "alarms") -> pa.Table:
        """The alarms, interventions or alarm episodes as an Arrow table, one row each.

        ``which``: ``"alarms"`` (step, kind, signal, detector, severity, score, threshold,
        cause, message), ``"interventions"`` (step, type, reason, cause, params JSON) or
        ``"episodes"`` (see :func:`replay.frames.episodes`).
        """
        from . import frames

        if which == "alarms":
            return frames.alarms_table(self.alarms, self.interventions)
        if which == "interventions":
            return frames.interventions_table(self.interventions)
        if which == "episodes":
            return frames.episodes_table(self.alarms, self.interventions)
        raise ValueError("The 'which' parameter of ReplayResult.to_arrow must be one of "
                         f"'alarms', 'interventions', 'episodes'. Got {which!r} instead.")

    def to_pandas(self, which: str = "alarms") -> Any:
        """:meth:`to_arrow` as a pandas ``DataFrame`` (needs pandas)."""
        from .frames import to_pandas

        return to_pandas(self.to_arrow(which))

    def episodes(self) -> list[dict[str, Any]]:
        """Alarms merged into episodes (:func:`replay.frames.episodes`)."""
        from .frames import episodes

        return episodes(self.alarms, self.interventions)

    def _repr_html_(self) -> str:
        """A compact summary table for notebooks."""
        import html

        from .frames import _counts

        s = self.summary()
        eps = self.episodes()
        rows = [("run", f"{self.run_id} ({self.n_steps} steps, {s['first_step']}.."
                        f"{s['last_step']})"),
                ("alarms", f"{s['alarms']} on {s['alarm_steps']} steps, {len(eps)} episodes"),
                ("by kind", _counts(s["alarms_by_kind"]) or "none"),
                ("interventions", _counts(s["interventions_by_type"]) or "none")]
        for e in eps[:5]:
            rows.append((f"episode {e['first_step']}..{e['last_step']}",
                         f"{_counts(e['kinds'])} on {', '.join(list(e['signals'])[:3])}; "
                         f"peak {e['peak_score']:.3g}"
                         + (f"; cause {e['cause']}" if e["cause"] else "")
                         + (f"; {_counts(e['interventions'])}" if e["interventions"] else "")))
        if len(eps) > 5:
            rows.append(("", f"... {len(eps) - 5} more episodes (to_pandas('episodes'))"))
        g = self.goodput.get("goodput")
        if g is not None:
            rows.append(("goodput", f"{float(g):.3g}"))
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in rows)
        return f"<table><caption>ReplayResult</caption>{body}</table>"


def goodput(steps: NDArray[np.int64], interventions: Sequence[Intervention]) -> dict[str, Any]:
    """Counterfactual goodput figures (see the module docstring).

    >>> from stability.types import SkipStep, Stop
    >>> goodput(np.arange(100), [SkipStep(10), SkipStep(11), Stop(49)])["goodput"]
    0.96
    """
    n = int(steps.size)
    stop = next((int(i.step) for i in interventions if i.type == "stop"), None)
    executed = n if stop is None else int((steps <= stop).sum())
    upto = (lambda s: True) if stop is None else (lambda s: s <= stop)
    skipped = len({int(i.step) for i in interventions if i.type == "skip_step" and upto(i.step)})
    rolled = sum(max(0, int(i.step) - int(getattr(i, "to_step", i.step)))
                 for i in interventions if i.type == "rollback" and upto(i.step))
    good = executed - skipped - rolled
    return {
        "stop_step": stop,
        "steps_after_stop": n - executed,
        "skipped_steps": skipped,
        "rollback_steps": rolled,
        "executed_steps": executed,
        "goodput": round(max(good, 0) / executed, 6) if executed else float("nan"),
    }


def _monitor(config: Any) -> Any:
    from stability.monitor.monitor import Monitor

    # a replay of history reports what the monitor would have done; it pages nobody: the
    # alerts are in the result (and the event log), not sent to the configured sinks
    return Monitor(config, alert_sinks=[])


def unbound_warning(monitor: Any, names: Iterable[str]) -> str | None:
    """A warning when no metric bound to any detector but the catch-all NaN check, naming the
    metrics seen and the closest names the config (or the alias table) knows.

    >>> from stability.monitor.monitor import Monitor
    >>> m = Monitor("default", alert_sinks=[])
    >>> _ = m.replay({"step": [0, 1], "trn_loss": [1.0, 2.0]})
    >>> print(unbound_warning(m, ["trn_loss"]))  # doctest: +NORMALIZE_WHITESPACE
    no metric bound to a detector (only the NaN/inf check runs). Metrics seen: trn_loss.
    Closest known names: trn_loss ~ train_loss (-> loss). Map names with [monitor.aliases],
    e.g. "trn_loss" = "loss".
    """
    import difflib

    from stability.monitor.binding import DEFAULT_ALIASES

    specific = [d for d in monitor.config.detectors if any(i.strip("*/") for i in d.inputs)]
    if not specific or any(monitor.series(d.name) for d in specific):
        return None
    own = getattr(monitor, "_own", None)  # the guard's own stability/* logs: never inputs
    seen = [n for n in names if n != "step" and not (own is not None and own(n))]
    known: dict[str, str] = {}  # candidate name -> canonical name
    for d in specific:
        for i in d.inputs:
            base = i.split("*")[0].rstrip("/")
            if base:
                known.setdefault(base, base)
    for raw, canon in {**DEFAULT_ALIASES, **monitor.config.monitor.aliases}.items():
        if not raw.endswith("*") and canon.split("/")[0] in known:
            known.setdefault(raw, canon)
    hints = []
    for n in seen[:20]:
        best = difflib.get_close_matches(n, list(known), n=1, cutoff=0.5)
        if best:
            k = best[0]
            hints.append((n, k, known[k]))
    msg = ("no metric bound to a detector (only the NaN/inf check runs). Metrics seen: "
           + (", ".join(seen[:20]) + (", ..." if len(seen) > 20 else "") if seen else "none")
           + ".")
    if hints:
        msg += " Closest known names: " + ", ".join(
            f"{n} ~ {k}" + (f" (-> {c})" if c != k else "") for n, k, c in hints)
        n, _, c = hints[0]
        msg += f'. Map names with [monitor.aliases], e.g. "{n}" = "{c}".'
    return msg


def decisions_to_records(decisions: Iterable[Decision]) -> Iterator[dict[str, Any]]:
    """JSON-compatible records of the decisions that carry alarms or interventions."""
    for d in decisions:
        if d.alarms or d.interventions or d.skipped:
            yield d.to_dict()


def write_events(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]],
                 run_id: str = "") -> int:
    """Write decision records as JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``).

    JSONL: the live event log's records (:func:`stability.outputs.events.decision_records`:
    ``alarm`` / ``intervention`` / ``info``, each with ``run_id``), so ``report --events`` and
    every reader take either file.  Parquet gets one row per alarm / intervention:
    ``run_id, step, event, kind, detail`` (``detail`` is the JSON of the alarm or
    intervention).  Returns the number of decision records.
    The file is written atomically and replaces only an events file of ours (JSON Lines of
    objects, or a Parquet file): anything else -- a checkpoint, a config, the job's metrics --
    is refused with ``ValueError`` and left untouched
    (:mod:`stability.outputs.safe_files`).
    """
    from stability.outputs.safe_files import check_replaceable

    p = Path(path)
    check_replaceable(p, _events_file_of_ours)
    recs = list(records)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows: dict[str, list[Any]] = {"run_id": [], "step": [], "event": [], "kind": [],
                                      "detail": []}
        for r in recs:
            for a in r.get("alarms", []):
                for k, v in (("event", "alarm"), ("kind", a["kind"])):
                    rows[k].append(v)
                rows["run_id"].append(run_id)
                rows["step"].append(int(r["step"]))
                rows["detail"].append(json.dumps(a))
            for i in r.get("interventions", []):
                rows["run_id"].append(run_id)
                rows["step"].append(int(r["step"]))
                rows["event"].append("intervention")
                rows["kind"].append(i["type"])
                rows["detail"].append(json.dumps(i))
        table = pa.table({"run_id": pa.array(rows["run_id"], pa.string()),
                          "step": pa.array(rows["step"], pa.int64()),
                          "event": pa.array(rows["event"], pa.string()),
                          "kind": pa.array(rows["kind"], pa.string()),
                          "detail": pa.array(rows["detail"], pa.string())})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        _write_atomic(p, sink.getvalue().to_pybytes())
    else:  # the live event log's schema (stability.outputs.events), one record per event
        from stability.outputs.events import decision_records

        _write_atomic(p, "".join(json.dumps(e) + "\n" for r in recs
                                 for e in decision_records(r, run_id=run_id)).encode())
    return len(recs)


def _events_file_of_ours(head: bytes) -> bool:
    """An events file this module (or the event log) wrote: JSON Lines of objects whose first
    key is ``run_id`` or ``type``, or a Parquet file."""
    return head.startswith((b'{"run_id":', b'{"type":', b"PAR1"))


def _write_atomic(path: Path, data: bytes) -> None:
    from stability.outputs.safe_files import atomic_write

    atomic_write(path, data, ours=_events_file_of_ours)


#: rows per chunk when a long replay draws a progress bar
PROGRESS_ROWS = 100_000


def replay_table(table: pa.Table, config: Any, run_id: str = "", path: str = "",
                 events: str | os.PathLike[str] | None = None,
                 progress: bool | None = False, *,
                 names: Sequence[str] | None = None, monitor: Any = None) -> ReplayResult:
    """Replay an in-memory run table through a fresh monitor built from ``config`` (or through
    ``monitor``, e.g. one primed by :func:`stability.monitor.calibrate.calibrate`).

    ``progress``: draw a bar over the rows on stderr (``None``: when stderr is a TTY and the run
    has more than :data:`PROGRESS_ROWS` rows); the run is then fed in chunks, which gives the
    same decisions (:meth:`~stability.monitor.monitor.Monitor.replay_batches`).  ``names``: the
    run's
    column names when ``table`` holds only some of them (for the unbound-metrics warning).
    """
    t0 = time.perf_counter()
    mon = _monitor(config) if monitor is None else monitor
    n = table.num_rows
    if progress is None:
        progress = n > PROGRESS_ROWS and sys.stderr.isatty()
    if progress:
        bar = Progress(n, f"replay {run_id}".strip(), True)
        decisions: list[Decision] = []
        try:
            for d in mon.replay_stream(table.to_batches(max_chunksize=PROGRESS_ROWS)):
                decisions += d.events()
                bar.update(len(d))
        finally:
            bar.close()
    else:
        decisions = mon.replay(table).events()  # the steps with alarms / interventions
    steps = np.asarray(table.column("step").to_numpy(zero_copy_only=False), dtype=np.int64)
    return _result(mon, decisions, steps, table.column_names if names is None else names,
                   run_id, path, events, t0)


def _result(mon: Any, decisions: list[Decision], steps: NDArray[np.int64], names: Sequence[str],
            run_id: str, path: str, events: str | os.PathLike[str] | None,
            t0: float) -> ReplayResult:
    """The :class:`ReplayResult` of a replay's ``decisions`` (the steps with alarms or
    interventions), its events written when asked, and the unbound-metrics warning."""
    note = unbound_warning(mon, names)
    if note is not None:
        warnings.warn(f"{run_id or path or 'run'}: {note}", UserWarning, stacklevel=3)
    alarms = [a for d in decisions for a in d.alarms]
    ivs = [i for d in decisions for i in d.interventions]
    res = ReplayResult(run_id=run_id, path=path, n_steps=int(steps.size), steps=steps,
                       alarms=alarms, interventions=ivs, goodput=goodput(steps, ivs))
    if events is not None:
        write_events(events, decisions_to_records(decisions), run_id)
    res.seconds = time.perf_counter() - t0
    return res


def plan_replay(p: str, cfg: Any) -> tuple[RunStream | None, list[str] | None]:
    """The :class:`~replay.stream.RunStream` of a Parquet run in replay order for a monitor
    built from the parsed config ``cfg`` (only the columns it binds, as :func:`read_bound`
    reads them) and the run's column names when that is a projection; ``None``: read whole
    (also when :data:`replay.stream.ENABLED` is off)."""
    from .io import detect_format
    from .reader import read_schema

    if not run_stream.ENABLED:
        return None, None
    try:
        if detect_format(p) != "parquet":
            return None, None
    except (OSError, ValueError):
        return None, None
    if any(i == "*" for d in cfg.detectors for i in d.inputs):
        return plan_stream(p), None
    try:
        names = read_schema(p).names
    except (OSError, ValueError):
        return None, None
    metrics = [c for c in names if c != "step"]
    keep = _monitor(cfg).bound_names(metrics)  # a probe: asking binds the names
    return plan_stream(p, None if len(keep) == len(metrics) else keep), names


def replay_stream(stream: RunStream, config: Any, run_id: str = "", path: str = "",
                  events: str | os.PathLike[str] | None = None,
                  progress: bool | None = False, *,
                  names: Sequence[str] | None = None) -> ReplayResult:
    """:func:`replay_table` of a :class:`~replay.stream.RunStream`: the same
    :class:`ReplayResult`, the run read batch after batch.  ``names``: the run's column names
    when the stream reads only some of them (for the unbound-metrics warning)."""
    t0 = time.perf_counter()
    mon = _monitor(config)
    n = int(stream.steps.size)
    if progress is None:
        progress = n > PROGRESS_ROWS and sys.stderr.isatty()
    bar = Progress(n, f"replay {run_id}".strip(), bool(progress))
    decisions: list[Decision] = []
    try:
        for d in mon.replay_stream(stream.batches()):
            decisions += d.events()  # the steps with alarms / interventions
            bar.update(len(d))
            del d
    finally:
        bar.close()
    return _result(mon, decisions, stream.steps, stream.names if names is None else names,
                   run_id, path, events, t0)


def read_bound(path: str | os.PathLike[str], config: Any) -> tuple[pa.Table, list[str]]:
    """Read a run, only the columns a monitor built from ``config`` binds where the format
    allows it (Parquet: a column projection, footers read first); returns the table and every
    column name of the run.  A config with a catch-all input (``"*"``, the default preset's
    NaN check) binds every column: the run is read whole.
    """
    from stability.config.config import load_config

    from .io import detect_format
    from .reader import read_run, read_schema

    p = os.fspath(path)
    cfg = load_config(config)
    if detect_format(p) != "parquet" or any(i == "*" for d in cfg.detectors for i in d.inputs):
        table = read_table(p)
        return table, list(table.column_names)
    names = read_schema(p).names
    metrics = [c for c in names if c != "step"]
    keep = _monitor(cfg).bound_names(metrics)  # a probe: asking binds the names
    if len(keep) == len(metrics):
        return read_run(p), names
    return read_run(p, columns=keep), names


def replay_run(path: str | os.PathLike[str], config: Any = None, *,
               events: str | os.PathLike[str] | None = None,
               run_id: str | None = None, progress: bool | None = False,
               calibrate: Any = None) -> ReplayResult:
    """Replay one recorded run (file or directory of parts) through the monitor.

    A Parquet run in replay order is streamed (bounded memory, same result: :func:`plan_replay`,
    :mod:`replay.stream`).

    Parameters
    ----------
    path
        The run.
    config
        Monitor config: preset name, path, dict or ``MonitorConfig`` (``None`` = the default).
    events
        Optional ``.jsonl`` / ``.parquet`` path for the alarms and interventions.
    run_id
        Defaults to the file stem / directory name.
    progress
        Progress bar on stderr for a long run (see :func:`replay_table`).
    calibrate
        Earlier history to prime the detectors with before the replay (a path of a recorded
        run or log, or a table; :func:`stability.monitor.calibrate.calibrate` with
        ``resume=False``): a run that starts near an event is not scored by detectors still
        warming up.
    """
    p = os.fspath(path)
    rid = run_id if run_id is not None else Path(p).stem
    said = progress is None and sys.stderr.isatty()
    if said:
        sys.stderr.write(f"reading {p} ...")
        sys.stderr.flush()
    from stability.config.config import load_config

    t0 = time.perf_counter()
    cfg = load_config(_default_config(config))  # parsed once for the probe and the replay
    if calibrate is not None:
        return _replay_calibrated(p, cfg, rid, calibrate, events, progress, said, t0)
    stream, names = plan_replay(p, cfg)
    table = None if stream is not None else read_bound(p, cfg)
    if said:
        sys.stderr.write("\r\033[K")  # clear the line for the bar / the summary
    if stream is not None:  # in replay order: batch after batch (bounded memory)
        with contextlib.suppress(OutOfOrder):  # unsorted / duplicate steps: read whole below
            res = replay_stream(stream, cfg, rid, p, events, progress, names=names)
            res.seconds = time.perf_counter() - t0
            return res
    table, names = table or read_bound(p, cfg)
    res = replay_table(table, cfg, rid, p, events, progress, names=names)
    res.seconds = time.perf_counter() - t0
    return res


def _replay_calibrated(p: str, cfg: Any, rid: str, history: Any,
                       events: str | os.PathLike[str] | None, progress: bool | None,
                       said: bool, t0: float) -> ReplayResult:
    """:func:`replay_run` through a monitor primed on ``history`` first (whole-table path)."""
    from stability.monitor.calibrate import calibrate

    mon = _monitor(cfg)
    prime = read_table(os.fspath(history)) if isinstance(history, (str, os.PathLike)) else history
    calibrate(mon, prime, resume=False)
    table, names = read_bound(p, cfg)
    if said:
        sys.stderr.write("\r\033[K")
    res = replay_table(table, cfg, rid, p, events, progress, names=names, monitor=mon)
    res.seconds = time.perf_counter() - t0
    return res


def _default_config(config: Any) -> Any:
    return "default" if config is None else config


def _replay_job(args: tuple[str, str, Any, str | None]) -> ReplayResult:
    rid, path, config, events = args
    return replay_run(path, config, events=events, run_id=rid)


def replay_many(runs: Sequence[tuple[str, str]], config: Any = None, *, jobs: int | None = None,
                events_dir: str | os.PathLike[str] | None = None, events_suffix: str = ".jsonl",
                progress: bool | None = None, backend: str = "local",
                address: str | None = None,
                failed: list[RunFailure] | None = None) -> list[ReplayResult]:
    """Replay many runs in parallel, keeping the input order.

    ``backend``: ``"local"`` (``jobs`` processes, default one per core) or ``"ray"`` (the
    cluster at ``address``; :func:`replay.fleet.fan_out`): the same jobs, the same results.
    ``events_dir`` (optional) receives one ``<run_id><events_suffix>`` file per run (written
    by the job: on Ray, give a path every worker can write).  ``failed`` (optional list): a
    run that cannot be read is appended there as a :class:`replay.fleet.RunFailure` and left
    out of the results, every other run is replayed (without it, its error propagates).  The
    config is checked here first: a bad config is one error, not one failure per run.
    """
    from stability.config.config import load_config

    cfg = _default_config(config)
    load_config(cfg)  # a bad config fails the command, not every run
    if events_dir is not None:
        Path(events_dir).mkdir(parents=True, exist_ok=True)
    jobs_args = [(rid, p, cfg, None if events_dir is None
                  else str(Path(events_dir) / f"{rid}{events_suffix}")) for rid, p in runs]
    return fan_out_runs(_replay_job, jobs_args, failed=failed, backend=backend, jobs=jobs,
                        label="replay", progress=progress, address=address)


def _num(x: Any) -> str:
    """A score for people: 3 significant digits (``460.1076...`` -> ``460``).

    >>> _num(460.10761853489885), _num(0.0123456), _num(float("inf")), _num(None)
    ('460', '0.0123', 'inf', 'None')
    """
    return f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def format_summary(res: ReplayResult) -> str:
    """Human-readable summary of one replay."""
    s = res.summary()
    lines = [f"run {s['run_id']}  ({s['n_steps']} steps, {s['first_step']}..{s['last_step']},"
             f" {res.path})"]
    if not res.alarms:
        lines.append("  no alarms")
    else:
        fa = s["first_alarm"]
        lines.append(f"  alarms: {s['alarms']} on {s['alarm_steps']} steps; first at step "
                     f"{fa['step']}: {fa['kind']} on {fa['signal']} ({fa['detector']}, "
                     f"score {_num(fa['score'])}, threshold {_num(fa['threshold'])})")
        for k, v in s["alarms_by_kind"].items():
            lines.append(f"    {k:<22} {v}")
    if res.interventions:
        causes = Counter(i.cause for i in res.interventions if getattr(i, "cause", ""))
        if causes:
            lines.append("  attributed causes: " + ", ".join(
                f"{c} x{n}" for c, n in causes.most_common()))
        lines.append("  interventions that would have been requested:")
        for k, v in s["interventions_by_type"].items():
            first = next(i for i in res.interventions if i.type == k)
            lines.append(f"    {k:<14} x{v:<5} first at step {first.step}"
                         + (f" ({first.reason})" if first.reason else "")
                         + (f" [cause: {first.cause}]" if getattr(first, "cause", "") else ""))
    else:
        lines.append("  no interventions")
    g = s["goodput"]
    stop = "none" if g["stop_step"] is None else (f"step {g['stop_step']} "
                                                  f"({g['steps_after_stop']} steps saved)")
    lines.append(f"  goodput {g['goodput']:.4f}: skipped {g['skipped_steps']}, rolled back "
                 f"{g['rollback_steps']}, stop {stop}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- evaluation runs
def _eval_job(args: tuple[str, str, Any, bool]
              ) -> tuple[str, NDArray[np.int64], dict[str, NDArray[np.int64]]]:
    rid, path, config, with_baselines = args
    table = read_table(path)
    steps = table.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
    out: dict[str, NDArray[np.int64]] = {"ours": replay_table(table, config, rid, path).alarm_steps}
    if with_baselines:
        from .baselines import baseline_alarms

        out.update(baseline_alarms(table))
    return rid, steps, out


def alarms_for_eval(runs: Sequence[tuple[str, str]], config: Any = None, *,
                    baselines: bool = False, jobs: int | None = None,
                    progress: bool | None = None, backend: str = "local",
                    address: str | None = None, failed: list[RunFailure] | None = None
                    ) -> tuple[dict[str, NDArray[np.int64]], dict[str, dict[str,
                                                                           NDArray[np.int64]]]]:
    """Alarm steps of our config (and optionally every baseline) on every run, in parallel
    (``backend``, ``jobs``, ``address``, ``failed``: as :func:`replay_many`; a failed run is in
    neither mapping, so name it next to any figure computed from them).

    Returns
    -------
    steps, alarms
        ``run_id -> logged steps`` and ``name -> run_id -> alarm steps`` (``name`` is ``ours``
        or a baseline name).
    """
    from stability.config.config import load_config

    load_config(_default_config(config))  # a bad config fails the command, not every run
    args = [(rid, p, config, baselines) for rid, p in runs]
    results = fan_out_runs(_eval_job, args, failed=failed, backend=backend, jobs=jobs,
                           label="eval", progress=progress, address=address)
    steps: dict[str, NDArray[np.int64]] = {}
    alarms: dict[str, dict[str, NDArray[np.int64]]] = {}
    for rid, st, per in results:
        steps[rid] = st
        for name, a in per.items():
            alarms.setdefault(name, {})[rid] = a
    return steps, alarms
