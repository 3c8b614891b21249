"""Generate the labelled detection benchmark of issue 14: tiny models really trained, real faults.

Every run is trained by :func:`stability.testing.tinytrain.train_run` on one CPU thread and
recorded by :class:`replay.recorder.RunRecorder` into one Parquet file per run
(``<out>/runs/<run_id>.parquet``, the recorded-run schema: ``stability replay`` and
:func:`replay.io.load_run` read it). The set is a grid of *configurations*: architecture
(``mlp``, ``gpt_pre`` = pre-LN TinyGPT, ``gpt_post`` = post-LN, ``conv`` = causal conv LM; see
:mod:`stability.testing.models`) x optimizer (AdamW, SGD + Nesterov momentum, RMSprop, Adagrad)
x LR schedule (warm-up + cosine, constant, step decay, linear) x precision (fp32, bf16 CPU
autocast, fp16 CPU autocast + ``GradScaler("cpu")``), each with its own seed. Per configuration
one clean run and ``--faults-per-config`` faulted runs (default 3: 25% clean), cycling through
every fault kind of :data:`~stability.testing.tinytrain.FAULT_KINDS` at three strengths (mild,
moderate, severe), transient or persistent (:data:`FAULT_GRID`).

Labels come from a clean counterfactual forked at the onset: training is deterministic per
configuration, so the configuration's clean run *is* the faulted run continued from the onset
state without the fault (the generator checks that both are bit-identical before the onset and
records it as ``prefix_identical``). See :func:`derive_label` for the definitions; the columns
follow ``/work/shared/runs/README.md`` and load with :func:`replay.labels.load_labels`.

Usage::

    python benchmarks/make_benchmark.py --out benchmarks/data/bench14 --jobs 2   # full set
    python benchmarks/make_benchmark.py --quick --out /tmp/b                     # 40 runs
    python benchmarks/make_benchmark.py --clean-long 24 --steps 1200 \\
        --out benchmarks/data/bench14_clean_long --jobs 2          # long clean runs (FA check)

Output: ``runs/*.parquet``, ``labels.parquet``, ``labels.json``, ``manifest.json`` (sha256 of
every file, the generator arguments, library versions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

GENERATOR_VERSION = "1"

ARCHS = ("mlp", "gpt_pre", "gpt_post", "conv")
OPTIMIZERS = ("adamw", "sgd", "rmsprop", "adagrad")
SCHEDULES = ("warmup_cosine", "constant", "step", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")
PRECISION_WEIGHTS = (0.6, 0.25, 0.15)  # fp16 on CPU is emulated and slow: fewer of them
STRENGTHS = ("mild", "moderate", "severe")

#: fault kind -> (magnitudes per strength, transient durations per strength, modes);
#: modes: which of "transient" / "persistent" (duration 0 = to the end) the kind takes
FAULT_GRID: dict[str, tuple[tuple[float, float, float], tuple[int, int, int], tuple[str, ...]]] = {
    "lr_blowup": ((3.0, 10.0, 100.0), (10, 10, 10), ("transient", "persistent")),
    "lr_persistent": ((2.0, 5.0, 30.0), (0, 0, 0), ("persistent",)),
    "lr_ramp": ((3.0, 10.0, 30.0), (50, 50, 50), ("persistent",)),  # duration = ramp length
    "schedule_bug": ((3.0, 10.0, 50.0), (40, 40, 40), ("transient", "persistent")),
    "data_corruption": ((3.0, 30.0, 1e3), (2, 8, 30), ("transient", "persistent")),
    "bit_flip": ((26.0, 28.0, 30.0), (1, 1, 1), ("transient",)),  # magnitude = bit index
    "grad_explosion": ((10.0, 1e3, 1e5), (3, 3, 3), ("transient", "persistent")),
    "overfit": ((32.0, 8.0, 2.0), (80, 80, 80), ("transient", "persistent")),  # pool size
    "input_shift": ((2.0, 0.25, 8.0), (50, 50, 50), ("transient", "persistent")),
    "weight_scale": ((3.0, 30.0, 1e3), (1, 1, 1), ("transient",)),
    "activation_spike": ((5.0, 30.0, 300.0), (1, 5, 20), ("transient",)),
    "fp16_overflow": ((math.inf, math.inf, math.inf), (1, 5, 20), ("transient", "persistent")),
    "fp16_underflow": ((1e-3, 1e-6, 1e-9), (100, 100, 100), ("transient", "persistent")),
}

#: fault kind -> scenario family of the shared public benchmark (``/work/shared/runs``)
FAMILY = {
    "lr_blowup": "lr_schedule_bug", "lr_persistent": "lr_too_high", "lr_ramp": "lr_too_high",
    "schedule_bug": "lr_schedule_bug", "data_corruption": "data_corruption",
    "bit_flip": "silent_data_corruption", "grad_explosion": "grad_explosion",
    "overfit": "overfit", "input_shift": "input_scale_shift", "weight_scale": "grad_explosion",
    "activation_spike": "silent_data_corruption", "fp16_overflow": "fp16_overflow",
    "fp16_underflow": "fp16_overflow",
}

#: modules whose outputs get activation statistics, per architecture
ACTIVATIONS = {"mlp": ["1", "3"], "gpt_pre": ["blocks.0", "blocks.1"],
               "gpt_post": ["blocks.0", "blocks.1"], "conv": ["blocks.0", "blocks.2"]}

# label definitions (see derive_label); as in /work/shared/runs/README.md
EFFECT_RATIO = 0.10  # |5-step mean loss / counterfactual - 1| above this = visible loss effect
VAL_EFFECT_RATIO = 0.05  # val_loss above (1 + this) x counterfactual = visible loss effect
FAIL_RATIO = 0.5  # 20-step mean loss above (1 + this) x counterfactual = failing
DEGRADED_RATIO = 0.10  # final train / val loss above (1 + this) x counterfactual = degraded
RUNAWAY_FACTOR = 3.0  # divergence: loss above this x the pre-onset median ...
RUNAWAY_STEPS = 20  # ... for this many consecutive steps (or non-finite)
GRAD_BAND = 1.0  # |log(5-step mean grad norm / counterfactual)| above this = signal effect
PARAM_BAND = 0.02  # |param norm / counterfactual - 1| above this = signal effect
PRE_WINDOW = 50
POST_NAN_STEPS = 50  # an unguarded run stops this many steps after its first NaN loss


@dataclass(frozen=True)
class Config:
    """One training configuration: its clean run is the counterfactual of its faulted runs."""

    index: int
    arch: str
    optimizer: str
    schedule: str
    precision: str
    seed: int
    steps: int
    batch_size: int | None = None  # None: the task's default (64 for the MLP, 16 for the LMs)


@dataclass(frozen=True)
class Fault:
    """One injected fault (a :class:`~stability.testing.tinytrain.FaultSpec` plus its class)."""

    kind: str
    strength: str
    persistence: str
    onset: int
    duration: int
    magnitude: float


def plan(n_configs: int, faults_per_config: int, steps: int, seed: int
         ) -> list[tuple[Config, list[Fault], list[str]]]:
    """The whole benchmark: configurations, their faults and the run ids (clean run first).

    Deterministic in its arguments. Architectures, optimizers and schedules cycle so every
    combination is covered evenly; fault kinds cycle over the faulted slots, strengths cycle
    once per pass over the kinds.

    Examples
    --------
    >>> p = plan(4, 3, 300, 0)
    >>> [c.arch for c, _, _ in p], [f.kind for f in p[0][1]]
    (['mlp', 'gpt_pre', 'gpt_post', 'conv'], ['lr_blowup', 'lr_persistent', 'lr_ramp'])
    """
    kinds = tuple(FAULT_GRID)
    out = []
    for i in range(n_configs):
        rng = np.random.default_rng([seed, i])
        prec = PRECISIONS[int(rng.choice(len(PRECISIONS), p=PRECISION_WEIGHTS))]
        cfg = Config(i, ARCHS[i % len(ARCHS)], OPTIMIZERS[(i // len(ARCHS)) % len(OPTIMIZERS)],
                     SCHEDULES[(i // (len(ARCHS) * len(OPTIMIZERS))) % len(SCHEDULES)], prec,
                     seed * 100_003 + i, steps)
        faults = []
        for k in range(faults_per_config):
            slot = i * faults_per_config + k
            kind = kinds[slot % len(kinds)]
            s = (slot // len(kinds)) % len(STRENGTHS)
            mags, durs, modes = FAULT_GRID[kind]
            mode = modes[int(rng.integers(len(modes)))]
            onset = int(rng.integers(int(0.4 * steps), int(0.65 * steps) + 1))
            faults.append(Fault(kind, STRENGTHS[s], mode, onset,
                                0 if mode == "persistent" else durs[s], mags[s]))
        ids = [f"bench_{i:03d}_{c}" for c in "abcdefgh"[:faults_per_config + 1]]
        perm = rng.permutation(len(ids))  # the run id says nothing about the scenario
        out.append((cfg, faults, [ids[j] for j in perm]))
    return out


def plan_clean_long(n_runs: int, steps: int, seed: int, *,
                    optimizers: Sequence[str] = OPTIMIZERS, batch_size: int | None = None,
                    prefix: str = "long") -> list[tuple[Config, list[Fault], list[str]]]:
    """``n_runs`` clean runs for false-alarm evidence, deterministic in the arguments.

    Architectures cycle fastest, precisions (fp32, bf16, fp16) next (12 runs cover every
    architecture x precision pair), optimizers and schedules rotate so every architecture meets
    every optimizer within 16 runs. Seeds are disjoint from :func:`plan`'s (offset 50,000), run
    ids ``<prefix>_<i>``. ``optimizers`` and ``batch_size`` narrow the set (e.g. small-batch
    SGD: ``("sgd",)``, 4).

    Examples
    --------
    >>> p = plan_clean_long(4, 1200, 14)
    >>> [(c.arch, c.precision, c.optimizer) for c, _, _ in p][:2]
    [('mlp', 'fp32', 'adamw'), ('gpt_pre', 'bf16', 'sgd')]
    >>> p[0][1], p[0][2]
    ([], ['long_000'])
    """
    out = []
    na, no = len(ARCHS), len(optimizers)
    for i in range(n_runs):
        cfg = Config(i, ARCHS[i % na], optimizers[(i + i // na) % no],
                     SCHEDULES[(i // na + i // (na * no)) % len(SCHEDULES)],
                     PRECISIONS[i % len(PRECISIONS)], seed * 100_003 + 50_000 + i, steps,
                     batch_size)
        out.append((cfg, [], [f"{prefix}_{i:03d}"]))
    return out


# ---------------------------------------------------------------------------- training
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


def train_one(cfg: Config, fault: Fault | None, run_id: str, runs_dir: Path,
              eval_every: int) -> Any:
    """Train and record one run into ``runs_dir/<run_id>.parquet``; returns its table."""
    import torch

    from replay.reader import read_run
    from replay.recorder import RunRecorder
    from stability.testing.tinytrain import FaultSpec, train_run

    torch.set_num_threads(1)
    spec = None if fault is None else FaultSpec(fault.kind, fault.onset, fault.duration,
                                                 fault.magnitude)
    info = {"run_id": run_id, "config": asdict(cfg),
            "fault": None if fault is None else asdict(fault),
            "generator": "benchmarks/make_benchmark.py", "generator_version": GENERATOR_VERSION,
            "torch": torch.__version__.split("+")[0]}
    tmp = runs_dir / f".tmp_{run_id}"
    if tmp.exists():
        shutil.rmtree(tmp)
    with RunRecorder(tmp, part_steps=10 * cfg.steps, metadata={"run": info}) as rec:
        train_run(cfg.arch, cfg.steps, cfg.seed, spec, recorder=rec, eval_every=eval_every,
                  checkpoint_every=0, on_step=_StopAfterNaN(), optimizer=cfg.optimizer,
                  batch_size=cfg.batch_size,
                  precision=cfg.precision, schedule=cfg.schedule,
                  guard_kwargs={"activations": ACTIVATIONS[cfg.arch], "activation_every": 10,
                                "update_ratio_every": 1})  # dense weight signals in the data
    parts = sorted(tmp.glob("part-*.parquet"))
    if len(parts) != 1:
        raise RuntimeError(f"{run_id}: expected one part file, got {len(parts)}")
    dest = runs_dir / f"{run_id}.parquet"
    os.replace(parts[0], dest)
    shutil.rmtree(tmp)
    return read_run(dest)


def _col(table: Any, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)


def _smooth(x: np.ndarray, k: int) -> np.ndarray:
    """Trailing mean over ``k`` steps (NaN / inf in the window -> ``inf``).

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


def _first(mask: np.ndarray, steps: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(steps[idx[0]]) if len(idx) else None


def derive_label(run_id: str, cfg: Config, fault: Fault | None, table: Any,
                 cf: Any | None) -> dict[str, Any]:
    """One label row; ``cf`` is the clean counterfactual (the configuration's clean run).

    * ``nan_step``: first step >= onset with a non-finite loss;
    * ``divergence_step``: first step >= onset that is non-finite or starts ``RUNAWAY_STEPS``
      consecutive steps above ``RUNAWAY_FACTOR`` x the pre-onset median loss;
    * ``effect_step``: first step >= onset where the 5-step mean loss leaves the band
      ``(1 +- EFFECT_RATIO)`` x the counterfactual's (or is non-finite), or ``val_loss`` exceeds
      ``(1 + VAL_EFFECT_RATIO)`` x the counterfactual's (null: no visible loss effect);
    * ``signal_effect_step``: the same, also counting the 5-step mean grad norm leaving
      ``exp(+-GRAD_BAND)`` x the counterfactual's and the parameter norm leaving
      ``(1 +- PARAM_BAND)`` x (faults that do not move the loss, e.g. fp16 underflow);
    * ``outcome``: ``diverged`` when the run ends non-finite or its final 20-step mean loss is
      above ``(1 + FAIL_RATIO)`` x the counterfactual's; else ``degraded`` when the final 20-step
      mean loss or the last ``val_loss`` is above ``(1 + DEGRADED_RATIO)`` x; else
      ``recovered``; ``clean`` without a fault;
    * ``failure_step`` (diverged runs): start of the final stretch in which the 20-step mean
      loss stays above ``(1 + FAIL_RATIO)`` x the counterfactual's (or is non-finite).
    """
    row: dict[str, Any] = {
        "run_id": run_id, "scenario": "clean" if fault is None else fault.kind,
        "onset_step": None, "end_step": None, "outcome": "clean", "divergence_step": None,
        "failure_step": None, "nan_step": None, "effect_step": None,
        "signal_effect_step": None, "family": "clean" if fault is None else FAMILY[fault.kind],
        "variant": "none" if fault is None else fault.kind,
        "severity": None if fault is None else fault.strength,
        "persistence": None if fault is None else fault.persistence,
        "magnitude": None if fault is None else fault.magnitude,
        "duration": None if fault is None else fault.duration,
        "model": cfg.arch, "optimizer": cfg.optimizer, "schedule": cfg.schedule,
        "precision": cfg.precision, "seed": cfg.seed, "config": cfg.index,
        "n_steps": table.num_rows, "planned_steps": cfg.steps, "prefix_identical": None,
        "pre_onset_median_loss": None, "peak_loss_ratio": None, "final_loss_ratio": None,
        "final_val_ratio": None,
    }
    if fault is None or cf is None:
        return row
    onset = fault.onset
    row["onset_step"] = onset
    if fault.duration > 0:
        row["end_step"] = onset + fault.duration - 1
    st = np.asarray(table.column("step").to_numpy(), dtype=np.int64)
    loss, val = _col(table, "loss"), _col(table, "val_loss")
    cst = np.asarray(cf.column("step").to_numpy(), dtype=np.int64)
    closs, cval = _col(cf, "loss"), _col(cf, "val_loss")
    n = min(len(st), len(cst))
    if not np.array_equal(st[:n], cst[:n]):
        raise RuntimeError(f"{run_id}: steps differ from the counterfactual's")
    pre = st[:n] < onset
    row["prefix_identical"] = bool(np.array_equal(loss[:n][pre], closs[:n][pre], equal_nan=True))
    after = st >= onset
    pre_loss = loss[(st >= onset - PRE_WINDOW) & (st < onset)]
    ref = float(np.median(pre_loss)) if len(pre_loss) else float(np.nanmedian(closs))
    row["pre_onset_median_loss"] = ref
    row["nan_step"] = _first(after & ~np.isfinite(loss), st)
    with np.errstate(invalid="ignore"):
        bad = (~np.isfinite(loss) | (loss > RUNAWAY_FACTOR * ref)) & after
    run_len = np.zeros(len(bad), dtype=np.int64)
    for i in range(len(bad) - 1, -1, -1):
        run_len[i] = (run_len[i + 1] + 1 if i + 1 < len(bad) else 1) if bad[i] else 0
    to_end = run_len == len(bad) - np.arange(len(bad))
    row["divergence_step"] = _first(bad & ((run_len >= RUNAWAY_STEPS) | to_end
                                           | ~np.isfinite(loss)), st)
    fin = loss[after & np.isfinite(loss)]
    row["peak_loss_ratio"] = float(np.max(fin) / ref) if len(fin) else None
    a = after[:n]
    s, cs = _smooth(loss[:n], 5), _smooth(closs[:n], 5)
    with np.errstate(invalid="ignore", divide="ignore"):
        dev = ~np.isfinite(s) | (np.abs(s / cs - 1.0) > EFFECT_RATIO)
        vdev = ~np.isnan(val[:n]) & ~(val[:n] <= cval[:n] * (1 + VAL_EFFECT_RATIO))
    cands = [c for c in (_first(dev & a, st[:n]), _first(vdev & a, st[:n])) if c is not None]
    row["effect_step"] = min(cands) if cands else None
    g, cg = _smooth(_col(table, "grad_norm")[:n], 5), _smooth(_col(cf, "grad_norm")[:n], 5)
    pn, cpn = _col(table, "param_norm")[:n], _col(cf, "param_norm")[:n]
    with np.errstate(invalid="ignore", divide="ignore"):
        gdev = ~np.isfinite(g) | (np.abs(np.log(g / cg)) > GRAD_BAND)
        pdev = ~np.isfinite(pn) | (np.abs(pn / cpn - 1.0) > PARAM_BAND)
    cands += [c for c in (_first(gdev & a, st[:n]), _first(pdev & a, st[:n])) if c is not None]
    row["signal_effect_step"] = min(cands) if cands else None
    # outcome against the counterfactual over the common steps (a NaN run stops early: its
    # tail is non-finite, which is what decides)
    s20, cs20 = _smooth(loss[:n], RUNAWAY_STEPS), _smooth(closs[:n], RUNAWAY_STEPS)
    with np.errstate(invalid="ignore", divide="ignore"):
        failing = ~(s20 / cs20 <= 1.0 + FAIL_RATIO) & a
    tail, ctail = loss[max(0, n - RUNAWAY_STEPS):n], closs[max(0, n - RUNAWAY_STEPS):n]
    fl = float(np.mean(tail) / np.mean(ctail)) if np.all(np.isfinite(tail)) else math.inf
    row["final_loss_ratio"] = fl if math.isfinite(fl) else None
    vi = np.flatnonzero(~np.isnan(val[:n]) & ~np.isnan(cval[:n]))
    fv = float(val[vi[-1]] / cval[vi[-1]]) if len(vi) else None
    if fv is not None and math.isfinite(fv):
        row["final_val_ratio"] = fv
    ended_bad = not np.isfinite(loss[-1]) or n < len(cst) or fl > 1.0 + FAIL_RATIO
    if ended_bad and len(failing) and failing[-1]:
        i = len(failing) - 1
        while i > 0 and failing[i - 1]:
            i -= 1
        row["failure_step"] = int(st[i])
        row["outcome"] = "diverged"
        if row["divergence_step"] is None:
            row["divergence_step"] = row["failure_step"]
    else:
        worse = fl > 1.0 + DEGRADED_RATIO or (fv is not None and not fv <= 1.0 + DEGRADED_RATIO)
        row["outcome"] = "degraded" if worse else "recovered"
    if row["effect_step"] is None and row["outcome"] != "recovered":
        row["effect_step"] = row["divergence_step"] or row["failure_step"]
    return row


def relabel_config(job: tuple[Config, list[Fault], list[str], str, int]) -> list[dict[str, Any]]:
    """Re-derive one configuration's labels from its runs already in the runs folder."""
    from replay.reader import read_run

    cfg, faults, ids, runs_dir, _ = job
    tables = [read_run(Path(runs_dir) / f"{rid}.parquet") for rid in ids]
    rows = [derive_label(ids[0], cfg, None, tables[0], None)]
    for f, rid, t in zip(faults, ids[1:], tables[1:], strict=True):
        rows.append(derive_label(rid, cfg, f, t, tables[0]))
    return rows


def run_config(job: tuple[Config, list[Fault], list[str], str, int]) -> list[dict[str, Any]]:
    """Train one configuration's clean run and its faulted runs; returns their label rows."""
    cfg, faults, ids, runs_dir, eval_every = job
    rd = Path(runs_dir)
    t0 = time.perf_counter()
    clean = train_one(cfg, None, ids[0], rd, eval_every)
    rows = [derive_label(ids[0], cfg, None, clean, None)]
    for f, rid in zip(faults, ids[1:], strict=True):
        rows.append(derive_label(rid, cfg, f, train_one(cfg, f, rid, rd, eval_every), clean))
    rows[0]["seconds"] = round(time.perf_counter() - t0, 1)
    return rows


# ---------------------------------------------------------------------------- output
INT_COLUMNS = ("onset_step", "end_step", "divergence_step", "failure_step", "nan_step",
               "effect_step", "signal_effect_step", "duration", "seed", "config", "n_steps",
               "planned_steps")
FLOAT_COLUMNS = ("magnitude", "pre_onset_median_loss", "peak_loss_ratio", "final_loss_ratio",
                 "final_val_ratio")


def write_labels(out: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """``labels.parquet`` (nullable int64 step columns) and ``labels.json``, sorted by run id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sorted(rows, key=lambda r: r["run_id"])
    cols = list(rows[0])
    fields = [pa.field(c, pa.int64() if c in INT_COLUMNS else pa.float64() if c in FLOAT_COLUMNS
                       else pa.bool_() if c == "prefix_identical" else pa.string())
              for c in cols]
    table = pa.Table.from_pylist([dict(r) for r in rows], schema=pa.schema(fields))
    pq.write_table(table, out / "labels.parquet", compression="zstd")

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    with open(out / "labels.json", "w", encoding="utf-8") as fh:
        json.dump([{k: clean(v) for k, v in r.items()} for r in rows], fh, indent=1)
        fh.write("\n")


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out: Path, args: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """``manifest.json``: sha256 per file, generator arguments, library versions."""
    import pyarrow
    import torch

    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    doc = {
        "generator": "benchmarks/make_benchmark.py", "generator_version": GENERATOR_VERSION,
        "args": dict(args), "torch": torch.__version__, "numpy": np.__version__,
        "pyarrow": pyarrow.__version__, "python": sys.version.split()[0],
        "generated_in_s": round(seconds, 1),
        "files": {str(p.relative_to(out)): sha256(p) for p in files},
    }
    with open(out / "manifest.json", "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    return doc


def composition(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown tables: runs per architecture / optimizer / precision / schedule / fault."""
    lines = []
    for col in ("model", "optimizer", "precision", "schedule", "outcome"):
        vals = sorted({str(r[col]) for r in rows})
        lines.append(f"| {col} | " + " | ".join(vals) + " |")
        lines.append("|---" * (len(vals) + 1) + "|")
        lines.append("| runs | " + " | ".join(str(sum(str(r[col]) == v for r in rows))
                                            for v in vals) + " |")
        lines.append("")
    lines.append("| fault class | runs | mild | moderate | severe | transient | persistent "
                 "| visible | diverged |")
    lines.append("|---" * 9 + "|")
    for sc in ("clean", *FAULT_GRID):
        g = [r for r in rows if r["scenario"] == sc]
        if not g:
            continue
        cnt = [sum(r["severity"] == s for r in g) for s in STRENGTHS]
        per = [sum(r["persistence"] == p for r in g) for p in ("transient", "persistent")]
        vis = sum(r["outcome"] in ("degraded", "diverged") or r["effect_step"] is not None
                  for r in g if r["outcome"] != "clean")
        div = sum(r["outcome"] == "diverged" for r in g)
        lines.append(f"| {sc} | {len(g)} | " + " | ".join(map(str, cnt + per + [vis, div]))
                     + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/data/bench14", help="output folder")
    p.add_argument("--configs", type=int, default=76,
                   help="configurations (runs = configs x (1 + faults-per-config))")
    p.add_argument("--faults-per-config", type=int, default=3)
    p.add_argument("--steps", type=int, default=240, help="steps per run")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--eval-every", type=int, default=20, help="validation period")
    p.add_argument("--jobs", type=int, default=1, help="configurations trained in parallel")
    p.add_argument("--quick", action="store_true",
                   help="a small set for tests: 10 configurations x 4 runs of 160 steps")
    p.add_argument("--clean-long", type=int, default=0, metavar="N",
                   help="instead of the benchmark: N clean runs of --steps steps over every "
                        "architecture, optimizer, schedule and precision (false-alarm evidence)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="--clean-long: comma-separated optimizers to rotate (default all)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="--clean-long: batch size of every run (default: the task's)")
    p.add_argument("--prefix", default="long", help="--clean-long: run id prefix")
    p.add_argument("--only", default=None, help="comma-separated config indices (debugging)")
    p.add_argument("--labels-only", action="store_true",
                   help="only re-derive labels.* and manifest.json from the runs in --out")
    a = p.parse_args(argv)
    if a.quick:
        a.configs, a.steps = 10, 160
    if a.steps < 60:
        p.error("--steps must be at least 60")
    out = Path(a.out)
    runs_dir = out / "runs"
    if runs_dir.exists() and not a.labels_only:
        shutil.rmtree(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if a.clean_long:
        opts = tuple(o for o in a.optimizers.split(",") if o)
        bad = [o for o in opts if o not in OPTIMIZERS]
        if bad or not opts:
            p.error(f"--optimizers: each must be one of {OPTIMIZERS}; got {a.optimizers!r}")
        todo = plan_clean_long(a.clean_long, a.steps, a.seed, optimizers=opts,
                               batch_size=a.batch_size, prefix=a.prefix)
    else:
        todo = plan(a.configs, a.faults_per_config, a.steps, a.seed)
    if a.only:
        keep = {int(x) for x in a.only.split(",")}
        todo = [t for t in todo if t[0].index in keep]
    # slow ones first (fp16 autocast is emulated on CPU; char models over the MLP)
    cost = {"fp16": 3.0, "bf16": 1.5, "fp32": 1.0}
    todo.sort(key=lambda t: -cost[t[0].precision] * (0.3 if t[0].arch == "mlp" else 1.0))
    jobs = [(c, f, ids, str(runs_dir), a.eval_every) for c, f, ids in todo]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if a.labels_only:
        rows = [r for j in jobs for r in relabel_config(j)]
        jobs = []
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            for i, r in enumerate(ex.map(run_config, jobs), 1):
                rows += r
                print(f"  [{i}/{len(jobs)}] config {r[0]['config']} {r[0]['model']} "
                      f"{r[0]['seconds']} s", flush=True)
    else:
        for i, j in enumerate(jobs, 1):
            r = run_config(j)
            rows += r
            print(f"  [{i}/{len(jobs)}] config {r[0]['config']} {r[0]['model']} "
                  f"{r[0]['seconds']} s", flush=True)
    for r in rows:
        r.pop("seconds", None)
    write_labels(out, rows)
    dt = time.perf_counter() - t0
    write_manifest(out, vars(a), dt)
    print(composition(rows))
    print(f"wrote {len(rows)} runs to {out} in {dt:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
