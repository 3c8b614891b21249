"""Print the field matrix: trainer x precision x fault x resume, with guard overhead per step.

Every cell really trains a small model on CPU (see the per-trainer modules) and reports whether
the run was rescued: clean runs must get 0 acting interventions; faulty runs must end within 5%
of the clean run's final loss (``final/clean <= 1.05``) or stop with a named cause; the resumed
run must take the same decisions as the straight one; the trainer's log must carry the
``stability/*`` keys; the user's arguments must be unchanged.

Trainers and their modules (each exposes ``run_cell(precision, fault, resume, seed=0) -> dict``
with keys ``final_loss``, ``clean_final_loss``, ``acting_interventions``, ``stopped``,
``stop_reason``, ``overhead_ms``, ``log_has_stability_keys``, ``args_unchanged``):

==============  ===============================
``torch``       ``benchmarks/field_torch.py``
``hf``          ``benchmarks/field_hf.py``
``lightning``   ``benchmarks/field_lightning.py``
==============  ===============================

A trainer whose module (or framework) is missing is skipped with a note.

Usage::

    python benchmarks/bench_field.py                       # every trainer, seed 0
    python benchmarks/bench_field.py --trainers torch --precisions fp16 --faults clean,nan_weight
    python benchmarks/bench_field.py --only scenarios      # the scenario table alone

**Scenarios** (``--only scenarios``; after the matrix by default): a pass/fail table of what a
user does with a guarded run's own trainer logs (:mod:`field_logs`): for torch (JSONL of
``guard.metrics()``), HF (``trainer_state.json``, TensorBoard; also in fp16 with start-up
scaler overflows, ``hf_fp16``) and Lightning (CSV,
TensorBoard), clean and faulty runs are replayed and watched with the default preset -- a
clean run's logs must give 0 alarms and 0 acting interventions (PASS / FAIL); for a faulty run
the table says whether its logs show the fault (``seen``: at least one alarm; ``unseen``: the
guard stopped the run between two logging steps, so no faulty value was logged) -- and
``tune -> replay``: a config tuned on ``data/runs`` must keep the default's stop of the bundled
``overfit`` run.

``bare`` is the final loss of the same faulty run without any guard (when the trainer module
has ``unguarded(precision, fault, seed)``): what the fault does to an unprotected run.
``overhead_ms`` is the median time of one guarded step (``guard.step`` / the callback hooks)
minus the median time of the same trainer's bare step, in milliseconds (CPU, 1 thread).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
TRAINERS = {"torch": "field_torch", "hf": "field_hf", "lightning": "field_lightning"}
PRECISIONS = ("fp32", "fp16", "bf16")
FAULTS = ("clean", "lr_x50", "nan_weight", "grad_explosion")
#: names the trainer modules may use for a fault (their ``FAULTS`` tuple decides)
ALIASES = {"lr_x50": ("lr_x50", "lr50", "lr_blowup_persistent")}


def fault_name(mod: ModuleType, fault: str) -> str:
    """The module's own name for ``fault`` (from its ``FAULTS``, when it has one)."""
    known = getattr(mod, "FAULTS", None)
    if not known:
        return fault
    for name in ALIASES.get(fault, (fault,)):
        if name in known:
            return name
    return fault


def load_trainer(name: str) -> tuple[ModuleType | None, str]:
    """The trainer's field module, or ``None`` and why not."""
    mod_name = TRAINERS[name]
    path = HERE / f"{mod_name}.py"
    if not path.exists():
        return None, f"{path.name} not found"
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        return None, f"cannot load {path.name}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:  # the framework is not installed
        return None, f"{type(exc).__name__}: {exc}"
    return mod, ""


def verdict(row: dict[str, Any], fault: str) -> str:
    """``ok`` or what failed, for one cell."""
    bad = []
    if not row.get("args_unchanged", False):
        bad.append("args")
    if not row.get("log_has_stability_keys", False):
        bad.append("log")
    final, clean = row.get("final_loss", math.nan), row.get("clean_final_loss", math.nan)
    if fault == "clean":
        if row.get("acting_interventions", 0):
            bad.append("acted")
    elif not (row.get("stopped") and row.get("stop_reason")) and not final <= 1.05 * clean:
        bad.append("not rescued")
    return "ok" if not bad else ",".join(bad)


def log_scenarios(trainers: list[str], faults: list[str], seed: int,
                  tune: bool = True) -> list[tuple[str, str]]:
    """``(scenario, verdict)`` rows: replay / watch of each stack's own logs (module docstring)."""
    import tempfile

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import field_logs

    rows = []
    for trainer in trainers:
        for fault in faults:
            with tempfile.TemporaryDirectory(prefix=f"field_{trainer}_") as d:
                try:
                    judged = field_logs.judge_logs(field_logs.MAKERS[trainer](d, fault, seed))
                except ImportError as exc:
                    rows.append((f"{trainer} {fault}", f"skipped ({exc})"))
                    continue
                live = (field_logs.live_alarms(d) if trainer.startswith("hf") else None)
            for log, r in judged.items():
                alarms = r["replay_alarms"] + r["watch_alarms"]
                acting = r["replay_acting"] + r["watch_acting"]
                read = r["steps"] > 0 and r["watch_steps"] > 0
                if fault == "clean" and trainer == "hf_fp16":
                    # live and the log agree: the same alarms (warnings), nothing acting
                    same = r["replay_alarm_keys"] == r["watch_alarm_keys"] == live
                    verdict = "PASS" if read and same and acting == 0 else "FAIL"
                elif fault == "clean":
                    verdict = "PASS" if read and alarms == acting == 0 else "FAIL"
                elif not read:
                    verdict = "FAIL"
                else:  # informational: a trainer logs every N steps; a guard that stopped the
                    # run between two logging steps leaves no faulty value in the log
                    verdict = "seen" if r["replay_alarms"] else "unseen"
                rows.append((f"{trainer} {fault} replay+watch {log}",
                             f"{verdict:6s} steps {r['steps']}/{r['watch_steps']}"
                             f"  alarms {r['replay_alarms']}/{r['watch_alarms']}"
                             f"  acting {r['replay_acting']}/{r['watch_acting']}"))
    if tune:
        rows.append(("tune data/runs -> replay overfit", tune_then_replay()))
    return rows


def tune_then_replay() -> str:
    """Tune on the bundled runs, replay ``overfit`` with the default and the tuned config."""
    import contextlib
    import io
    import tempfile

    from replay.cli import main as cli
    from replay.replay import replay_run

    data = HERE.parent / "data"
    if not (data / "runs" / "overfit").exists():
        return "skipped (no data/runs)"
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "tuned.toml"
        with contextlib.redirect_stdout(io.StringIO()):
            cli(["tune", str(data / "runs"), "--labels", str(data / "labels.parquet"),
                 "--budget", "5", "--folds", "0", "-o", str(out)])
        stops = []
        for cfg in ("default", str(out)):
            ivs = replay_run(data / "runs" / "overfit", cfg).interventions
            stops.append(min((i.step for i in ivs if i.type == "stop"), default=None))
    ok = stops[0] is not None and stops[0] == stops[1]
    return f"{'PASS' if ok else 'FAIL'}  stop step default {stops[0]}, tuned {stops[1]}"


def print_scenarios(args: argparse.Namespace) -> int:
    print("\nscenario                                        verdict")
    trainers = args.trainers.split(",")
    rows = log_scenarios(trainers, ["clean", "nan_weight"], args.seed)
    if "hf" in trainers:  # scaler-skipped overflow steps in the log: information, not faults
        rows[-1:-1] = log_scenarios(["hf_fp16"], ["clean"], args.seed, tune=False)
    for name, verdict in rows:
        print(f"{name:47s} {verdict}", flush=True)
    return sum(v.startswith("FAIL") for _, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("matrix", "scenarios"), default=None,
                    help="run only the trainer matrix or only the scenario table")
    args = ap.parse_args(argv)
    if args.only == "scenarios":
        failing = print_scenarios(args)
        print(f"\n{failing} failing scenario(s)")
        return 1 if failing else 0
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
    header = (f"{'trainer':9s} {'prec':5s} {'fault':15s} {'resume':6s} {'final':>9s} "
              f"{'clean':>9s} {'bare':>9s} {'ratio':>6s} {'acting':>6s} {'stop':18s} "
              f"{'ovh ms':>7s} {'same':>4s} verdict")
    print(header)
    print("-" * len(header))
    failures = 0
    t_all = time.perf_counter()
    for trainer in args.trainers.split(","):
        mod, why = load_trainer(trainer)
        if mod is None:
            print(f"{trainer:9s} skipped: {why}")
            continue
        for prec in args.precisions.split(","):
            for fault in args.faults.split(","):
                rows = {}
                for resume in (False, True):
                    try:
                        rows[resume] = mod.run_cell(prec, fault_name(mod, fault), resume,
                                                    seed=args.seed)
                    except Exception as exc:  # report the cell, go on
                        rows[resume] = {"error": f"{type(exc).__name__}: {exc}"}
                for resume, row in rows.items():
                    if "error" in row:
                        failures += 1
                        print(f"{trainer:9s} {prec:5s} {fault:15s} {str(resume):6s} "
                              f"ERROR {row['error'][:80]}")
                        continue
                    same = ""
                    if resume and "error" not in rows[False]:
                        a, b = rows[False].get("decisions"), row.get("decisions")
                        same = "-" if a is None or b is None else ("yes" if a == b else "NO")
                    v = verdict(row, fault)
                    if same == "NO":
                        v = "resume differs" if v == "ok" else v + ",resume differs"
                    failures += v != "ok"
                    final, clean = row["final_loss"], row["clean_final_loss"]
                    ratio = final / clean if clean and math.isfinite(clean) else math.nan
                    stop = (row.get("stop_reason") or "")[:18] if row.get("stopped") else "-"
                    bare = f"{'-':>9s}"
                    if not resume and fault != "clean" and hasattr(mod, "unguarded"):
                        bare = mod.unguarded(prec, fault_name(mod, fault), args.seed)
                        bare = f"{bare['final_loss']:9.4g}"
                    print(f"{trainer:9s} {prec:5s} {fault:15s} {str(resume):6s} {final:9.4g} "
                          f"{clean:9.4g} {bare} {ratio:6.3f} {row['acting_interventions']:6d} "
                          f"{stop:18s} {row['overhead_ms']:7.3f} {same:>4s} {v}", flush=True)
    print(f"\n{failures} failing cell(s); {time.perf_counter() - t_all:.0f} s")
    if args.only is None:
        failing = print_scenarios(args)
        print(f"\n{failing} failing scenario(s)")
        failures += failing
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
