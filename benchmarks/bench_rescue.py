"""Does the monitor save runs?  A broad rescue benchmark on tiny models really trained on CPU.

Every fault class the detectors claim (:data:`CLASSES`, built on
:mod:`stability.testing.tinytrain` fault kinds) is injected into two architectures (a tiny MLP and
a character GPT) for several seeds; the onset is drawn per (architecture, seed, class),
deterministically, in the middle of the run.  Every faulty run is trained three ways:

* **none** -- no monitor;
* **monitor** -- ``train_run(..., monitor=Monitor(preset))``: the monitor attached through
  :class:`~stability.adapters.torch.TorchGuard` exactly as a user would (default preset ``small``,
  the trainer's default ``checkpoint_every``), optionally with a ``[policy]`` override;
* **counterfactual** -- the clean run of the same seed (same init, same batches).

Clean runs (no fault) are also trained with the monitor.  Definitions (all computed from the
runs, nothing hard-coded):

* a run *failed* when its final held-out loss is non-finite or > 1.05 x the counterfactual's;
* *saved*: it failed without the monitor and did not fail with it (final within 5%; a stopped
  run counts when the model it stopped with is that good);
* *stopped*: the monitor stopped the run;
* *worse*: it failed without the monitor and was not saved: with it the run was stopped or ended
  > 5% worse still (harm where ``harmed`` cannot see it);
* *harmed*: it did not fail without the monitor (clean runs included), but with the monitor it
  failed or was stopped;
* *steps lost*: steps rolled back, in % of the run's steps (median over the monitored runs that
  rolled back at least once; also over all monitored faulty runs);
* *acting interventions on clean runs*: interventions other than alerts;
* *harm-only classes* (persistent input shifts, ``FaultClass.harm_only``): the world changed for
  good and the held-out set keeps the old distribution, so no response -- short of skipping all
  new data, the skip storm issue 10 forbids -- can match a counterfactual trained on the old
  one.  Their reference is the same run without the monitor: they never count as failing
  without it, and count as *harmed* when the monitor stops them or makes them > 5% worse;
* *reachable*: failing runs that a known response could save.  Every fault that can be undone
  (a transient window, an LR fault capped back to the schedule, a weight fault rolled back) can
  end at the counterfactual; a fault that spoils all data from the onset to the end
  (``input_shift``, ``overfit``, permanent ``data_corruption``) can at best be stopped at the
  onset, so it is reachable only when the clean run's held-out loss at the onset is already
  within 5% of its final one.  A ceiling for ``saved``, not a target.

Targets (issue 10): saved >= 80% of the runs that fail without the monitor; harmed <= 2% of the
rest; 0 acting interventions on clean runs; median steps lost to rollbacks <= 2% of the run.

The no-monitor and counterfactual runs do not depend on the policy, so they are trained once per
invocation; each policy candidate only adds its monitored runs.  ``--cv GRID.json`` runs every
candidate on all jobs and picks one by leave-one-fault-class-out (and leave-one-seed-out)
cross-validation: in each fold the candidate with the best objective
``saved - 5 * harmed - 20 * clean_acting`` (fractions; ties go to the earlier candidate in the
grid) on the other classes is scored on the left-out one.  Clean runs stay in every class fold;
the seed folds hold them out by seed too.

Usage::

    python benchmarks/bench_rescue.py --quick                 # every class, < 10 min on 2 cores
    python benchmarks/bench_rescue.py                         # 3 seeds, longer runs
    python benchmarks/bench_rescue.py --policy my_policy.toml --json rows.json
    python benchmarks/bench_rescue.py --quick --cv benchmarks/rescue_grid.json

Options: ``--models mlp,gpt``, ``--seeds N``, ``--clean-seeds N``, ``--faults a,b``,
``--steps mlp=300,gpt=150``, ``--workers N``, ``--preset small``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAIL_RATIO = 1.05  #: failed when final loss > this x the counterfactual's (or non-finite)


@dataclass(frozen=True)
class FaultClass:
    """One benchmark fault class: a tinytrain fault kind with its duration and magnitude.

    ``duration`` is an int number of steps (``0`` = to the end, ``-1`` = the kind's default) or
    a float in (0, 1): that fraction of the run's steps.
    """

    kind: str
    duration: float = -1
    magnitude: float = math.nan
    about: str = ""
    #: the world changed for good (a persistent input shift): the run must adapt to it, so no
    #: response can match a counterfactual trained on the old distribution.  Judged on harm
    #: only: the reference is the same run without the monitor.
    harm_only: bool = False

    def spec_args(self, steps: int) -> tuple[int, float]:
        d = self.duration
        dur = max(1, round(d * steps)) if isinstance(d, float) and 0 < d < 1 else int(d)
        return dur, self.magnitude


#: every fault class the detectors claim (issue 10), name -> how it is injected
CLASSES: dict[str, FaultClass] = {
    "lr_blowup": FaultClass("lr_blowup", about="LR x100 for 10 iterations (transient)"),
    "lr_too_high": FaultClass("lr_persistent", about="LR x30 from onset to the end (bad config)"),
    "lr_ramp": FaultClass("lr_ramp", 0.15, about="re-warmup ramp to a x20 peak over 15% of run"),
    "schedule_bug_perm": FaultClass("schedule_bug", 0, about="schedule x30 for good"),
    "schedule_bug_window": FaultClass("schedule_bug", 0.1, about="schedule x30, 10% of run"),
    "grad_explosion": FaultClass("grad_explosion", about="grads x1e4 for 3 iterations"),
    "data_corrupt_window": FaultClass("data_corruption", about="8 garbage batches"),
    "data_corrupt_perm": FaultClass("data_corruption", 0, about="garbage batches to the end"),
    "input_shift_up": FaultClass("input_shift", 0, 8.0, harm_only=True,
                                 about="MLP x8 inputs; GPT swapcase (harm only)"),
    "input_shift_down": FaultClass("input_shift", 0, 0.125, harm_only=True,
                                   about="MLP x1/8 inputs; GPT code -> prose (harm only)"),
    "bit_flip": FaultClass("bit_flip", about="exponent MSB of one weight flips"),
    "weight_scale": FaultClass("weight_scale", about="one weight matrix x1e3, once"),
    "activation_spike": FaultClass("activation_spike", about="hidden block output x100, 5 it"),
    "overfit": FaultClass("overfit", about="batches from a 4-batch pool to the end"),
    "fp16_overflow": FaultClass("fp16_overflow", about="inf/NaN grads for 5 iterations"),
    "fp16_underflow": FaultClass("fp16_underflow", 0.25, about="grads x1e-8 for 25% of run"),
}

SIZES = {  # (steps per model, fault seeds, clean seeds per model)
    "full": ({"mlp": 400, "gpt": 300}, 3, 5),
    "quick": ({"mlp": 300, "gpt": 120}, 2, 5),
}


# ---------------------------------------------------------------------------- config helpers
def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge (``over`` wins; nested tables merged key by key)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load_override(path: str) -> dict[str, Any]:
    """A TOML/JSON file: config sections (``[policy]`` ...) or a bare policy table."""
    p = Path(path)
    if p.suffix == ".toml":
        import tomllib

        data = tomllib.loads(p.read_text())
    else:
        data = json.loads(p.read_text())
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a table / object, got {type(data).__name__}")
    return data if "policy" in data else {"policy": data}


def load_grid(path: str, base: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``--cv`` candidates: a JSON list of ``{"name": ..., "policy": {...}}`` or ``{name: policy}``.

    Each entry's sections are merged over ``base`` (the ``--policy`` override, if any).
    """
    raw = json.loads(Path(path).read_text())
    items: list[tuple[str, dict[str, Any]]] = []
    if isinstance(raw, dict):
        items = [(str(k), {"policy": v}) for k, v in raw.items()]
    elif isinstance(raw, list):
        for i, e in enumerate(raw):
            if not isinstance(e, dict):
                raise SystemExit(f"{path}[{i}]: expected an object")
            name = str(e.get("name", f"c{i}"))
            body = {k: v for k, v in e.items() if k != "name"}
            items.append((name, body if body else {"policy": {}}))
    else:
        raise SystemExit(f"{path}: expected a list or an object")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: duplicate candidate names {names}")
    return {n: merge(base, body) for n, body in items}


def make_monitor(preset: str, override: Mapping[str, Any]) -> Any:
    """The monitor a user would attach: the preset, with ``override`` sections merged in."""
    from stability.monitor.monitor import Monitor

    if not override:
        return Monitor(preset)
    return Monitor({"preset": preset, **override})


# ---------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class Job:
    """One training run: ``cls`` ``None`` = clean, ``candidate`` ``None`` = no monitor."""

    model: str
    steps: int
    seed: int
    cls: str | None
    candidate: str | None
    override: str = "{}"  # JSON of the config override (a string keeps the job hashable)
    preset: str = "small"
    checkpoint_every: int = 25  # the guard's checkpoint cadence (monitored runs)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a GradScaler)
    device: str = "cpu"
    sync: str = "auto"  # the guard's sync mode (auto | step | deferred)

    @property
    def cost(self) -> float:  # rough seconds, for scheduling the longest first
        return self.steps * (20.0 if self.model == "gpt" else 3.0) * (
            1.5 if self.candidate is not None else 1.0)


def onset(model: str, seed: int, cls: str, steps: int) -> int:
    """Fault onset, drawn per (model, seed, class) in [40%, 60%] of the run, deterministically."""
    rng = random.Random(f"{model}/{seed}/{cls}")
    return rng.randint(int(0.4 * steps), int(0.6 * steps))


def run_job(job: Job) -> dict[str, Any]:
    """Train one run (in a worker process) and return its row."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("stability").setLevel(logging.CRITICAL + 1)  # counted, not logged
    from stability.testing.tinytrain import FAULT_CLOCK, FaultSpec, train_run

    row: dict[str, Any] = {"model": job.model, "seed": job.seed, "class": job.cls or "clean",
                           "candidate": job.candidate, "steps": job.steps}
    fault = None
    if job.cls is not None:
        fc = CLASSES[job.cls]
        dur, mag = fc.spec_args(job.steps)
        fault = FaultSpec(fc.kind, onset(job.model, job.seed, job.cls, job.steps), dur, mag)
        row["fault"] = {**fault.to_dict(), "clock": FAULT_CLOCK[fault.kind]}
    t0 = time.perf_counter()
    try:
        mon = None
        if job.candidate is not None:
            mon = make_monitor(job.preset, json.loads(job.override))
        r = train_run(job.model, job.steps, seed=job.seed, fault=fault, monitor=mon,
                      checkpoint_every=job.checkpoint_every, precision=job.precision,
                      device=job.device,
                      guard_kwargs={"sync": job.sync})
    except Exception as exc:  # a crashing monitor is a result, not the end of the benchmark
        row.update(error=f"{type(exc).__name__}: {exc}", final=math.nan, stopped=None,
                   rollbacks=0, steps_lost=0, steps_skipped=0, batches_skipped=0, acting=0,
                   acting_types={}, iterations=0, wall_s=time.perf_counter() - t0)
        return row
    acts = r.acting_interventions()
    row.update(
        final=r.final_loss, stopped=r.stopped, rollbacks=r.rollbacks, steps_lost=r.steps_lost,
        steps_skipped=r.steps_skipped, batches_skipped=r.batches_skipped, acting=len(acts),
        acting_types=dict(Counter(str(getattr(i, "type", "?")) for i in acts)),
        iterations=r.iterations, wall_s=time.perf_counter() - t0, error=None)
    if job.cls is None and job.candidate is None:  # a counterfactual: its held-out curve
        row["val"] = {str(k): v for k, v in sorted(r.val_losses.items())}
    return row


def run_all(jobs: Sequence[Job], workers: int) -> list[dict[str, Any]]:
    """Every job through a process pool (longest first), with a progress line on stderr."""
    order = sorted(jobs, key=lambda j: -j.cost)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    step = max(1, len(order) // 20)
    if workers <= 1:
        for j in order:
            rows.append(run_job(j))
            if len(rows) % step == 0:
                print(f"  {len(rows)}/{len(order)} runs, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
        return rows
    with ProcessPoolExecutor(workers) as ex:
        futs = [ex.submit(run_job, j) for j in order]
        for f in as_completed(futs):
            rows.append(f.result())
            if len(rows) % step == 0:
                print(f"  {len(rows)}/{len(order)} runs, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------- scoring
@dataclass
class Outcome:
    """One faulty or clean run scored against its counterfactual (for one candidate)."""

    model: str
    seed: int
    cls: str  # "clean" for clean runs
    failed_without: bool
    reachable: bool
    failed_with: bool
    stopped: bool
    lost_pct: float
    rolled_back: bool
    acting: int
    acting_types: dict[str, int]
    ratio_without: float
    ratio_with: float
    error: str | None
    onset: int | None = None
    stop_reason: str | None = None
    rollbacks: int = 0

    @property
    def saved(self) -> bool:
        return self.failed_without and not self.failed_with

    @property
    def worse(self) -> bool:
        return self.failed_without and not self.saved and (
            self.stopped or self.error is not None
            or self.ratio_with > FAIL_RATIO * self.ratio_without)

    @property
    def harmed(self) -> bool:
        return not self.failed_without and (self.failed_with or self.stopped)


def _ratio(final: float, cf: float) -> float:
    return final / cf if math.isfinite(final) and math.isfinite(cf) and cf > 0 else math.inf


def score(rows: Iterable[dict[str, Any]]) -> dict[str, list[Outcome]]:
    """Outcomes per candidate, from the per-run rows."""
    rows = list(rows)
    cf = {(r["model"], r["seed"]): r["final"] for r in rows
          if r["class"] == "clean" and r["candidate"] is None}
    none = {(r["model"], r["seed"], r["class"]): r for r in rows if r["candidate"] is None}
    cf_val = {(r["model"], r["seed"]): r.get("val", {}) for r in rows
              if r["class"] == "clean" and r["candidate"] is None}
    out: dict[str, list[Outcome]] = defaultdict(list)
    for r in rows:
        if r["candidate"] is None:
            continue
        key = (r["model"], r["seed"])
        base = none[(r["model"], r["seed"], r["class"])]
        rw, rm = _ratio(base["final"], cf[key]), _ratio(r["final"], cf[key])
        if r["class"] in CLASSES and CLASSES[r["class"]].harm_only:
            # the adapting run without the monitor is the reference: it cannot fail against
            # itself, and the monitor harms it when it ends > 5% worse or stops it
            rw, rm = 1.0, _ratio(r["final"], base["final"])
        reachable = True
        f = r.get("fault")
        if f and f["duration"] == 0 and f.get("clock") == "data":
            curve = {int(k): v for k, v in cf_val.get(key, {}).items() if int(k) <= f["step"]}
            at_onset = curve[max(curve)] if curve else math.inf
            reachable = _ratio(at_onset, cf[key]) <= FAIL_RATIO
        out[r["candidate"]].append(Outcome(
            model=r["model"], seed=r["seed"], cls=r["class"],
            failed_without=rw > FAIL_RATIO, reachable=reachable,
            failed_with=rm > FAIL_RATIO or r["error"] is not None,
            stopped=r["stopped"] is not None, lost_pct=100.0 * r["steps_lost"] / r["steps"],
            rolled_back=r["rollbacks"] > 0, acting=r["acting"], acting_types=r["acting_types"],
            ratio_without=rw, ratio_with=rm, error=r["error"],
            onset=r.get("fault", {}).get("step"), stop_reason=r["stopped"],
            rollbacks=r["rollbacks"]))
    return out


@dataclass
class Tally:
    runs: int = 0
    failed: int = 0
    reachable: int = 0
    saved: int = 0
    stopped: int = 0
    harmed: int = 0
    worse: int = 0
    not_failed: int = 0
    acting_runs: int = 0
    acting: int = 0
    errors: int = 0

    def add(self, o: Outcome) -> None:
        self.runs += 1
        self.failed += o.failed_without
        self.reachable += o.failed_without and o.reachable
        self.saved += o.saved
        self.stopped += o.stopped
        self.harmed += o.harmed
        self.worse += o.worse
        self.not_failed += not o.failed_without
        self.acting_runs += o.acting > 0
        self.acting += o.acting
        self.errors += o.error is not None


def tally(outs: Iterable[Outcome]) -> Tally:
    t = Tally()
    for o in outs:
        t.add(o)
    return t


def _frac(a: int, b: int) -> float:
    return a / b if b else math.nan


def objective(outs: Sequence[Outcome]) -> float:
    """``saved - 5 * harmed - 20 * clean_acting`` (fractions; empty parts count 0)."""
    faulty = tally(o for o in outs if o.cls != "clean")
    clean = tally(o for o in outs if o.cls == "clean")
    allt = tally(outs)
    saved = _frac(faulty.saved, faulty.failed)
    harmed = _frac(allt.harmed, allt.not_failed)
    acting = _frac(clean.acting_runs, clean.runs)
    return sum(0.0 if math.isnan(v) else w * v
               for w, v in ((1.0, saved), (-5.0, harmed), (-20.0, acting)))


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.0f}%" if b else "-"


def print_table(outs: Sequence[Outcome], classes: Sequence[str], title: str) -> dict[str, Any]:
    """Per-class table and totals against the targets; returns the summary figures."""
    by: dict[str, list[Outcome]] = defaultdict(list)
    for o in outs:
        by[o.cls].append(o)
    print(f"\n{title}")
    hdr = (f"{'class':20} {'runs':>4} {'failed':>6} {'reach':>5} {'saved':>7} {'stopped':>7} "
           f"{'harmed':>6} {'worse':>5} {'rb':>3} {'lost%':>6} {'ratio w/o':>9} {'ratio w/':>8}  "
           "acting interventions")
    print(hdr)
    print("-" * len(hdr))

    def line(name: str, g: Sequence[Outcome]) -> None:
        t = tally(g)
        rb = [o.lost_pct for o in g if o.rolled_back]
        types: Counter[str] = Counter()
        for o in g:
            types.update(o.acting_types)
        med_w = _median([o.ratio_without for o in g])
        med_m = _median([o.ratio_with for o in g])
        err = f" ERRORS {t.errors}" if t.errors else ""
        lost = f"{_median(rb):.1f}" if rb else "-"
        print(f"{name:20} {t.runs:>4} {t.failed:>6} {t.reachable:>5} {t.saved:>3}/{t.failed:<3} "
              f"{t.stopped:>7} {t.harmed:>6} {t.worse:>5} {len(rb):>3} {lost:>6} {med_w:>9.3f} "
              f"{med_m:>8.3f}  "
              f"{','.join(f'{k}:{v}' for k, v in sorted(types.items()))}{err}")

    for c in classes:
        if by.get(c):
            line(c, by[c])
    print("-" * len(hdr))
    if by.get("clean"):
        line("clean", by["clean"])
    models = sorted({o.model for o in outs})
    if len(models) > 1:
        for m in models:
            line(f"all {m}", [o for o in outs if o.model == m and o.cls != "clean"])
    faulty = [o for o in outs if o.cls != "clean"]
    clean = by.get("clean", [])
    tf, tc, ta = tally(faulty), tally(clean), tally(outs)
    rb = [o.lost_pct for o in outs if o.rolled_back]
    all_lost = [o.lost_pct for o in faulty]
    summary: dict[str, Any] = {
        "failed_without": tf.failed, "reachable": tf.reachable, "saved": tf.saved,
        "saved_frac": _frac(tf.saved, tf.failed),
        "stopped": ta.stopped, "stopped_failing": sum(o.stopped for o in faulty
                                                      if o.failed_without),
        "harmed": ta.harmed, "not_failed": ta.not_failed, "worse": tf.worse,
        "harmed_frac": _frac(ta.harmed, ta.not_failed),
        "clean_runs": tc.runs, "clean_acting": tc.acting, "clean_acting_runs": tc.acting_runs,
        "rollback_runs": len(rb), "median_lost_pct_rollback_runs": _median(rb),
        "median_lost_pct_all_faulty": _median(all_lost), "errors": ta.errors,
        "objective": objective(outs),
    }
    ok = {
        "saved >= 80%": tf.failed > 0 and tf.saved >= 0.8 * tf.failed,
        "harmed <= 2%": ta.harmed <= 0.02 * ta.not_failed,
        "0 acting on clean": tc.runs > 0 and tc.acting == 0,
        "median lost <= 2%": not rb or _median(rb) <= 2.0,
    }
    print(f"saved   {tf.saved}/{tf.failed} of the runs that fail without the monitor "
          f"({_pct(tf.saved, tf.failed)}; target >= 80%; reachable {tf.reachable})  "
          f"[stopped {summary['stopped_failing']} of them]  "
          f"{'PASS' if ok['saved >= 80%'] else 'FAIL'}")
    print(f"harmed  {ta.harmed}/{ta.not_failed} of the runs that do not fail without it, clean "
          f"included ({_pct(ta.harmed, ta.not_failed)}; target <= 2%)  "
          f"{'PASS' if ok['harmed <= 2%'] else 'FAIL'}")
    print(f"clean   {tc.runs} runs, {tc.acting} acting interventions in {tc.acting_runs} runs "
          f"(target 0)  {'PASS' if ok['0 acting on clean'] else 'FAIL'}")
    med_rb = f"{_median(rb):.1f}%" if rb else "-"
    print(f"lost    median {med_rb} of the run over the {len(rb)} runs that rolled "
          f"back (target <= 2%; over all faulty runs {_median(all_lost):.1f}%)  "
          f"{'PASS' if ok['median lost <= 2%'] else 'FAIL'}")
    print(f"worse   {tf.worse}/{tf.failed} failing runs stopped or made > 5% worse by the monitor "
          f"(no target)")
    if ta.errors:
        print(f"ERRORS  {ta.errors} monitored runs raised (counted as failed with the monitor)")
    summary["targets"] = ok
    return summary


def print_runs(outs: Sequence[Outcome]) -> None:
    """One line per monitored run (``--runs``)."""
    print(f"{'model':5} {'seed':>4} {'class':20} {'onset':>5} {'w/o':>8} {'w/':>8} {'verdict':8} "
          f"{'rb':>2} {'lost%':>5}  acting / stop reason")
    for o in sorted(outs, key=lambda o: (o.cls, o.model, o.seed)):
        verdict = ("saved" if o.saved else "HARMED" if o.harmed else "WORSE" if o.worse
                   else "lost" if o.failed_without else "ok")
        what = ",".join(f"{k}:{v}" for k, v in sorted(o.acting_types.items()))
        if o.stop_reason:
            what += f" | stopped: {o.stop_reason}"
        if o.error:
            what += f" | ERROR {o.error}"
        print(f"{o.model:5} {o.seed:>4} {o.cls:20} {o.onset if o.onset is not None else '-':>5} "
              f"{o.ratio_without:>8.3f} {o.ratio_with:>8.3f} {verdict:8} {o.rollbacks:>2} "
              f"{o.lost_pct:>5.1f}  {what}")


def cross_validate(by_cand: Mapping[str, Sequence[Outcome]], classes: Sequence[str]) -> None:
    """Leave-one-fault-class-out and leave-one-seed-out selection of the candidate."""
    names = list(by_cand)
    print("\ncandidates (in-sample, all classes; objective = saved - 5*harmed - 20*clean-acting)")
    print(f"{'candidate':24} {'objective':>9} {'saved':>9} {'harmed':>8} {'clean acting':>12}")
    for n in names:
        outs = by_cand[n]
        f = tally(o for o in outs if o.cls != "clean")
        a = tally(outs)
        c = tally(o for o in outs if o.cls == "clean")
        print(f"{n:24} {objective(outs):>9.3f} {f.saved:>4}/{f.failed:<4} "
              f"{a.harmed:>3}/{a.not_failed:<4} {c.acting:>12}")

    def folds(key: Callable[[Outcome], Any], groups: Sequence[Any], label: str,
              clean_held: bool) -> None:
        wins: Counter[str] = Counter()
        held = Tally()
        print(f"\nleave-one-{label}-out: the best candidate on the rest, scored on the held-out "
              f"{label}")
        print(f"{label:20} {'winner':24} {'saved':>9} {'stopped':>7} {'harmed':>8} "
              f"{'clean act':>9}")
        for g in groups:
            def train(o: Outcome, g: Any = g) -> bool:
                return key(o) != g or (o.cls == "clean" and not clean_held)
            best = max(names, key=lambda n: (objective([o for o in by_cand[n] if train(o)]),
                                             -names.index(n)))
            wins[best] += 1
            test = [o for o in by_cand[best] if key(o) == g
                    and (clean_held or o.cls != "clean")]
            t = tally(test)
            tc = tally(o for o in test if o.cls == "clean")
            held.runs += t.runs
            held.failed += t.failed
            held.saved += t.saved
            held.stopped += t.stopped
            held.harmed += t.harmed
            held.not_failed += t.not_failed
            held.acting += tc.acting
            print(f"{g!s:20} {best:24} {t.saved:>4}/{t.failed:<4} {t.stopped:>7} "
                  f"{t.harmed:>3}/{t.not_failed:<4} {tc.acting if tc.runs else '-':>9}")
        print(f"{'held-out total':20} {'':24} {held.saved:>4}/{held.failed:<4} "
              f"{held.stopped:>7} {held.harmed:>3}/{held.not_failed:<4} "
              f"{held.acting if clean_held else '-':>9}")
        print("wins: " + ", ".join(f"{n} {wins[n]}" for n in names))

    first = by_cand[names[0]]
    present = [c for c in classes if any(o.cls == c for o in first)]
    folds(lambda o: o.cls, present, "class", clean_held=False)
    seeds = sorted({o.seed for o in first})
    folds(lambda o: o.seed, seeds, "seed", clean_held=True)


# ---------------------------------------------------------------------------- main
def report(rows: Sequence[dict[str, Any]], cands: Mapping[str, Any], classes: Sequence[str],
           show_runs: bool) -> dict[str, Any]:
    """Tables per candidate (and cross-validation when there are several); the summaries."""
    by_cand = score(rows)
    summaries = {}
    for name in cands:
        shown = json.dumps(cands[name], sort_keys=True) if cands[name] else "(preset policy)"
        if show_runs:
            print(f"\nruns of candidate {name} (ratios: final loss / counterfactual's)")
            print_runs(by_cand[name])
        summaries[name] = print_table(by_cand[name], classes,
                                      f"candidate {name}: override {shown}")
    if len(cands) > 1:
        cross_validate(by_cand, classes)
    return summaries


def _parse_steps(text: str | None, default: Mapping[str, int]) -> dict[str, int]:
    out = dict(default)
    for part in (text or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[k.strip()] = int(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, 2 fault seeds")
    ap.add_argument("--models", default="mlp,gpt", help="comma list of mlp,gpt")
    ap.add_argument("--seeds", type=int, default=None, help="fault seeds per model and class")
    ap.add_argument("--clean-seeds", type=int, default=None, help="clean runs per model")
    ap.add_argument("--faults", default=None, help=f"comma list of {','.join(CLASSES)}")
    ap.add_argument("--steps", default=None, help="steps per model, e.g. mlp=300,gpt=120")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="autocast precision of every run (fp16 with a GradScaler)")
    ap.add_argument("--device", default="cpu", help="torch device of every run, e.g. cuda")
    ap.add_argument("--sync", default="auto", choices=("auto", "step", "deferred"),
                    help="the guard's sync mode in monitored runs (auto, the guard's default: "
                         "deferred on CUDA with a fused optimizer, else step -- tinytrain's "
                         "optimizers are not fused, so step)")
    ap.add_argument("--checkpoint-every", type=int, default=25,
                    help="the guard's checkpoint cadence in steps (steps lost to a rollback "
                         "scale with it)")
    ap.add_argument("--policy", default=None, help="TOML/JSON override merged into the preset")
    ap.add_argument("--cv", default=None, help="JSON list of named policy overrides")
    ap.add_argument("--json", default=None, help="write every per-run row here")
    ap.add_argument("--runs", action="store_true", help="also print one line per monitored run")
    ap.add_argument("--rescore", default=None, metavar="ROWS.json",
                    help="print the tables of a --json file again, without training")
    a = ap.parse_args(argv)
    if a.rescore:
        saved = json.loads(Path(a.rescore).read_text())
        report(saved["rows"], saved["candidates"], list(saved["classes"]), a.runs)
        return 0
    t_start = time.perf_counter()
    size_steps, size_seeds, size_clean = SIZES["quick" if a.quick else "full"]
    steps = _parse_steps(a.steps, size_steps)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in steps:
            raise SystemExit(f"unknown model {m!r} (mlp, gpt)")
    classes = list(CLASSES) if not a.faults else [c.strip() for c in a.faults.split(",")]
    bad = [c for c in classes if c not in CLASSES]
    if bad:
        raise SystemExit(f"unknown fault classes {bad}; known: {', '.join(CLASSES)}")
    n_seeds = a.seeds or size_seeds
    n_clean = size_clean if a.clean_seeds is None else a.clean_seeds
    base = load_override(a.policy) if a.policy else {}
    cands = load_grid(a.cv, base) if a.cv else {"default" if not base else
                                                Path(a.policy).stem: base}
    for name, ov in cands.items():  # fail fast on a bad override, before any training
        try:
            make_monitor(a.preset, ov)
        except Exception as exc:
            raise SystemExit(f"candidate {name!r}: {type(exc).__name__}: {exc}") from None

    jobs: list[Job] = []
    for m in models:
        n = steps[m]
        cf_seeds = sorted(set(range(n_clean)) | set(range(n_seeds)))
        for s in cf_seeds:
            jobs.append(Job(m, n, s, None, None, preset=a.preset,  # counterfactual (cached)
                            precision=a.precision, device=a.device))
        for s in range(n_seeds):
            for c in classes:
                jobs.append(Job(m, n, s, c, None, preset=a.preset,  # no monitor (cached)
                                precision=a.precision, device=a.device))
        for name, ov in cands.items():
            js = json.dumps(ov, sort_keys=True)
            for s in range(n_clean):
                jobs.append(Job(m, n, s, None, name, js, a.preset, a.checkpoint_every,
                                a.precision, a.device, a.sync))
            for s in range(n_seeds):
                for c in classes:
                    jobs.append(Job(m, n, s, c, name, js, a.preset, a.checkpoint_every,
                                    a.precision, a.device, a.sync))
    print(f"bench_rescue: {len(jobs)} runs ({len(classes)} classes x {len(models)} models x "
          f"{n_seeds} seeds, {n_clean} clean seeds per model, {len(cands)} candidate(s)); "
          f"steps {', '.join(f'{m}={steps[m]}' for m in models)}; preset={a.preset}; "
          f"checkpoint every {a.checkpoint_every} steps; {a.precision} on {a.device}; "
          f"sync={a.sync}; "
          f"workers={a.workers}", flush=True)
    for c in classes:
        fc = CLASSES[c]
        print(f"  {c:20} {fc.kind:17} {fc.about}")
    sys.stdout.flush()
    rows = run_all(jobs, a.workers)
    t_runs = time.perf_counter() - t_start
    summaries = report(rows, cands, classes, a.runs)
    wall = time.perf_counter() - t_start
    print(f"\nruns took {t_runs:.0f} s wall ({sum(r['wall_s'] for r in rows):.0f} s of runs on "
          f"{a.workers} workers); total {wall:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "args": vars(a), "steps": steps, "classes": {c: vars(CLASSES[c]) for c in classes},
            "candidates": cands, "summary": summaries, "wall_s": wall, "rows": rows,
        }, indent=1, default=str))
        print(f"rows written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
