"""Command line: ``stability replay | eval | tune | report | watch | goodput | warmup``.

Examples
--------
::

    stability replay runs/public/runs/public_0009.parquet --events events.jsonl
    stability replay 'runs/*.parquet' --jobs 8
    stability replay 's3://bucket/runs/' --backend ray --ray-address auto
    stability eval runs/public/runs --labels runs/public/labels.parquet --baselines
    stability tune runs/public/runs modded_nanogpt/train_loss --labels labels.parquet \\
        --budget 1.0 -o tuned.toml --folds 5 [--backend ray]
    stability report ...        # provided by replay.report
    stability watch train.log --state watch.json --on stop='scancel 42'   # replay.watch

``RUN`` / ``RUNS`` may be a ``.parquet`` file, a directory of ``part-*.parquet`` files, a
directory of runs or a glob; several may be given.  Heavy modules are imported lazily, so
``stability --help`` is fast.

Errors: every user error (a missing, unreadable or malformed run / labels / config file, a bad
option value, an unwritable ``--events`` path, a full disk) prints **one line** on stderr,
``stability COMMAND: error: FILE: PROBLEM``, and exits with status 2 (argparse's usage errors
too).  ``--debug`` (anywhere on the command line, or ``STABILITY_DEBUG=1``) also prints the
traceback.  Anything else is a bug in stability and keeps its traceback (status 1).

Several runs (``replay``, ``eval``, ``tune`` over a folder, a glob or several RUNs): a run that
cannot be read is a *failed run*, not the end of the command -- one line on stderr,
``stability COMMAND: failed: run RUN_ID: FILE: PROBLEM`` (in ``replay --json``: an entry with
an ``error`` field; in ``eval --json``: a ``failed`` list), every other run is done and
printed, the figures of ``eval`` / ``tune`` say which runs they leave out, and the status is 1.
A single run keeps the one-line error and status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from replay.fleet import BackendUnavailable, RunFailure
from replay.fleet import describe_error as describe_error


def _eval_args(p: argparse.ArgumentParser) -> None:
    from replay.evaluate import DEFAULT_GAP, DEFAULT_TOLERANCE, DEFAULT_WINDOW

    g = p.add_argument_group("evaluation definitions (see replay.evaluate)")
    g.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="steps after the onset in which an alarm detects the fault "
                        "(default %(default)s)")
    g.add_argument("--tolerance", type=int, default=DEFAULT_TOLERANCE,
                   help="steps before the onset still accepted (default %(default)s)")
    g.add_argument("--gap", type=int, default=DEFAULT_GAP,
                   help="alarms closer than this are one episode (default %(default)s)")


def _backend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the jobs run (see replay.fleet)")
    g.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local processes or a Ray cluster (default %(default)s)")
    g.add_argument("--jobs", "-j", type=int, default=None,
                   help="local processes (default: cores); with ray, tasks (default: 4 per "
                        "cluster CPU)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster (auto, ray://HOST:10001, HOST:6379; default: RAY_ADDRESS, "
                        "else a local Ray instance)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="stability", description="Watch training runs; replay, evaluate and tune offline.")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (also: STABILITY_DEBUG=1)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_replay(sub)
    _add_eval(sub)
    _add_tune(sub)
    p = sub.add_parser("report", help="render a report (replay.report)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    _add_watch(sub)
    _add_small(sub)
    return parser


def _add_replay(sub: Any) -> None:
    """``stability replay``: recorded runs through the monitor."""
    p = sub.add_parser("replay", help="replay recorded runs through the monitor")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run file, part directory, "
                   "directory of runs or glob")
    p.add_argument("--config", "-c", default=None, help="preset name or .toml/.json config")
    p.add_argument("--events", default=None,
                   help="write alarms/interventions here (.jsonl or .parquet); with several "
                        "runs, a directory (one file per run)")
    _backend_args(p)
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    p.add_argument("--save-state", default=None, metavar="S",
                   help="one run: write the monitor state after the replay to S (JSON) for "
                        "Monitor.load_state_dict, so a live run continues primed")
    p.add_argument("--calibrate", default=None, metavar="HISTORY",
                   help="prime the detectors on HISTORY (an earlier run or log of the same "
                        "recipe) before replaying, so a run that starts near an event is not "
                        "blind (nothing is emitted while priming)")


def _add_eval(sub: Any) -> None:
    """``stability eval``: alarms scored against labels."""
    p = sub.add_parser("eval", help="score alarms against labels (ours vs baselines)")
    p.add_argument("runs", nargs="+", metavar="RUNS")
    p.add_argument("--labels", "-l", default=None,
                   help="labels file (.parquet/.json/.csv); unlabelled runs count as clean")
    p.add_argument("--config", "-c", default=None, help="preset name or .toml/.json config")
    p.add_argument("--baselines", action="store_true", help="also score the industry rules")
    _backend_args(p)
    p.add_argument("--per-scenario", action="store_true", help="print the per-kind breakdown")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    _eval_args(p)


def _add_tune(sub: Any) -> None:
    """``stability tune``: thresholds under a false-alarm budget."""
    p = sub.add_parser("tune", help="tune parameters/thresholds under a false-alarm budget")
    p.add_argument("runs", nargs="+", metavar="RUNS")
    p.add_argument("--labels", "-l", default=None)
    p.add_argument("--budget", type=float, required=True,
                   help="max false alarms per 10k clean steps")
    _tune_limit_args(p)
    p.add_argument("--output", "-o", required=True, help="tuned config (.toml or .json)")
    p.add_argument("--config", "-c", default=None, help="base config (default preset)")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds (0/1 = none)")
    _backend_args(p)
    p.add_argument("--thresholds", type=int, default=1000,
                   help="thresholds swept per candidate (default %(default)s)")
    _eval_args(p)


def _tune_limit_args(p: argparse.ArgumentParser) -> None:
    """The tuner's limits besides ``--budget`` (docs/guides/tuning.md, "Limits")."""
    from replay.tuning_limits import (
        DEFAULT_HOLD_BACK,
        DEFAULT_MAX_CLEAN_ALARMED,
        DEFAULT_MIN_GAIN,
    )

    p.add_argument("--max-clean-alarmed", type=_fraction, default=DEFAULT_MAX_CLEAN_ALARMED,
                   metavar="F", help="max fraction of clean runs with any alarm episode "
                   "(default %(default)s; 1 = the budget alone)")
    p.add_argument("--min-gain", type=_count, default=DEFAULT_MIN_GAIN, metavar="N",
                   help="a move must detect N more labelled faults (default %(default)s; "
                        "0 = any gain, lead time included)")
    p.add_argument("--hold-back", type=_fraction, default=DEFAULT_HOLD_BACK, metavar="F",
                   help="fraction of the clean runs held back from tuning; every move must "
                        "keep both limits on them too (default %(default)s; 0 = off)")


def _fraction(text: str) -> float:
    """A float in [0, 1] (argparse type)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v


def _count(text: str) -> int:
    """An int >= 0 (argparse type)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _add_watch(sub: Any) -> None:
    """``stability watch``: a live job's logs through the monitor."""
    p = sub.add_parser("watch", help="follow a live job's logs through the monitor "
                       "(replay.watch)")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="JSONL/CSV file, Megatron/DeepSpeed log, TensorBoard dir, recorder part "
                        "dir (local or URI); several = one run")
    p.add_argument("--config", "-c", default=None, help="preset name or .toml/.json config")
    p.add_argument("--state", default=None, help="state file: loaded at start, saved "
                   "periodically and on exit (restarts neither re-warm nor re-judge)")
    p.add_argument("--events", default=None, help="append alarms/interventions here (.jsonl)")
    p.add_argument("--on", action="append", default=[], metavar="KIND=CMD",
                   help="run CMD (shell) for each intervention of KIND (stop, skip_step, ...; "
                        "alarm; any) with STABILITY_STEP/KIND/REASON/CAUSE/CONTROL set")
    p.add_argument("--control-file", default=None,
                   help="write the latest Control as JSON here (atomically) for a trainer")
    p.add_argument("--once", action="store_true", help="process what is there and exit")
    p.add_argument("--poll", type=float, default=5.0, help="seconds between polls (%(default)s)")
    p.add_argument("--save-every", type=float, default=30.0,
                   help="seconds between state saves (%(default)s)")
    p.add_argument("--format", default=None,
                   choices=("jsonl", "csv", "megatron", "tensorboard", "parquet"))
    p.add_argument("--prometheus-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics on this port (needs prometheus_client)")
    p.add_argument("--prometheus-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics server binds (default 127.0.0.1: this machine "
                        "only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--backlog", choices=("act", "quiet"), default="act",
                   help="what a fresh watcher (no state) finds at start: act on it, or only "
                        "warm the monitor on it (default %(default)s)")
    p.add_argument("--quiet", "-q", action="store_true", help="no line per alarm step")
    g = p.add_argument_group("the culprit rank (replay.watch_ranks)")
    g.add_argument("--ranks", action="store_true",
                   help="SOURCEs are per-rank logs (one file per rank, or one log with "
                        "[rankN]: prefixes): name the rank/host that departs or stalls")
    g.add_argument("--hosts", default=None, metavar="H0,H1,...", help="host name per rank")
    g.add_argument("--world", type=int, default=None, help="world size (default: from the logs)")
    g.add_argument("--stall-after", type=float, default=60.0, metavar="SECONDS",
                   help="silence that makes a rank stalled while others log (%(default)s)")


def _add_small(sub: Any) -> None:
    """``ranks``, ``goodput`` and ``warmup``: one or two arguments each."""
    p = sub.add_parser("ranks", help="per-rank health (which rank or host is the culprit)")
    p.add_argument("events", metavar="EVENTS", help="event log (.jsonl) of a multi-rank run")

    p = sub.add_parser("goodput", help="badput breakdown of an event log (time and steps)")
    p.add_argument("events", metavar="EVENTS", help="event log (.jsonl) written by a monitor")
    p.add_argument("--json", action="store_true", help="print the last goodput record as JSON")

    p = sub.add_parser("warmup", help="compile and cache the Numba kernels a config uses "
                       "(honours NUMBA_CACHE_DIR)")
    p.add_argument("--config", "-c", default=None, help="preset name or .toml/.json config")

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("training-stability")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        from stability import __version__

        return __version__


def _cmd_ranks(a: argparse.Namespace) -> int:
    from stability.outputs.events import read_events
    from stability.ranks.ranks import format_ranks

    print(format_ranks(read_events(a.events, errors="skip")))
    return 0


def _cmd_goodput(a: argparse.Namespace) -> int:
    from stability.outputs.events import read_events
    from stability.run.goodput import format_goodput

    records = read_events(a.events, errors="skip")
    if a.json:
        last = [r for r in records if r.get("type") == "goodput"][-1:]
        print(json.dumps(last[0] if last else None, indent=1, default=_json_default))
        return 0 if last else 1
    print(format_goodput(records))
    return 0


def _cmd_warmup(a: argparse.Namespace) -> int:
    """Compile (or load from the cache) every kernel the config uses, one line per detector.

    Each detector is built alone with one series and updated once: the arrays have the types
    the monitor passes (float64 / bool, C-contiguous), so the cached specialisation is the one
    a training run loads.  A one-step ``observe`` then compiles the monitor's own gather kernel.
    Compilation happens here (``blocking`` mode): no interpreted twin, no background child.
    """
    from detectors import dispatch
    from stability.config.config import load_config

    cfg = load_config(a.config)
    with dispatch.using_mode("blocking"):  # compile here and now, not in the background
        return _warm_kernels(cfg)


def _warm_kernels(cfg: Any) -> int:
    """Build each detector of ``cfg`` once, then a one-step monitor; print the times."""
    import time

    import numba

    from stability.config.registry import make_detector
    from stability.monitor.monitor import Monitor

    cache_dir = getattr(numba.config, "CACHE_DIR", "")
    print(f"numba cache: {cache_dir or '(next to the sources, __pycache__)'}")
    t_all = time.perf_counter()
    done: set[str] = set()
    for spec in cfg.detectors:
        if spec.detector in done:
            continue
        done.add(spec.detector)
        t0 = time.perf_counter()
        det = make_detector(spec.detector, spec.params, n_series=1,
                            n_inputs=len(spec.inputs), where=f"detectors[{spec.name}]")
        det.update(*([1.0] * det.n_inputs))
        print(f"  {spec.detector:<18} {time.perf_counter() - t0:6.2f} s")
    t0 = time.perf_counter()
    Monitor(cfg).observe(0, {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0})
    print(f"  {'monitor':<18} {time.perf_counter() - t0:6.2f} s")
    print(f"warm: {len(done)} detector kernels in {time.perf_counter() - t_all:.2f} s")
    return 0


def _runs(specs: Sequence[str]) -> list[tuple[str, str]]:
    from replay.replay import discover_many

    return discover_many(specs)


def _cmd_replay(a: argparse.Namespace) -> int:
    from replay.replay import replay_run

    runs = _runs(a.runs)
    if a.save_state and len(runs) != 1:
        raise ValueError(f"--save-state takes one run; got {len(runs)}.")
    if a.calibrate and len(runs) != 1:
        raise ValueError(f"--calibrate takes one run; got {len(runs)}.")
    failed: list[RunFailure] = []
    try:
        if len(runs) == 1:  # nothing to fan out: replayed here, whatever the backend
            rid, path = runs[0]
            results = [replay_run(path, a.config, events=a.events, run_id=rid, progress=None,
                                  calibrate=a.calibrate)]
        else:
            results = _replay_several(a, runs, failed)
        if a.save_state:
            _save_state(runs, a.config, a.save_state)
    except OSError as exc:
        if exc.filename is None and a.events:  # a write error (full disk) knows no file name
            exc.filename = a.events
        raise
    _print_replays(a, runs, results, failed)
    return 1 if failed else 0


def _replay_several(a: argparse.Namespace, runs: list[tuple[str, str]],
                    failed: list[RunFailure]) -> list[Any]:
    """``replay_many`` for the command line: events into a directory, unreadable runs into
    ``failed`` (each named on stderr as it is known)."""
    from pathlib import Path

    from replay.replay import replay_many

    suffix = ".jsonl"
    if a.events and Path(a.events).suffix in (".jsonl", ".parquet"):
        suffix = Path(a.events).suffix
        a.events = str(Path(a.events).with_suffix(""))
    results = replay_many(runs, a.config, jobs=a.jobs, events_dir=a.events,
                          events_suffix=suffix, backend=a.backend, address=a.ray_address,
                          failed=failed)
    _say_failed("replay", failed)
    return results


def _say_failed(command: str, failed: Sequence[RunFailure]) -> None:
    """One line on stderr per run that could not be read."""
    for f in failed:
        print(f"stability {command}: failed: {f.line()}", file=sys.stderr)


def _print_replays(a: argparse.Namespace, runs: list[tuple[str, str]], results: list[Any],
                   failed: list[RunFailure]) -> None:
    """The summaries (and failed runs) in the runs' order, as text or JSON."""
    from replay.replay import format_summary

    by_id: dict[str, Any] = {r.run_id: r for r in [*results, *failed]}
    ordered = [by_id[rid] for rid, _ in runs if rid in by_id]
    if a.json:
        print(json.dumps([r.summary() for r in ordered], indent=1, default=str))
        return
    for r in ordered:
        print(f"run {r.run_id}  FAILED: {r.message()}" if isinstance(r, RunFailure)
              else format_summary(r))
    if len(runs) > 1:
        alarmed = sum(bool(r.alarms) for r in results)
        lost = f", {len(failed)} could not be read" if failed else ""
        print(f"\n{len(runs)} runs{lost}, {alarmed} with alarms, "
              f"{sum(r.n_steps for r in results)} steps")
    if a.events:
        print(f"events written to {a.events}")


def _cmd_watch_ranks(a: argparse.Namespace) -> int:
    from replay.watch_ranks import RankWatcher

    w = RankWatcher(a.sources, hosts=a.hosts.split(",") if a.hosts else None, world=a.world,
                    stall_after=a.stall_after, events=a.events,
                    echo=None if a.quiet else lambda line: print(line, flush=True))
    try:
        w.run(once=a.once, poll=a.poll)
    finally:
        w.close()
    print(w.summary(), file=sys.stderr)
    return 0


def _cmd_watch(a: argparse.Namespace) -> int:
    import signal
    import threading

    if a.ranks:
        return _cmd_watch_ranks(a)
    from replay.watch import Watcher, parse_hooks

    w = Watcher(a.sources, a.config, state=a.state, events=a.events, hooks=parse_hooks(a.on),
                control_file=a.control_file, format=a.format, save_every=a.save_every,
                backlog=a.backlog,
                echo=None if a.quiet else lambda line: print(line, flush=True))
    if a.prometheus_port is not None:
        from stability.outputs.prometheus import PrometheusExporter

        w.exporter = PrometheusExporter(w.monitor, port=a.prometheus_port,
                                        addr=a.prometheus_addr)

    got: list[int] = []

    def _stop(signum: int, frame: Any) -> None:
        got.append(signum)
        w.stop()  # finish the poll under way, kill the hooks, save the state, exit 0

    main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)
           if main_thread}
    try:
        w.run(once=a.once, poll=a.poll, collect=False)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        w.close()
    print(w.summary() + (f"; state saved to {a.state}" if a.state else ""), file=sys.stderr)
    if signal.SIGTERM in got:  # a supervisor wants us gone: everything is saved and closed,
        _exit_now(w)           # skip the interpreter's slow teardown (numba, GC)
    return 0


def _exit_now(w: Any) -> None:
    """Close the monitor's outputs (sinks, event log), flush stdio and leave at once (0)."""
    import os

    try:
        w.monitor.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)



def _save_state(runs: list[tuple[str, str]], config: Any, out: str) -> None:
    from replay.replay import read_table
    from stability.monitor.monitor import Monitor

    mon = Monitor("default" if config is None else config, alert_sinks=[])
    mon.replay(read_table(runs[0][1]))
    from stability.outputs.safe_files import atomic_write, json_object

    atomic_write(out, json.dumps(mon.state_dict()).encode(), ours=json_object)


def _eval_settings(a: argparse.Namespace) -> dict[str, int]:
    return {"window": a.window, "tolerance": a.tolerance, "gap": a.gap}


def _cmd_eval(a: argparse.Namespace) -> int:
    from replay.evaluate import evaluate_runs, format_scenarios, format_table
    from replay.labels import load_labels
    from replay.replay import alarms_for_eval

    runs = _runs(a.runs)
    labels = load_labels(a.labels) if a.labels else {}
    failed: list[RunFailure] = []
    steps, alarms = alarms_for_eval(runs, a.config, baselines=a.baselines, jobs=a.jobs,
                                    backend=a.backend, address=a.ray_address,
                                    failed=failed if len(runs) > 1 else None)
    _say_failed("eval", failed)
    if not steps:
        raise ValueError(f"none of the {len(runs)} runs could be read")
    summaries = {}
    for name, per_run in alarms.items():
        summaries[name] = evaluate_runs(per_run, steps, labels, **_eval_settings(a))[0]
    if a.json:
        out: dict[str, Any] = {k: v.to_dict() for k, v in summaries.items()}
        if failed:
            out["failed"] = [f.summary() for f in failed]
        print(json.dumps(out, indent=1, default=_json_default))
        return 1 if failed else 0
    s0 = summaries["ours"]
    print(f"{len(steps)} runs ({s0.n_clean} clean, {s0.n_visible} visible faults, "
          f"{s0.n_invisible} invisible, {s0.n_div} eligible divergences), "
          f"{s0.clean_steps} clean steps; ours = {a.config or 'default'} via the monitor")
    if failed:
        print(_left_out(failed, labels))
    print(format_table(summaries))
    if a.per_scenario:
        for name, s in summaries.items():
            print(f"\n[{name}]")
            print(format_scenarios(s))
    return 1 if failed else 0


def _left_out(failed: Sequence[RunFailure], labels: Any) -> str:
    """The line naming the runs a figure leaves out because they could not be read.

    >>> from replay.labels import RunLabel
    >>> _left_out([RunFailure("a", "a.csv", "bad")], {"a": RunLabel("a", "spike", 5)})
    'not in these figures (could not be read): a (labelled spike)'
    """
    def one(f: RunFailure) -> str:
        lab = labels.get(f.run_id)
        return f.run_id + (f" (labelled {lab.scenario})" if lab is not None else "")

    return "not in these figures (could not be read): " + ", ".join(one(f) for f in failed)


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def _cmd_tune(a: argparse.Namespace) -> int:
    from replay.evaluate import format_table
    from replay.labels import load_labels
    from replay.tuning import EvalSettings, tune, write_config

    runs = _runs(a.runs)
    labels = load_labels(a.labels) if a.labels else {}
    failed: list[RunFailure] = []
    res = tune(runs, labels, a.budget, config=a.config, folds=a.folds, backend=a.backend,
               jobs=a.jobs, settings=EvalSettings(**_eval_settings(a)),
               n_thresholds=a.thresholds, address=a.ray_address,
               failed=failed if len(runs) > 1 else None,
               max_clean_alarmed=a.max_clean_alarmed, min_gain=a.min_gain,
               hold_back_clean=a.hold_back)
    _say_failed("tune", failed)
    header = (f"tuned by `stability tune` on {len(runs) - len(failed)} runs, budget {a.budget} "
              f"false alarms per 10k clean steps, at most {a.max_clean_alarmed:g} of clean runs "
              f"alarmed, moves gaining >= {a.min_gain} faults, {a.hold_back:g} of clean runs "
              f"held back\n")
    if failed:
        header += _left_out(failed, labels) + "\n"
    if res.heldout is not None:
        h = res.heldout
        header += (f"held-out ({a.folds}-fold by run): recall {h.recall:.3f}, "
                   f"false alarms/10k {h.fa_per_10k:.3f}\n")
    write_config(a.output, res.file_config(), header + res.header())
    for c in res.choices:
        print(f"  {c['binding']:<24} {c['detector']:<12} threshold {c['threshold']:.4g}  "
              f"{json.dumps(c['params'])}")
    rows = {"train (all runs)": res.train}
    if res.heldout is not None:
        rows[f"held-out ({a.folds}-fold)"] = res.heldout
    if failed:
        print(_left_out(failed, labels))
    print(format_table(rows))
    secs = ", ".join(f"{k} {v:.2f}" for k, v in res.seconds.items())
    print(f"timings: {secs}")
    print(f"wrote {a.output}")
    return 1 if failed else 0


def _cmd_report(argv: Sequence[str]) -> int:
    import importlib

    mod = importlib.import_module("replay.report")
    entry = getattr(mod, "main", None)
    if entry is None:
        print("replay.report has no main(argv)", file=sys.stderr)
        return 2
    rc = entry(list(argv))
    return int(rc or 0)


#: exceptions that are the user's (files, configs, options, disk, a backend that cannot run),
#: reported in one line
USER_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, RecursionError, MemoryError,
                                                BackendUnavailable)


def _one_line_warning(command: str) -> Any:
    """``warnings.showwarning`` printing ``stability COMMAND: warning: MESSAGE`` on stderr."""
    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        print(f"stability {command}: warning: {message}", file=sys.stderr)

    return show


def _debug_wanted(args: list[str]) -> tuple[bool, list[str]]:
    env = os.environ.get("STABILITY_DEBUG", "").strip() not in ("", "0", "false", "no")
    if "--debug" in args:
        return True, [x for x in args if x != "--debug"]
    return env, args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stability`` console script (see the module docstring for errors)."""
    debug, args = _debug_wanted(list(sys.argv[1:] if argv is None else argv))
    command = args[0] if args else ""
    try:
        if command == "report":
            return _cmd_report(args[1:])
        parser = build_parser()
        a = parser.parse_args(args)
        if a.command is None:
            parser.print_help()
            return 2
        handlers = {"replay": _cmd_replay, "eval": _cmd_eval, "tune": _cmd_tune,
                    "goodput": _cmd_goodput, "ranks": _cmd_ranks, "watch": _cmd_watch,
                    "warmup": _cmd_warmup}
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning(command)
            return handlers[a.command](a)
    except USER_ERRORS as exc:
        if debug:
            traceback.print_exc()
        print(f"stability {command}: error: {describe_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"stability {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
