"""Generate the sample runs shipped in ``data/``: tiny models really trained on CPU, real faults.

Every run is trained by :func:`stability.testing.tinytrain.train_run` (a 2-layer character GPT on
Python standard-library source read from local files, or a small MLP on synthetic data -- nothing
is downloaded) and recorded with the project's own :class:`replay.recorder.RunRecorder` into
``<out>/runs/<name>/part-*.parquet``. All runs of one model share the seed, so the clean run is
the exact counterfactual of every faulty one: before the onset they are identical step for step.
Labels (``<out>/labels.parquet`` and ``<out>/labels.json``) are derived from the recorded losses
against that counterfactual (see :func:`derive_label`).

Usage::

    python data/make_samples.py                        # all runs into data/ (a few minutes)
    python data/make_samples.py --out /tmp/s --steps 60 --only clean,lr_blowup

Deterministic: fixed seeds, one intra-op thread per run (``--jobs`` runs in parallel processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GENERATOR_VERSION = "1"

#: thresholds of the label definitions (see :func:`derive_label`)
RUNAWAY_FACTOR = 3.0  # loss above this many times the pre-onset median ...
RUNAWAY_STEPS = 20  # ... for this many consecutive steps = divergence
EFFECT_RATIO = 0.2  # |smoothed loss / counterfactual - 1| above this = visible effect
VAL_EFFECT_RATIO = 0.05  # val_loss / counterfactual - 1 above this = visible effect
PRE_WINDOW = 50  # steps before the onset used for the pre-onset median
POST_NAN_STEPS = 50  # an unguarded run stops this many steps after its first NaN loss


@dataclass(frozen=True)
class Sample:
    """One sample run: a model, an optional fault (tinytrain kind) and its onset."""

    name: str
    model: str
    scenario: str  # label taxonomy (as in the public benchmark); "clean" without a fault
    fault: str | None = None  # stability.testing.tinytrain.FAULT_KINDS
    onset_frac: float = 0.5  # onset = int(onset_frac * steps)
    duration: int = -1  # -1 = tinytrain's default, 0 = to the end
    magnitude: float = math.nan  # nan = tinytrain's default
    about: str = ""


SAMPLES: tuple[Sample, ...] = (
    Sample("clean", "gpt", "clean",
           about="char GPT, no fault; the counterfactual of every gpt run"),
    Sample("lr_blowup", "gpt", "lr_too_high", "lr_blowup", 0.5, 0, 100.0,
           about="LR multiplied by 100 from the onset on (a bad config push): the loss explodes "
                 "to ~20, then the model is stuck at the unigram level"),
    Sample("corrupt_data", "gpt", "data_corruption", "data_corruption", 0.5, 30,
           about="30 consecutive batches of garbage input with one constant target"),
    Sample("bitflip", "gpt", "silent_data_corruption", "bit_flip", 0.5, 1, 30.0,
           about="exponent MSB (bit 30) of one weight of the first hidden matrix flipped"),
    Sample("overfit", "gpt", "overfit", "overfit", 0.4, 0, 2.0,
           about="from the onset the loader cycles over 2 batches; val loss parts from train"),
    Sample("clean_mlp", "mlp", "clean",
           about="MLP on synthetic teacher data, no fault; counterfactual of grad_explosion"),
    Sample("grad_explosion", "mlp", "grad_explosion", "grad_explosion", 0.5, 5, 1e4,
           about="gradients multiplied by 1e4 for 5 steps (AdamW absorbs most of it)"),
)

#: modules whose outputs get activation statistics, per model
ACTIVATIONS = {"gpt": ["blocks.0", "blocks.1", "ln"], "mlp": ["1", "3"]}


def onset_of(sample: Sample, steps: int) -> int | None:
    """Onset step of ``sample`` in a run of ``steps`` steps (``None`` for a clean run).

    Examples
    --------
    >>> onset_of(SAMPLES[1], 600), onset_of(SAMPLES[0], 600)
    (300, None)
    """
    return None if sample.fault is None else int(sample.onset_frac * steps)


# ---------------------------------------------------------------------------- generation
class _StopAfterNaN:
    """``on_step`` hook: stop an unguarded run ``POST_NAN_STEPS`` steps after its first NaN."""

    def __init__(self) -> None:
        self.first: int | None = None

    def __call__(self, it: int, loss: float) -> None:
        from stability.adapters.interventions import TrainingStopped

        if self.first is None and not math.isfinite(loss):
            self.first = it
        if self.first is not None and it >= self.first + POST_NAN_STEPS:
            raise TrainingStopped(f"non-finite loss since step {self.first}", it)


def generate(sample: Sample, out: Path, steps: int, seed: int, eval_every: int,
             part_steps: int, threads: int) -> dict[str, Any]:
    """Train and record one sample into ``out/runs/<name>``; returns a short summary."""
    import torch

    from replay.recorder import RunRecorder
    from stability.testing.tinytrain import FaultSpec, train_run

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    onset = onset_of(sample, steps)
    fault = None
    if sample.fault is not None and onset is not None:
        fault = FaultSpec(sample.fault, onset, sample.duration, sample.magnitude)
    run_dir = out / "runs" / sample.name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_info = {
        "run_id": sample.name,
        "model": sample.model,
        "scenario": sample.scenario,
        "fault": None if fault is None else fault.to_dict(),
        "onset_step": onset,
        "seed": seed,
        "steps": steps,
        "eval_every": eval_every,
        "about": sample.about,
        "generator": "data/make_samples.py",
        "generator_version": GENERATOR_VERSION,
        "torch": torch.__version__.split("+")[0],
    }
    t0 = time.perf_counter()
    with RunRecorder(run_dir, part_steps=part_steps, metadata={"run": run_info}) as rec:
        res = train_run(sample.model, steps, seed, fault, recorder=rec, eval_every=eval_every,
                        checkpoint_every=0, on_step=_StopAfterNaN(),
                        guard_kwargs={"activations": ACTIVATIONS[sample.model],
                                      "activation_every": 10})
    return {"name": sample.name, "iterations": res.iterations, "final_loss": res.final_loss,
            "stopped": res.stopped, "seconds": round(time.perf_counter() - t0, 1)}


def _generate_star(args: tuple[Any, ...]) -> dict[str, Any]:
    return generate(*args)


# ---------------------------------------------------------------------------- labels
def _smooth(x: np.ndarray, k: int = 5) -> np.ndarray:
    """Trailing mean over ``k`` steps; ``inf`` where the window holds a non-finite value.

    Examples
    --------
    >>> _smooth(np.array([1.0, 3.0, np.nan, 2.0, 4.0]), 2).tolist()
    [1.0, 2.0, inf, inf, 3.0]
    """
    ok = np.isfinite(x)
    c = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    nb = np.concatenate([[0], np.cumsum(~ok)])
    hi = np.arange(1, len(x) + 1)
    lo = np.maximum(0, hi - k)
    out = (c[hi] - c[lo]) / (hi - lo)
    out[(nb[hi] - nb[lo]) > 0] = np.inf
    return out


def _values(table: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A column as float64 (null -> nan) and its "logged" mask (a NaN value counts as logged)."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan), np.zeros(table.num_rows, dtype=bool)
    col = table.column(name)
    x = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    return x, ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def _first(mask: np.ndarray, steps: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(steps[idx[0]]) if len(idx) else None


def _runaway(loss: np.ndarray, ref: float) -> np.ndarray:
    """Non-finite, or above ``RUNAWAY_FACTOR * ref``."""
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(loss) | (loss > RUNAWAY_FACTOR * ref)


def derive_label(run_id: str, sample: Sample, table: Any, steps: int,
                 counterfactual: Any | None) -> dict[str, Any]:
    """One label row from a recorded run (and its clean counterfactual, when available).

    * ``nan_step``: first step at or after the onset with a non-finite loss;
    * ``divergence_step``: first step at or after the onset that starts ``RUNAWAY_STEPS``
      consecutive steps of non-finite loss or loss above ``RUNAWAY_FACTOR`` x the median of the
      ``PRE_WINDOW`` steps before the onset (or the run ends in such a stretch);
    * ``failure_step``: for a run that had a divergence and never came back, the start of the
      final stretch where the 20-step mean loss stays more than ``EFFECT_RATIO`` above the
      counterfactual's (or non-finite; without a counterfactual: the final runaway stretch);
    * ``effect_step``: first step at or after the onset where the 5-step mean loss differs by more
      than ``EFFECT_RATIO`` from the counterfactual's, or ``val_loss`` exceeds it by more than
      ``VAL_EFFECT_RATIO`` (without a counterfactual: the divergence step);
    * ``outcome``: ``diverged`` with a failure step (it diverged and ended broken); else
      ``degraded`` if the last ``val_loss`` (or the final 20-step mean loss) is more than
      ``VAL_EFFECT_RATIO`` (resp. ``EFFECT_RATIO``) above the counterfactual's; else
      ``recovered``; ``clean`` for clean runs.
    """
    onset = onset_of(sample, steps)
    row: dict[str, Any] = {
        "run_id": run_id, "scenario": sample.scenario, "onset_step": onset, "end_step": None,
        "outcome": "clean", "divergence_step": None, "failure_step": None, "nan_step": None,
        "effect_step": None, "model": sample.model, "variant": sample.fault or "none",
        "n_steps": table.num_rows, "planned_steps": steps,
        "pre_onset_median_loss": None, "peak_loss_ratio": None, "final_loss_ratio": None,
        "final_val_ratio": None,
    }
    if onset is None:
        return row
    if sample.duration > 0:
        row["end_step"] = onset + sample.duration - 1
    st = np.asarray(table.column("step").to_numpy(), dtype=np.int64)
    loss = np.asarray(table.column("loss").to_numpy(zero_copy_only=False), dtype=np.float64)
    val, vlog = _values(table, "val_loss")
    pre = loss[(st >= onset - PRE_WINDOW) & (st < onset)]
    ref = float(np.median(pre)) if len(pre) else float(np.nanmedian(loss))
    after = st >= onset
    row["pre_onset_median_loss"] = ref
    row["nan_step"] = _first(after & ~np.isfinite(loss), st)
    bad = _runaway(loss, ref) & after
    # a stretch of RUNAWAY_STEPS bad steps (or one that reaches the end of the run)
    run_len = np.zeros(len(bad), dtype=np.int64)
    for i in range(len(bad) - 1, -1, -1):
        run_len[i] = (run_len[i + 1] + 1 if i + 1 < len(bad) else 1) if bad[i] else 0
    starts = bad & ((run_len >= RUNAWAY_STEPS) | (run_len == len(bad) - np.arange(len(bad))))
    row["divergence_step"] = _first(starts, st)
    failing = bad  # without a counterfactual: runaway against the pre-onset median
    fin = loss[after & np.isfinite(loss)]
    row["peak_loss_ratio"] = float(np.max(fin) / ref) if len(fin) else None
    effect = None
    if counterfactual is not None:
        cst = np.asarray(counterfactual.column("step").to_numpy(), dtype=np.int64)
        closs = np.asarray(counterfactual.column("loss").to_numpy(zero_copy_only=False),
                           dtype=np.float64)
        cval, cvlog = _values(counterfactual, "val_loss")
        n = min(len(st), len(cst))
        same = n > 0 and bool(np.array_equal(st[:n], cst[:n]))
        if same:
            s, cs = _smooth(loss[:n]), _smooth(closs[:n])
            with np.errstate(invalid="ignore", divide="ignore"):
                dev = ~np.isfinite(s) | (np.abs(s / cs - 1.0) > EFFECT_RATIO)
                vdev = vlog[:n] & ~(val[:n] <= cval[:n] * (1 + VAL_EFFECT_RATIO))
            cands = [c for c in (_first(dev & after[:n], st[:n]),
                                 _first(vdev & after[:n], st[:n])) if c is not None]
            effect = min(cands) if cands else None
            with np.errstate(invalid="ignore", divide="ignore"):
                worse = ~(_smooth(loss[:n], RUNAWAY_STEPS) / _smooth(closs[:n], RUNAWAY_STEPS)
                          <= 1.0 + EFFECT_RATIO)
            failing = worse & after[:n]
            tail, ctail = loss[max(0, n - RUNAWAY_STEPS):n], closs[max(0, n - RUNAWAY_STEPS):n]
            if np.all(np.isfinite(tail)):
                row["final_loss_ratio"] = float(np.mean(tail) / np.mean(ctail))
            vi = np.flatnonzero(vlog[:n] & cvlog[:n])
            if len(vi) and np.isfinite(val[vi[-1]]):
                row["final_val_ratio"] = float(val[vi[-1]] / cval[vi[-1]])
    if effect is None:
        effect = row["divergence_step"]
    row["effect_step"] = effect
    if row["divergence_step"] is not None and len(failing) and failing[-1]:
        i = len(failing) - 1
        while i > 0 and failing[i - 1]:
            i -= 1
        row["failure_step"] = int(st[i])
        row["outcome"] = "diverged"
    else:
        fv, fl = row["final_val_ratio"], row["final_loss_ratio"]
        worse = ((fv is not None and not fv <= 1 + VAL_EFFECT_RATIO)
                 or (fl is not None and not fl <= 1 + EFFECT_RATIO))
        row["outcome"] = "degraded" if worse else "recovered"
    return row


def write_labels(out: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """``labels.parquet`` (nullable int64 step columns) and ``labels.json``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ints = ("onset_step", "end_step", "divergence_step", "failure_step", "nan_step",
            "effect_step", "n_steps", "planned_steps")
    floats = ("pre_onset_median_loss", "peak_loss_ratio", "final_loss_ratio", "final_val_ratio")
    cols = list(rows[0])
    fields = [pa.field(c, pa.int64() if c in ints else pa.float64() if c in floats
                       else pa.string()) for c in cols]
    table = pa.Table.from_pylist([dict(r) for r in rows], schema=pa.schema(fields))
    pq.write_table(table, out / "labels.parquet", compression="zstd")
    with open(out / "labels.json", "w", encoding="utf-8") as fh:
        json.dump([dict(r) for r in rows], fh, indent=1)
        fh.write("\n")


def make_labels(out: Path, samples: Sequence[Sample], steps: int) -> list[dict[str, Any]]:
    """Read the recorded runs back with the project's reader and derive their labels."""
    from replay.reader import read_run

    tables = {s.name: read_run(out / "runs" / s.name) for s in samples}
    clean = {s.model: s.name for s in samples if s.fault is None}
    rows = []
    for s in samples:
        cf = tables.get(clean.get(s.model, ""))
        rows.append(derive_label(s.name, s, tables[s.name], steps, cf if s.fault else None))
    return rows


# ---------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent),
                   help="output folder: runs/<name>/ and labels.* (default: this script's folder)")
    p.add_argument("--steps", type=int, default=600, help="steps per run (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (default %(default)s)")
    p.add_argument("--only", default=None,
                   help="comma-separated sample names (default: all: "
                        + ",".join(s.name for s in SAMPLES) + ")")
    p.add_argument("--eval-every", type=int, default=20,
                   help="validation period in steps (default %(default)s)")
    p.add_argument("--part-steps", type=int, default=250,
                   help="rows per recorded part file (default %(default)s)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="runs trained in parallel, one thread each (default %(default)s)")
    p.add_argument("--labels-only", action="store_true",
                   help="only re-derive the labels from the runs already in --out")
    a = p.parse_args(argv)
    if a.steps < 10:
        p.error("--steps must be at least 10")
    samples = list(SAMPLES)
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {s.name for s in SAMPLES})
        if unknown:
            p.error(f"unknown sample(s) {unknown}; known: {[s.name for s in SAMPLES]}")
        samples = [s for s in SAMPLES if s.name in names]
    out = Path(a.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(s, out, a.steps, a.seed, a.eval_every, a.part_steps, 1) for s in samples]
    if a.labels_only:
        jobs = []
    if a.jobs > 1 and len(jobs) > 1:
        # the slow gpt runs first, so the pool stays busy
        order = sorted(range(len(jobs)), key=lambda i: samples[i].model != "gpt")
        with ProcessPoolExecutor(a.jobs) as ex:
            done = list(ex.map(_generate_star, [jobs[i] for i in order]))
    else:
        done = [_generate_star(j) for j in jobs]
    for d in done:
        print(f"  {d['name']:<16} {d['iterations']:>5} steps  final val loss "
              f"{d['final_loss']:.4g}  {d['seconds']:>6.1f} s"
              + (f"  (stopped: {d['stopped']})" if d["stopped"] else ""), flush=True)
    rows = make_labels(out, samples, a.steps)
    write_labels(out, rows)
    for r in rows:
        print(f"  {r['run_id']:<16} {r['scenario']:<24} onset {r['onset_step']!s:>5}  "
              f"outcome {r['outcome']:<9} effect {r['effect_step']!s:>5}  "
              f"divergence {r['divergence_step']!s:>5}  nan {r['nan_step']!s:>5}")
    print(f"wrote {len(rows)} runs and labels to {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
